"""tool_format="native": the chat template renders the tools; vLLM's tool parser (hermes by default) reads the calls.

No tool-trained model ships with agentkv, so this runs the loop on the scripted engine with the
bundled tokenizer and a Qwen2.5-style tool template (the format Hermes and Qwen models use).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from agentkv import Session, ToolCallDelta, UserError, tool
from agentkv._conversation._parsers import NativeToolParser
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


def hermes_model(model_path: Path, folder: Path) -> Path:
    """``folder``: the bundled tokenizer with `HERMES_TEMPLATE`, a tool-aware chat template (no weights: for
    scripted engines)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, folder / name)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return folder


@pytest.fixture
def tool_model(model_path: Path, tmp_path: Path) -> Path:
    """The bundled tokenizer with a tool-aware chat template (no weights: the engine is scripted)."""
    return hermes_model(model_path, tmp_path)


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


def test_a_native_format_session_leaves_its_own_turns_to_the_model() -> None:
    """`Session.run`'s loop forces no call in native format (`Session.step` does, per step, as vLLM's server)."""
    with pytest.raises(UserError, match="native"):
        Session(tools=[add], tool_format="native", tool_choice="required")
    with pytest.raises(UserError, match="tool_format"):
        Session(tools=[add], tool_format="xml")  # type: ignore[arg-type]


def test_a_forced_native_step_is_forced_and_read_as_vllm_serve_forces_and_reads_it(tool_model: Path) -> None:
    """`Session.step` with ``tool_choice`` required or a tool's name in native format: the step is constrained as
    vLLM's server constrains it (its composed parser's ``adjust_request``) and read as it reads it (``parse``)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    tools = [
        {
            "type": "function",
            "function": {"name": "add", "description": "Add two integers.", "parameters": add.spec.parameters},
        }
    ]
    messages = [{"role": "user", "content": "Add 1 + 2 and 3 + 4."}]
    named = {"type": "function", "function": {"name": "add"}}
    wrote = [call("add", a=1, b=2) + "\n" + call("add", a=3, b=4), call("add", a=5, b=6), call("add") + "x"]
    wrote.append('<tool_call>\n{"name": "add", "arguments": "five"}\n</tool_call>')
    with (
        ScriptedEngine(wrote, model_path=tool_model) as engine,
        Session(engine=engine, tools=[add], tool_format="native") as session,
    ):
        both = session.step_sync(messages, tool_choice="required")
        one = session.step_sync(messages, tool_choice=named)
        session.step_sync(messages, tool_choice="required")
        odd = session.step_sync(messages, tool_choice=named)
        forced = [request.sampling.options.structured_outputs for request in engine.requests]
    assert [(c.name, c.arguments) for c in both.tool_calls] == [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]
    assert [(c.name, c.arguments) for c in one.tool_calls] == [("add", {"a": 5, "b": 6})]
    assert odd.tool_calls[0].arguments == {} and odd.tool_calls[0].arguments_json == '"five"'  # kept as vLLM keeps it
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tool_model))
    for constraint, choice in zip(forced, ["required", named], strict=False):
        request = ChatCompletionRequest(model="m", messages=[], tools=tools, tool_choice=choice)
        composed = ParserManager.get_parser(tool_parser_name="hermes", enable_auto_tools=True)
        assert composed is not None
        expected = composed(tokenizer, request.tools).adjust_request(request).structured_outputs
        assert constraint is not None and constraint["structural_tag"] == expected.structural_tag


def test_the_hermes_parser_reads_native_output(tokenizer: object) -> None:
    parser = NativeToolParser("hermes", tokenizer, {"add": add.spec})
    calls, answer, error = parser.read("Sure. " + call("add", a=1, b=2), call_prefix="c")
    assert error is None and answer is None and calls[0].arguments == {"a": 1, "b": 2} and calls[0].id == "c-0"
    assert parser.read("The answer is 3.", call_prefix="c") == ([], "The answer is 3.", None)
    assert "<tool_call>" in str(parser.read("<tool_call>{", call_prefix="c")[2])  # meant as a call: not an answer
    assert parser.read("<tool_call>{nope}</tool_call>", call_prefix="c")[2] is not None
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parser.read(as_string, call_prefix="c")[0][0].arguments == {"a": 1, "b": 2}


@pytest.mark.pair
def test_a_native_step_on_the_bundled_model_is_read_by_the_hermes_parser(pair: Any) -> None:
    """The real pair, the bundled model (no tool training): its output goes through vLLM's hermes parser as before
    (an answer, or calls whose streamed arguments join to the reply's), and the next step pushes D's KV back."""
    deltas: list[ToolCallDelta] = []
    with Session(engine=pair, tools=[add], tool_format="native", tool_call_parser="hermes", max_tokens=24) as session:
        history: list[Any] = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
        reply = session.step_sync(history, on_tool_call=deltas.append)
        if reply.tool_calls:
            history += [
                as_message(reply),
                *({"role": "tool", "tool_call_id": c.id, "content": "5"} for c in reply.tool_calls),
            ]
        else:
            history += [as_message(reply), {"role": "user", "content": "Thanks."}]
        second = session.step_sync(history)
    assert reply.error is None or "<tool_call>" in reply.step.text
    if reply.tool_calls:
        streamed = {d.index: "" for d in deltas}
        for d in deltas:
            streamed[d.index] += d.arguments
        assert [json.loads(streamed[i]) for i in sorted(streamed)] == [c.arguments for c in reply.tool_calls]
    elif reply.error is None:
        assert reply.text == reply.step.text.strip() and deltas == []
    assert second.stats.handle_forwarded and second.stats.pulled_tokens > 0


def as_message(reply: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.message.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in reply.tool_calls
        ]
    return message


def test_a_call_whose_arguments_the_model_wrote_as_a_json_string_comes_back_as_handed_out_and_keeps_the_pin() -> None:
    """vLLM's parser hands such a call's ``function.arguments`` out as the string's text; agentkv reads the object.
    Echoed back as handed out, or re-serialized from the object, the call extends the session: the pin is pushed
    back and the prompt extends the tokens the model generated."""
    from agentkv import ToolSpec
    from agentkv.testing import HonestPairEngine

    echo = ToolSpec(
        name="echo", description="Repeat.", parameters={"type": "object", "properties": {"text": {"type": "string"}}}
    )
    written = '<tool_call>\n{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}\n</tool_call>'
    for how in ("as handed out", "re-serialized"):
        outputs = iter([written, "Done."])
        with (
            HonestPairEngine(lambda request, outputs=outputs: next(outputs)) as engine,
            Session(engine=engine, tool_format="native") as s,
        ):
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Echo hi."}]
            reply = s.step_sync(messages, tools=[echo])
            assert [call.arguments for call in reply.tool_calls] == [{"text": "hi"}]
            message = reply.message.chat_dict()
            assert message["tool_calls"][0]["function"]["arguments"] == '"{\\"text\\": \\"hi\\"}"'  # vLLM's text
            if how == "re-serialized":
                message["tool_calls"][0]["function"]["arguments"] = json.dumps(reply.tool_calls[0].arguments)
            messages += [message, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "hi"}]
            second = s.step_sync(messages, tools=[echo])
        assert second.stats.handle_forwarded and second.stats.miss_reason is None, how
        engine.assert_honest()
