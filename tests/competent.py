"""A competent model, scripted for `HonestPairEngine`: what LangChain's standard chat-model suite asks of a model.

It reads the prompt as the model would (the doubles' tokenizer) and answers as a capable instruction-tuned model
does: it calls a tool when a call is forced or the user names the tool, with the arguments the user gave (numbers
in order, quoted names); it answers after a tool result with that result; it writes JSON that fits a forced schema;
otherwise it answers in a sentence. It never claims anything about KV: the honest double checks every pin.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agentkv._conversation._light_tokenizer import LightTokenizer
from agentkv._doubles._scripted import TEST_MODEL
from agentkv.engines import StepRequest

_TOKENIZER = LightTokenizer(TEST_MODEL)

_MESSAGE = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)", re.DOTALL)


def messages_of(request: StepRequest) -> list[tuple[str, str]]:
    """The prompt's messages, (role, text), as the chat template wrote them (SmolLM2's ChatML)."""
    text = _TOKENIZER.decode(list(request.prompt_token_ids), skip_special_tokens=False)
    found: list[tuple[str, str]] = _MESSAGE.findall(text)
    return found[:-1] if found and found[-1] == ("assistant", "") else found  # the generation prompt


def respond(request: StepRequest) -> str:
    messages = messages_of(request)
    users = [text for role, text in messages if role == "user"]
    question = users[-1] if users else ""
    last_role = messages[-1][0] if messages else "user"
    schema = request.sampling.json_schema
    forced = request.sampling.options.structured_outputs
    if schema is not None:
        return json.dumps(_tool_output(schema, question, tool_result=last_role == "tool", last=messages[-1][1]))
    if forced is not None:
        if "json" in forced:
            return json.dumps(_value(forced["json"], question, "", forced["json"]))
        return json.dumps(
            {"setup": "Why did the cat sit on the computer?", "punchline": "To keep an eye on the mouse."}
        )
    if last_role == "tool":
        return f"The tool says: {_result_text(messages[-1][1])}."
    return _answer(question)


def _answer(question: str) -> str:
    if not question.strip():
        return "Hello! How can I help you today?"
    return "Hello! I am a helpful assistant, and you asked: " + question.strip()[:60]


def _result_text(tool_message: str) -> str:
    try:
        result = json.loads(tool_message)
    except json.JSONDecodeError:
        return tool_message.strip()
    return str(result.get("result", result)) if isinstance(result, dict) else str(result)


def _tool_output(schema: dict[str, Any], question: str, *, tool_result: bool, last: str) -> dict[str, Any]:
    """An output the schema-format schema allows: an answer, or calls of its tools."""
    variants = schema.get("anyOf", [schema])
    calls = next((v for v in variants if "tool_calls" in v.get("properties", {})), None)
    answers = next((v for v in variants if "answer" in v.get("properties", {})), None)
    if calls is None or (answers is not None and tool_result):
        text = f"The result is {_result_text(last)}." if tool_result else _answer(question)
        return {"answer": text}
    tools = calls["properties"]["tool_calls"]["items"]["anyOf"]
    named = [t for t in tools if t["properties"]["name"]["const"] in question]
    if answers is not None and not named:  # the model may answer, and nothing asks for a tool by name
        if not any(word in question.lower() for word in ("weather", "use the tool", "tool", "customer", "add")):
            return {"answer": _answer(question)}
    chosen = (named or tools)[0]
    definitions = schema.get("$defs", {})
    arguments = _value(chosen["properties"]["arguments"], question, "", {"$defs": definitions})
    return {"tool_calls": [{"name": chosen["properties"]["name"]["const"], "arguments": arguments}]}


def _value(
    schema: dict[str, Any], question: str, key: str, root: dict[str, Any], numbers: list[int] | None = None
) -> Any:
    """A value the schema allows, taken from the question where it says one (numbers in order, a quoted name)."""
    if numbers is None:
        numbers = [int(n) for n in re.findall(r"-?\d+", question)]
    if "$ref" in schema:
        schema = root.get("$defs", {}).get(schema["$ref"].split("/")[-1], {})
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        return _value(options[0], question, key, root, numbers) if options else None
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        required = schema.get("required", list(properties))
        return {
            name: _value(properties[name], question, name, root, numbers) for name in properties if name in required
        }
    if kind == "array":
        return [_value(schema.get("items", {}), question, key, root, numbers)]
    if kind == "integer":
        return numbers.pop(0) if numbers else 3
    if kind == "number":
        return float(numbers.pop(0)) if numbers else 3.0
    if kind == "boolean":
        return True
    quoted = re.findall(r"'([^']+)'", question)
    if quoted and "name" in key:
        return quoted[0]
    if "location" in key or "city" in key:
        return "San Francisco, CA"
    if key == "setup":
        return "Why did the cat sit on the computer?"
    if key == "punchline":
        return "To keep an eye on the mouse."
    return f"{key or 'value'} for: {question.strip()[:40]}"
