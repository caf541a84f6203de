"""An example of examples/ imported as a module, for the tests that run its ``main`` on the shared engines."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """examples/``name``.py as a module (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
