"""tool_format="native": the chat template renders the tools; Hermes-style <tool_call> blocks are parsed.

No tool-trained model ships with agentkv, so this runs the loop on the scripted engine with the
bundled tokenizer and a Qwen2.5-style tool template (the format Hermes and Qwen models use).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from agentkv import Session, UserError, tool
from agentkv._conversation._tools import parse_native_output
from agentkv.testing import ScriptedEngine

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a tool with <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture
def tool_model(model_path: Path, tmp_path: Path) -> Path:
    """The bundled tokenizer with a tool-aware chat template (no weights: the engine is scripted)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return tmp_path


def call(name: str, **arguments: int) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_native_calls_run_and_results_come_back_as_tool_responses(tool_model: Path) -> None:
    with (
        ScriptedEngine(
            [call("add", a=1, b=2) + call("add", a=3, b=4), "1 + 2 = 3 and 3 + 4 = 7."], model_path=tool_model
        ) as engine,
        Session(engine=engine, tools=[add], tool_format="native", system="Be brief.") as session,
    ):
        result = session.run_sync("Add 1 + 2 and 3 + 4.")
        tokenizer_text = [engine.requests[0].prompt_token_ids, engine.requests[1].prompt_token_ids]
    assert result.text == "1 + 2 = 3 and 3 + 4 = 7." and len(result.steps) == 2
    assert [r.content for r in result.steps[0].tool_results] == ["3", "7"]
    first, second = tokenizer_text
    out = result.steps[0].token_ids
    assert list(second[: len(first) + len(out)]) == list(first) + out  # token-exact across the tool step
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(tool_model)).decode(list(second))
    assert '"name": "add"' in text and "# Tools" in text  # the template rendered the tool schema
    # both results in one user block, as the template merges consecutive tool messages
    assert "<|im_start|>user<tool_response>\n3\n</tool_response><tool_response>\n7\n</tool_response><|im_end|>" in text


@tool
def garble() -> str:
    """Text with half a surrogate pair."""
    return "half \ud800 of a pair"


def test_a_tool_result_no_tokenizer_takes_is_escaped_as_the_schema_format_escapes_it(tool_model: Path) -> None:
    """A tool's output is not the caller's text: a lone surrogate in it is written as JSON writes it, never refused."""
    scripts = {
        "native": [call("garble"), "Done."],
        "schema": [json.dumps({"tool_calls": [{"name": "garble", "arguments": {}}]}), json.dumps({"answer": "Done."})],
    }
    shown: dict[str, str] = {}
    for form, outputs in scripts.items():
        with (
            ScriptedEngine(outputs, model_path=tool_model) as engine,
            Session(engine=engine, tools=[garble], tool_format=form) as session,  # type: ignore[arg-type]
        ):
            result = session.run_sync("Garble something.")
            assert result.text == "Done."
            assert result.steps[0].tool_results[0].content == "half \ud800 of a pair"  # the tool's own output
            shown[form] = session.messages[-2].content  # the tool message the model read
            engine.assert_complete()
    assert shown["native"] == "half \\ud800 of a pair"
    assert json.dumps(garble()) in shown["schema"] and shown["native"] in shown["schema"]


def test_native_format_leaves_choice_to_the_model() -> None:
    with pytest.raises(UserError, match="native"):
        Session(tools=[add], tool_format="native", tool_choice="required")
    with pytest.raises(UserError, match="tool_format"):
        Session(tools=[add], tool_format="xml")  # type: ignore[arg-type]


def test_parse_native_output_cases() -> None:
    calls, answer, error = parse_native_output("Sure. " + call("add", a=1, b=2), call_prefix="c")
    assert error is None and answer is None and calls[0].arguments == {"a": 1, "b": 2}
    assert parse_native_output("The answer is 3.", call_prefix="c") == ([], "The answer is 3.", None)
    assert parse_native_output("<tool_call>{", call_prefix="c")[2] == "a <tool_call> block is not closed"
    assert parse_native_output("<tool_call>{nope}</tool_call>", call_prefix="c")[2] is not None
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_native_output(as_string, call_prefix="c")[0][0].arguments == {"a": 1, "b": 2}
