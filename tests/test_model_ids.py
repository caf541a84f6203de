"""Models by Hugging Face id: an ``org/name[@revision]`` resolves to its snapshot in the HF cache, for the
engines and the tokenizer alike, and an id that is neither cached nor reachable fails at once, saying what
to do. The cache here is a real hub cache laid out in ``tmp_path`` from the bundled model's folder; no
engine starts (their starts are recorded, then refused)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentkv import Colocated, EmbeddedPair, LaunchedPair, ModelPreparationError, Session, UserError, prepare_model
from agentkv._engines._server_process import ServerProcess
from agentkv._engines._vllm import AsyncLLMRunner
from agentkv._model import DEFAULT_MODEL, model_name
from agentkv._session._session import load_tokenizer
from agentkv._surfaces._cli import main

REPO = "agentkv-test/smollm2"
MAIN = "a" * 40
"""The commit ``refs/main`` names."""
V2 = "b" * 40
"""The commit the tag ``v2`` names; its snapshot differs by one file."""
ABSENT = "agentkv-test/not-cached"
QUICK_S = 3.0
"""An uncached id fails well within this (no engine, no download, no waiting on a network)."""


@pytest.fixture(scope="module")
def bundled() -> Path:
    return prepare_model()


@pytest.fixture
def hub(tmp_path: Path, bundled: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache under ``$HF_HOME/hub`` holding ``REPO`` at two commits (main, and the tag v2), offline."""
    home = tmp_path / "hf"
    repo = home / "hub" / f"models--{REPO.replace('/', '--')}"
    for commit in (MAIN, V2):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in bundled.iterdir():  # the hub links snapshot files to blobs; links to the folder do as well
            (snapshot / file.name).symlink_to(file)
    (repo / "snapshots" / V2 / "revision.txt").write_text("v2")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home / "hub"


def test_an_id_resolves_to_its_cached_snapshot(hub: Path) -> None:
    folder = prepare_model(REPO)
    assert folder == hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert model_name(folder) == REPO  # what the front door serves it as, not the commit hash
    assert model_name(prepare_model()) == DEFAULT_MODEL


def test_the_tokenizer_loads_from_the_snapshot(hub: Path, bundled: Path) -> None:
    tokenizer = load_tokenizer(str(prepare_model(REPO)))  # what a session does with the engine's model_path
    text = "What is the capital of France?"
    assert tokenizer.encode(text) == load_tokenizer(str(bundled)).encode(text)


def test_a_revision_selects_its_snapshot(hub: Path) -> None:
    snapshots = hub / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert prepare_model(f"{REPO}@main") == snapshots / MAIN
    assert prepare_model(f"{REPO}@v2") == snapshots / V2
    assert prepare_model(f"{REPO}@{V2}") == snapshots / V2  # a commit hash needs no ref
    assert (prepare_model(f"{REPO}@v2") / "revision.txt").read_text() == "v2"
    with pytest.raises(ModelPreparationError, match="@v3"):
        prepare_model(f"{REPO}@v3")


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "online"])
def test_an_uncached_id_fails_fast_and_says_what_to_do(
    hub: Path, offline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not offline:  # no network here: the hub cannot be reached, or (with network) it has no such model
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_ETAG_TIMEOUT", 1.0)  # a dropped packet waits this
    started = time.monotonic()
    with pytest.raises(ModelPreparationError) as raised:
        prepare_model(ABSENT)
    assert time.monotonic() - started < QUICK_S
    message = str(raised.value)
    assert ABSENT in message and str(hub) in message
    assert f"hf download {ABSENT}" in message and "HF_HOME" in message
    if offline:
        assert "HF_HUB_OFFLINE" in message


def test_bundled_names_and_local_folders_work_as_before(
    hub: Path, bundled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert prepare_model() == prepare_model(DEFAULT_MODEL) == bundled
    assert prepare_model(bundled) == prepare_model(str(bundled)) == bundled
    monkeypatch.chdir(tmp_path)
    local = tmp_path / REPO  # a folder that reads like an id: the folder wins, as in vLLM
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert prepare_model(REPO) == Path(REPO)
    for unknown in ("a/b/c", "not-a-bundled-model", tmp_path / "nowhere"):
        with pytest.raises(ModelPreparationError, match="neither a bundled model"):
            prepare_model(unknown)


@pytest.fixture
def started_models(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The model each engine start was given, the start then refused as unit tests refuse it."""
    models: list[str] = []

    def record(engine: Any) -> None:
        launch = engine.launch if isinstance(engine, AsyncLLMRunner) else engine.spec.launch
        models.append(launch.engine_args["model"])
        raise UserError("real engines are blocked here (recorded by tests/test_model_ids.py)")

    monkeypatch.setattr(AsyncLLMRunner, "start", record)
    monkeypatch.setattr(ServerProcess, "start", record)
    yield models


@pytest.mark.parametrize("kind", ["session", "embedded", "colocated", "launched"])
def test_every_engine_starts_on_the_snapshot(hub: Path, started_models: list[str], kind: str) -> None:
    opened = {
        "session": lambda: Session(model=f"{REPO}@v2"),
        "embedded": lambda: EmbeddedPair(f"{REPO}@v2"),
        "colocated": lambda: Colocated(f"{REPO}@v2"),
        "launched": lambda: LaunchedPair(f"{REPO}@v2", log_dir=hub.parent / "logs"),
    }[kind]
    with pytest.raises(UserError, match="recorded"), opened():
        pass
    assert started_models and set(started_models) == {
        str(hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / V2)
    }


def test_the_command_line_takes_ids(hub: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "prepare", f"{REPO}@v2"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"snapshots/{V2}")
    started = time.monotonic()
    assert main(["engine", "--role", "prefill", "--model", ABSENT, "--nixl-host", "127.0.0.1"]) == 1
    assert time.monotonic() - started < QUICK_S
    err = capsys.readouterr().err
    assert "ModelPreparationError" in err and ABSENT in err and "hf download" in err
