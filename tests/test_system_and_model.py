"""Core split, port and process helpers; the model cache never serves a half-written folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentkv import ModelPreparationError, prepare_model
from agentkv._engines._system import alive, cpu_list, descendants, free_port, split_cores
from agentkv._model import BUNDLED_MODELS, DEFAULT_MODEL


def test_cores_are_split_without_overlap() -> None:
    assert split_cores([0, 1]) == ([0], [1])
    p, d = split_cores(range(64))
    assert len(p) == len(d) == 32 and not set(p) & set(d)
    assert split_cores([0, 1, 2]) == ([0, 1], [2])
    assert split_cores([5]) == ([5], [5])  # one core: shared, with a warning


def test_cpu_list_is_the_form_vllm_takes() -> None:
    assert cpu_list([0]) == "0"
    assert cpu_list([3, 0, 1, 2, 5]) == "0-3,5"


def test_free_port_and_process_helpers() -> None:
    assert 0 < free_port() < 65536
    assert os.getpid() in alive([os.getpid()])
    assert os.getpid() not in descendants(os.getpid())


def test_an_interrupted_preparation_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    target = tmp_path / "models" / DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a folder left by an interrupted run: no completion marker
    converted: list[Path] = []

    def fake_convert(gguf: Path, out: Path, progress: object) -> None:
        converted.append(out)
        (out / "config.json").write_text(json.dumps({"fake": True}))

    monkeypatch.setattr("agentkv._model._convert_gguf", fake_convert)
    assert prepare_model() == target
    assert json.loads((target / "config.json").read_text()) == {"fake": True}
    assert converted and converted[0] != target  # written elsewhere, moved into place when complete
    assert prepare_model() == target and len(converted) == 1  # a second start reuses it


def test_unknown_models_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelPreparationError, match="neither a bundled model"):
        prepare_model(tmp_path / "nowhere")
    assert DEFAULT_MODEL in BUNDLED_MODELS
