"""agentkv is installed as ``agentkv-vllm``: every install line of the repository says so, and an environment where
the unrelated ``agentkv`` distribution shadows ours is refused at import, naming the fix."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import agentkv
from agentkv._distribution import DISTRIBUTION, OTHER_DISTRIBUTION, check_not_shadowed, other_agentkv

ROOT = Path(__file__).parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TEXTS = sorted(
    {
        ROOT / "README.md",
        ROOT / "Makefile",
        ROOT / "pyproject.toml",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("src/**/*.py"),
        *ROOT.glob("scripts/*"),
        *ROOT.glob("examples/*"),
        *ROOT.glob("tests/*.py"),
    }
    - {Path(__file__)}
)
"""Every file a user or a contributor copies an install line from (the notebook's recipe included)."""

_WRONG_EXTRA = re.compile(r"(?<![\w./-])agentkv\\?\[")
"""``agentkv[cpu]``: the extras of the other project's distribution."""
_WRONG_INSTALL = re.compile(r"\bpip (?:install|wheel|download)\b[^\n#`;|&)]*?(?<![\w./-])agentkv(?![\w-])")
"""``pip install agentkv``: the other project (in the command's words: not in a comment after it)."""


def _lines_installing_the_other_project() -> list[str]:
    found = []
    for path in TEXTS:
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _WRONG_EXTRA.search(line) or _WRONG_INSTALL.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_every_install_line_names_our_distribution() -> None:
    assert PYPROJECT["project"]["name"] == DISTRIBUTION
    assert _lines_installing_the_other_project() == []
    own = [req for reqs in PYPROJECT["project"]["optional-dependencies"].values() for req in reqs if "agentkv" in req]
    assert own and all(req.startswith(f"{DISTRIBUTION}[") for req in own)
    assert sum(DISTRIBUTION in path.read_text(errors="replace") for path in TEXTS if path.is_file()) >= 10


def test_the_checker_finds_a_wrong_line() -> None:
    for wrong in ('pip install "agentkv[cpu]"', "pip install agentkv", "needs psycopg (``agentkv[postgresql]``)"):
        assert _WRONG_EXTRA.search(wrong) or _WRONG_INSTALL.search(wrong), wrong
    for right in (
        'pip install "agentkv-vllm[cpu]"',
        "pip uninstall -y agentkv",
        "python -m agentkv",
        "pip install dist/agentkv_vllm-1.0.0-py3-none-any.whl",
    ):
        assert not (_WRONG_EXTRA.search(right) or _WRONG_INSTALL.search(right)), right


def test_the_wheel_named_in_the_docs_is_the_one_the_checkout_builds() -> None:
    name, version = PYPROJECT["project"]["name"].replace("-", "_"), PYPROJECT["project"]["version"]
    wheels = set(re.findall(r"\b[\w.-]+-py3-none-any\.whl", (ROOT / "docs" / "install.md").read_text()))
    assert wheels == {f"{name}-{version}-py3-none-any.whl"}
    assert agentkv.__version__ == version


def test_the_version_is_no_older_release_of_the_other_project() -> None:
    """The other project was at 0.9.1 when we renamed; ours was 0.1.0."""
    major, minor, _ = (int(part) for part in PYPROJECT["project"]["version"].split("."))
    assert (major, minor) >= (1, 0)


def test_install_md_says_the_other_distribution_must_not_be_installed() -> None:
    text = " ".join((ROOT / "docs" / "install.md").read_text().split())
    assert f"pip uninstall -y {OTHER_DISTRIBUTION}" in text
    assert "must not be installed" in text


def _dist_info(folder: Path, name: str, entry_points: str) -> Path:
    info = folder / name
    info.mkdir(parents=True)
    (info / "entry_points.txt").write_text(entry_points)
    return info


def test_the_other_agentkv_beside_ours_is_refused_by_name(tmp_path: Path) -> None:
    info = _dist_info(tmp_path, "agentkv-0.9.1.dist-info", "[console_scripts]\nagentkv = agentkv.cli:main\n")
    assert other_agentkv([str(tmp_path)]) == info
    with pytest.raises(ImportError, match=r"'agentkv' 0\.9\.1 .* pip uninstall -y agentkv && pip install"):
        check_not_shadowed([str(tmp_path)])


def test_an_old_release_of_ours_is_not_taken_for_it(tmp_path: Path) -> None:
    _dist_info(
        tmp_path, "agentkv-0.1.0.dist-info", "[vllm.general_plugins]\nagentkv = _agentkv_vllm._patches:install\n"
    )
    _dist_info(tmp_path, "agentkv_vllm-1.0.0.dist-info", "")
    assert other_agentkv([str(tmp_path)]) is None
    check_not_shadowed([str(tmp_path)])


def test_importing_agentkv_beside_the_other_one_fails_with_the_fix(tmp_path: Path) -> None:
    _dist_info(tmp_path, "agentkv-0.9.1.dist-info", "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-c", "import agentkv"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "ImportError: the distribution 'agentkv' 0.9.1" in done.stderr
    assert f"pip install --force-reinstall --no-deps {DISTRIBUTION}" in done.stderr
