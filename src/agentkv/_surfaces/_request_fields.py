"""What the front door does with every request field: honoured, refused by name, or accepted with no effect.

One table per API (`CHAT_FIELDS` for ``POST /v1/chat/completions``, `RESPONSES_FIELDS` for ``POST /v1/responses``)
covers every field of vLLM's own request model and the OpenAI fields agentkv refuses, so that no field is
silently dropped: tests/test_request_fields.py fails when an installed vLLM adds a field the table lacks, and
docs/serve.md lists exactly these rows. A field the table does not know is ignored, as vLLM's server ignores
it, and logged by name (a warning, once per name).

A refused field is refused only when set to something other than vLLM's default (`FieldRule.accepts`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .._errors import UserError

__all__ = ["CHAT_FIELDS", "RESPONSES_FIELDS", "FieldRule", "check_fields"]

logger = logging.getLogger("agentkv")

Status = Literal["honoured", "refused", "no effect"]


@dataclass(frozen=True)
class FieldRule:
    """One request field: what the door does with it, and why."""

    status: Status
    reason: str
    accepts: tuple[object, ...] = ()
    """For a refused field: the values taken all the same (vLLM's default, null): they ask for nothing."""


def _honoured(reason: str) -> FieldRule:
    return FieldRule("honoured", reason)


def _refused(reason: str, *accepts: object) -> FieldRule:
    return FieldRule("refused", reason, (None, *accepts))


def _no_effect(reason: str) -> FieldRule:
    return FieldRule("no effect", reason)


_TOOLS = "the tools the model may call this step (OpenAI tool dicts; see docs/tools.md)"
_SAMPLING = "SamplingOptions.{} (vLLM's meaning; omitted: the server's default, as for temperature)"
_TEMPLATE = "agentkv renders every step with the model's own chat template, the same way each step"
_RENDER_ONLY = "vLLM reads it on its render endpoints only and ignores it when generating: so does agentkv"
_KEY = (
    "a conversation's key: the first given of the x-session-id header, session_id, conversation_id and "
    "prompt_cache_key names it (at most 256 visible ASCII characters)"
)


def _sampling_rules(*names: str) -> dict[str, FieldRule]:
    """The rules of request fields that are the `SamplingOptions` fields of the same names."""
    return {name: _honoured(_SAMPLING.format(name)) for name in names}


_COMMON: dict[str, FieldRule] = {
    "model": _honoured(
        "with agentkv serve --served-model-name, one of those names or none (another is vLLM's 404, The model `x` "
        "does not exist. Valid aliases: ...); without it, any name; the reply names the first (GET /v1/models lists them)"
    ),
    "tools": _honoured(_TOOLS),
    "tool_choice": _honoured(
        "auto, required, none or a named function (native format: forced with vLLM's own grammar and read as vLLM"
        " reads it; schema format: agentkv's JSON)"
    ),
    "parallel_tool_calls": _honoured("false: the reply gives the first call only, as vLLM's server filters it"),
    "temperature": _honoured(
        "the step's temperature; omitted: the server's default, as vLLM's: agentkv serve takes the model's "
        "generation_config.json (--generation-config, --override-generation-config), else 1.0"
    ),
    **_sampling_rules("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"),
    **_sampling_rules("ignore_eos", "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens"),
    "logit_bias": _honoured(_SAMPLING.format("logit_bias") + "; token ids as JSON keys"),
    "seed": _honoured("the step's sampling seed"),
    "stop": _honoured("up to 4 stop strings; the answer ends before the first"),
    "top_logprobs": _honoured("SamplingOptions.logprobs: this many alternatives per output token (at most 20)"),
    "stream": _honoured("server-sent events as the answer is generated"),
    "user": _no_effect("OpenAI's end-user id: metadata, never a conversation's key (at most 256 characters)"),
    "priority": _refused(
        "agentkv's engines serve every step first come, first served (priority puts only pin releases ahead)", 0
    ),
    "cache_salt": _honoured(
        "salts the prefix cache over the tenant's own salt, as vLLM checks it (at most 128 characters, no @ / \\"
        " or NUL)"
    ),
    "prompt_cache_key": _honoured(_KEY),
    "conversation_id": _honoured(_KEY + "; what vLLM's multi-turn benchmark sends"),
    "kv_transfer_params": _refused("agentkv moves the KV between its prefill and decode engines itself", {}),
    "vllm_xargs": _refused("agentkv's engines take no per-request extra arguments (custom logits processors)", {}),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    **_COMMON,
    "messages": _honoured("the whole conversation; the pool finds the session that holds its KV"),
    "logprobs": _honoured("true: choice.logprobs.content, per output token (with top_logprobs alternatives)"),
    "max_tokens": _honoured("the most tokens of the step (max_completion_tokens first, as vLLM)"),
    "max_completion_tokens": _honoured("the most tokens of the step"),
    "stream_options": _honoured("include_usage: a last chunk with usage; continuous_usage_stats: refused"),
    "response_format": _honoured(
        "text, json_object or json_schema become SamplingOptions.structured_outputs as vLLM maps them "
        "(over structured_outputs); structural_tag is refused: use structured_outputs.structural_tag"
    ),
    "structured_outputs": _honoured(_SAMPLING.format("structured_outputs") + "; not with schema-format tools"),
    **_sampling_rules("min_tokens", "spaces_between_special_tokens", "allowed_token_ids", "bad_words"),
    "session_id": _honoured(_KEY + ": the pool's routing key"),
    "request_id": _honoured(
        "the reply's id, as vLLM writes it (chatcmpl-<request_id>), and the x-request-id header; at most 256 "
        "visible ASCII characters"
    ),
    "return_tokens_as_token_ids": _honoured("logprob tokens are written token_id:<id>, as vLLM writes them"),
    "n": _refused("one choice per request: a session continues one conversation", 1),
    "use_beam_search": _refused("beam search is not served (a session continues one sampled output)", False),
    "length_penalty": _no_effect("a beam-search setting: vLLM uses it only with use_beam_search (refused here)"),
    "watermarking": _refused("agentkv's engines do not watermark their output", False),
    "reasoning_effort": _refused(_TEMPLATE + ", which takes no reasoning effort"),
    "thinking_token_budget": _refused("agentkv's engines take no thinking budget"),
    "include_reasoning": _refused("the reasoning is not split from the answer, so it cannot be left out", True),
    "truncate_prompt_tokens": _refused(
        "a conversation longer than the context is refused (context_length_exceeded), never cut: the pinned KV "
        "is the whole conversation's"
    ),
    "truncation_side": _no_effect("vLLM uses it only with truncate_prompt_tokens (refused here)"),
    "prompt_logprobs": _refused("most of the prompt is not computed (its KV is pulled back or cached)"),
    "logprob_token_ids": _refused("log probabilities of chosen token ids are not reported", []),
    "echo": _refused("the reply is the new message only", False),
    "add_generation_prompt": _refused(_TEMPLATE + ", always asking for the assistant's next message", True),
    "continue_final_message": _refused(_TEMPLATE + ", always asking for a new assistant message", False),
    "add_special_tokens": _refused("the chat template adds the special tokens; nothing more is added", False),
    "documents": _refused(_TEMPLATE + " from the messages and tools only"),
    "chat_template": _refused(_TEMPLATE),
    "chat_template_kwargs": _honoured(
        "extra arguments of the model's chat template (e.g. enable_thinking), as vLLM passes them: those the template "
        "reads; chat_template and tokenize refused; at most 16 KiB of JSON, 8 levels deep"
    ),
    "media_io_kwargs": _refused("text only: there is no media to load", {}),
    "mm_processor_kwargs": _refused("text only: there is no multimodal input to process", {}),
    "mm_payload": _no_effect(_RENDER_ONLY),
    "return_mm_kwargs": _no_effect(_RENDER_ONLY),
    "return_token_offsets": _no_effect(_RENDER_ONLY),
    "return_token_ids": _refused("the reply carries no token ids (usage counts them)", False),
    "return_prompt_text": _refused("the reply carries no prompt text", False),
    "routed_experts_prompt_start": _no_effect(
        "vLLM reads it only when it returns routed experts, which agentkv's engines never do"
    ),
    "ec_transfer_params": _refused("agentkv moves no encoder cache: text only", {}),
    "repetition_detection": _refused("agentkv's engines do not end outputs on repeated n-grams"),
    "stream_interval": _no_effect(
        "a streaming granularity hint: agentkv's chunks follow its engines' own deltas (the text is the same)"
    ),
    "audio": _refused("audio output is not supported (an OpenAI field; vLLM ignores it)"),
    "modalities": _refused("only text is supported (an OpenAI field; vLLM ignores it)"),
    "prediction": _refused("predicted outputs are not supported (an OpenAI field; vLLM ignores it)"),
}
"""Every field of ``POST /v1/chat/completions``: vLLM's `ChatCompletionRequest` and three OpenAI fields."""

RESPONSES_FIELDS: dict[str, FieldRule] = {
    **_COMMON,
    "parallel_tool_calls": _refused("false: the Responses door gives every call the model wrote", True, None),
    "input": _honoured("a string or items: messages, function_call and function_call_output items"),
    "instructions": _honoured("the system message (not carried over by previous_response_id, as OpenAI)"),
    "max_output_tokens": _honoured("the most tokens of the step"),
    "previous_response_id": _honoured("continues a kept response's conversation"),
    "store": _honoured(
        "false: the response is not kept for previous_response_id and GET; taken as false when the server keeps no "
        "responses (agentkv serve --no-store-responses, as vLLM without its store)"
    ),
    "text": _honoured("text.format json_schema or json_object become SamplingOptions.structured_outputs"),
    "truncation": _refused("a conversation longer than the context is refused, never cut", "disabled"),
    "metadata": _honoured(
        "echoed in the response and kept with it; OpenAI's bounds: 16 pairs, keys of 64 and values of 512 characters"
    ),
    "reasoning": _refused(_TEMPLATE + ", which takes no reasoning options"),
    "include_reasoning": _refused("the reasoning is not split from the answer, so it cannot be left out", True),
    "include": _refused(
        "nothing extra is included: the output text's logprobs (message.output_text.logprobs) are not written in "
        "Responses output yet (chat completions write them)",
        [],
    ),
    "top_logprobs": _no_effect("vLLM reads it only with include message.output_text.logprobs (refused here)"),
    "background": _refused("background responses are not supported", False),
    "service_tier": _no_effect("one tier: vLLM too takes the value and serves every request alike"),
    "prompt": _refused("prompt templates are not supported"),
    "max_tool_calls": _refused("every tool call the model makes is returned"),
    "conversation": _refused(
        "conversation objects are not supported: chain responses with previous_response_id (an OpenAI field; "
        "vLLM ignores it)"
    ),
    "stream_options": _no_effect(
        "an OpenAI field (include_obfuscation) vLLM ignores: agentkv's events have no padding"
    ),
    "structured_outputs": _honoured(_SAMPLING.format("structured_outputs") + "; not with text.format (as vLLM)"),
    "session_id": _honoured(_KEY),
    "request_id": _honoured(
        "echoed in the x-request-id header; the response's id is the server's own (resp_...): a client's id never "
        "names a stored response"
    ),
    "user": _no_effect(
        "echoed in the response; metadata, never a key: responses chain by previous_response_id (at most 256 "
        "characters)"
    ),
    "watermarking": _refused("agentkv's engines do not watermark their output", False),
    "media_io_kwargs": _refused("text only: there is no media to load", {}),
    "mm_processor_kwargs": _refused("text only: there is no multimodal input to process", {}),
    "mm_payload": _no_effect(_RENDER_ONLY),
    "return_mm_kwargs": _no_effect(_RENDER_ONLY),
    "enable_response_messages": _refused("the response carries output items only, not the rendered messages", False),
    "previous_input_messages": _refused("harmony messages are not served: send input items", []),
    "ec_transfer_params": _refused("agentkv moves no encoder cache: text only", {}),
    "chat_template_kwargs": _honoured(
        "extra arguments of the model's chat template (e.g. enable_thinking), as vLLM passes them: those the template "
        "reads; chat_template and tokenize refused; at most 16 KiB of JSON, 8 levels deep"
    ),
}
"""Every field of ``POST /v1/responses`` (vLLM's `ResponsesRequest`); tests/test_request_fields.py checks it."""


def _same(value: object, accepted: object) -> bool:
    return value is accepted or (type(value) is type(accepted) and value == accepted)


def check_fields(body: Mapping[str, Any], table: Mapping[str, FieldRule]) -> None:
    """Refuse (`UserError`, naming it) each field of ``body`` the table refuses and that asks for something;
    log the fields the table does not know (ignored, as vLLM ignores them)."""
    unknown = sorted(name for name in body if name not in table)
    for name, value in body.items():
        rule = table.get(name)
        if rule is not None and rule.status == "refused" and not any(_same(value, a) for a in rule.accepts):
            raise UserError(f"{name} is not supported: {rule.reason}")
    for name in unknown:
        _log_unknown(name)


_LOGGED: set[str] = set()


def _log_unknown(name: str) -> None:
    if name not in _LOGGED and len(_LOGGED) < 1024:  # bounded: a client's made-up names cannot grow it forever
        _LOGGED.add(name)
        logger.warning("agentkv serve: request field %r is not an API field and is ignored (as vLLM ignores it)", name)
