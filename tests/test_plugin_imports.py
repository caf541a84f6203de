"""What agentkv's vLLM plugin loads into every process vLLM starts: only itself and the standard library.

vLLM runs the ``vllm.general_plugins`` entry points in each of its processes, a user's unrelated
``vllm serve`` included, so the plugin (``src/_agentkv_vllm/``) must never import agentkv, whose
package brings the session layer, the front door (starlette, uvicorn), openai and httpx. No engine
starts here; that the patches still find their targets in vLLM is tests/test_vllm_patches.py.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import _agentkv_vllm

PLUGIN = Path(_agentkv_vllm.__file__).parent
NEVER_IN_A_VLLM_PROCESS = ("agentkv", "agentkv._session", "starlette", "uvicorn", "openai", "httpx")
"""Loading the plugin as vLLM does must leave each of these out of ``sys.modules``."""
ALLOWED_IN_THE_PLUGIN = {"_agentkv_vllm", "vllm", "nixl", "torch"}
"""Top-level packages the plugin's code may import (beside the standard library); vLLM, NIXL and torch
only inside the functions that patch them, in processes that have imported them already."""

_LOAD_AS_VLLM_DOES = """
    import json, sys
    from importlib.metadata import entry_points

    [plugin] = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "agentkv"]
    before = set(sys.modules)
    plugin.load()()  # vLLM's load_general_plugins: load, then call
    print(json.dumps({"entry_point": plugin.value, "new": sorted(set(sys.modules) - before)}))
"""

pytestmark = pytest.mark.compat  # also the compatibility tier's (make compat: scripts/compat.py)


def _load_in_a_fresh_interpreter(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LOAD_AS_VLLM_DOES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def test_vllm_loads_only_the_plugin_and_the_standard_library() -> None:
    """A vLLM process agentkv did not start (no ``AGENTKV_ENGINE``): the call is a no-op, and cheap."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("AGENTKV_")}
    loaded = _load_in_a_fresh_interpreter(env)
    assert loaded["entry_point"] == "_agentkv_vllm._patches:install"
    new = loaded["new"]
    assert isinstance(new, list)
    assert "_agentkv_vllm._patches" in new
    assert not [name for name in NEVER_IN_A_VLLM_PROCESS if name in new]
    foreign = [n for n in new if n.split(".")[0] != "_agentkv_vllm" and n.split(".")[0] not in sys.stdlib_module_names]
    assert not foreign, foreign


def test_the_plugin_never_imports_agentkv_nor_a_third_party_package() -> None:
    """Every import statement in the plugin's modules, in functions too (those run once vLLM is loaded)."""
    found: dict[str, set[str]] = {}
    for module in sorted(PLUGIN.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue  # a relative import stays in the plugin
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(module.name)
    assert "vllm" in found  # the walk sees the imports inside the patching functions
    outside = {name: where for name, where in found.items() if name not in ALLOWED_IN_THE_PLUGIN}
    outside = {name: where for name, where in outside.items() if name not in sys.stdlib_module_names}
    assert not outside, outside
