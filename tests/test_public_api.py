"""The public surface: everything in __all__, sorted, importable without vLLM."""

from __future__ import annotations

import subprocess
import sys

import agentkv


def test_all_is_sorted_and_complete() -> None:
    names = [name for name in agentkv.__all__ if name != "__version__"]
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
    for name in agentkv.__all__:
        assert hasattr(agentkv, name), name


def test_public_names_report_the_public_module() -> None:
    assert agentkv.Session.__module__ == "agentkv"
    assert agentkv.EmbeddedPair.__module__ == "agentkv"


def test_errors_form_one_tree() -> None:
    for name in (
        "UserError",
        "InvalidMessageError",
        "SessionClosedError",
        "ContextLengthError",
        "EngineError",
        "EngineDeadError",
        "EngineStartError",
        "TemplateError",
        "ModelPreparationError",
    ):
        assert issubclass(getattr(agentkv, name), agentkv.AgentKVError)


def test_import_does_not_load_vllm() -> None:
    code = "import sys, agentkv, agentkv.testing; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
