"""agentkv's distribution name, and the unrelated project that installs a package of the same name.

agentkv is published as the distribution ``agentkv-vllm`` (`DISTRIBUTION`); its import package is ``agentkv``.
The distribution named ``agentkv`` on PyPI is another project ("The SQLite of agent memory"), which also installs
a top-level package ``agentkv``: installed beside agentkv-vllm, the two write over each other's files, and
whichever comes first on ``sys.path`` answers ``import agentkv``. `check_not_shadowed` runs when ``agentkv`` is
imported (this module's import runs it) and refuses to go on in such an environment, naming the fix (docs/install.md).

The check reads the folders of ``sys.path`` for an ``agentkv-<version>.dist-info`` (about a millisecond;
``importlib.metadata`` took 200 ms here). Releases of this project before the rename (0.1.x, installed from a
checkout) were named ``agentkv`` too; they register agentkv's vLLM plugin, which the other project does not, and
are not taken for it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["DISTRIBUTION", "OTHER_DISTRIBUTION", "check_not_shadowed", "other_agentkv"]

DISTRIBUTION = "agentkv-vllm"
"""What ``pip install`` takes to install agentkv (the import package stays ``agentkv``)."""
OTHER_DISTRIBUTION = "agentkv"
"""The unrelated project on PyPI whose package is also named ``agentkv``."""
_OUR_PLUGIN = "_agentkv_vllm"
"""Named in the entry points of every release of ours, under either name (the vLLM plugin)."""


def other_agentkv(path: Iterable[str] | None = None) -> Path | None:
    """The ``dist-info`` folder of the unrelated ``agentkv`` distribution on ``path`` (default ``sys.path``), or
    None when it is not installed there."""
    prefix = f"{OTHER_DISTRIBUTION}-"
    for entry in sys.path if path is None else path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix) and name.endswith(".dist-info"):
                found = Path(entry or ".") / name
                if not _is_ours(found):
                    return found
    return None


def _is_ours(dist_info: Path) -> bool:
    try:
        return _OUR_PLUGIN in (dist_info / "entry_points.txt").read_text(encoding="utf-8")
    except OSError:
        return False


def check_not_shadowed(path: Iterable[str] | None = None) -> None:
    """Raise `ImportError` when the unrelated ``agentkv`` distribution is installed on ``path`` (default
    ``sys.path``): its package and this one overwrite each other's files."""
    found = other_agentkv(path)
    if found is None:
        return
    version = found.name.removesuffix(".dist-info").partition("-")[2]
    raise ImportError(
        f"the distribution {OTHER_DISTRIBUTION!r} {version} ({found}) is installed in this environment. It is "
        f"another project, not agentkv's ({DISTRIBUTION!r}): both install a package named 'agentkv' and overwrite "
        f"each other's files. Remove it and reinstall agentkv: pip uninstall -y {OTHER_DISTRIBUTION} && "
        f"pip install --force-reinstall --no-deps {DISTRIBUTION} (docs/install.md)"
    )


check_not_shadowed()  # on import: `agentkv/__init__.py` imports this module first
