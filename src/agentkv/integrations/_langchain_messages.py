"""LangChain's messages as the OpenAI chat dicts agentkv reads, and agentkv's replies as LangChain's messages and
chunks (src/agentkv/integrations/langchain.py's `ChatAgentKV` uses both ways)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from .._stats._stats import StepStats
from .._surfaces._openai_chat import StreamedCalls
from ._pooled import joined_text

__all__ = ["Streamed", "chunk_of", "chunks_of", "openai_messages", "result_of"]

Item = str | ToolCallDelta | ReasoningDelta | StepReply
"""What the pool streams (``deltas=True``): answer text, tool-call and reasoning pieces, then the reply."""


_CALL_BLOCKS = frozenset({"tool_call", "tool_use", "tool_call_chunk", "invalid_tool_call", "function_call"})
"""An AI message's content blocks that repeat its ``tool_calls`` (LangChain v1's, Anthropic's ``tool_use``, OpenAI
Responses' ``function_call``): the calls are read from ``tool_calls``."""
_REASONING_BLOCKS = frozenset({"reasoning", "thinking", "redacted_thinking"})
"""An AI message's reasoning (LangChain v1's, Anthropic's): not part of the message the model reads back (a session
keeps the tokens it generated; a history written elsewhere is re-rendered without it, as chat templates do)."""


def openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the OpenAI chat dicts a pool step reads (content blocks of the common providers read:
    LangChain v1's, OpenAI's and Anthropic's, whose ``tool_result`` blocks in a human message are tool messages)."""
    converted: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if isinstance(message, SystemMessage):
            converted.append({"role": "system", "content": _text(index, message)})
        elif isinstance(message, HumanMessage):
            converted += _human_messages(index, message)
        elif isinstance(message, AIMessage):
            calls = [
                {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["args"]}}
                for call in message.tool_calls
            ]
            converted.append({"role": "assistant", "content": _text(index, message), "tool_calls": calls})
        elif isinstance(message, ToolMessage):
            converted.append({"role": "tool", "content": _text(index, message), "tool_call_id": message.tool_call_id})
        else:
            raise NotImplementedError(
                f"message {index}: ChatAgentKV reads system, human, AI and tool messages, not {type(message).__name__}"
            )
    return converted


def _human_messages(index: int, message: HumanMessage) -> list[dict[str, Any]]:
    """A human message; Anthropic's ``tool_result`` blocks in it come first, as the tool messages they are."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    results = [b for b in message.content if isinstance(b, dict) and b.get("type") == "tool_result"]
    rest = [b for b in message.content if not (isinstance(b, dict) and b.get("type") == "tool_result")]
    converted = [
        {
            "role": "tool",
            "tool_call_id": str(result.get("tool_use_id")),
            "content": _text(index, HumanMessage(result.get("content") or "")),
        }
        for result in results
    ]
    if rest or not results:
        converted.append({"role": "user", "content": _text(index, HumanMessage(rest))})
    return converted


def _text(index: int, message: BaseMessage) -> str:
    ai = isinstance(message, AIMessage)

    def block_text(block: dict[str, Any]) -> str | None:
        kind = block.get("type")
        if kind == "text":
            return str(block.get("text", ""))
        if ai and (kind in _CALL_BLOCKS or kind in _REASONING_BLOCKS):
            return None
        raise NotImplementedError(
            f"message {index}: ChatAgentKV reads text only, not {kind!r} content "
            "(images, audio and files are not supported)"
        )

    return joined_text(message.content, block_text)


def result_of(reply: StepReply, model_name: str) -> ChatResult:
    message = AIMessage(
        content=reply.text,
        additional_kwargs={"reasoning_content": reply.reasoning} if reply.reasoning is not None else {},
        tool_calls=[tool_call(name=call.name, args=call.arguments, id=call.id) for call in reply.tool_calls],
        usage_metadata=_usage(reply.stats),
        response_metadata=_response_metadata(reply, model_name),
    )
    return ChatResult(generations=[ChatGeneration(message=message)])


class Streamed:
    """What a stream gave so far: the answer's pieces, and the tool calls' (LangChain joins chunks by call index)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.text: list[str] = []
        self.calls = StreamedCalls()


def chunks_of(items: Iterator[Item], model_name: str) -> Iterator[ChatGenerationChunk]:
    streamed = Streamed(model_name)
    for item in items:
        yield chunk_of(item, streamed)


def chunk_of(item: Item, streamed: Streamed) -> ChatGenerationChunk:
    """A text, reasoning (``additional_kwargs["reasoning_content"]``) or tool-call piece (its id and name first,
    then its arguments), or the last chunk: the rest of the text and of the tool calls, usage and stats."""
    if isinstance(item, ToolCallDelta):
        streamed.calls.add(item)
        piece = tool_call_chunk(
            name=item.name, args=item.arguments, id=item.id if item.name else None, index=item.index
        )
        return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[piece]))
    if isinstance(item, ReasoningDelta):
        return ChatGenerationChunk(
            message=AIMessageChunk(content="", additional_kwargs={"reasoning_content": item.text})
        )
    if isinstance(item, str):
        streamed.text.append(item)
        return ChatGenerationChunk(message=AIMessageChunk(content=item))
    so_far = "".join(streamed.text)
    rest = item.text[len(so_far) :] if item.text.startswith(so_far) else ""
    calls = []
    for index, call in enumerate(item.tool_calls):
        arguments = streamed.calls.rest(index, call)
        if index not in streamed.calls.announced:
            calls.append(tool_call_chunk(name=call.name, args=arguments, id=call.id, index=index))
        elif arguments:
            calls.append(tool_call_chunk(name=None, args=arguments, id=None, index=index))
    message = AIMessageChunk(
        content=rest,
        tool_call_chunks=calls,
        usage_metadata=_usage(item.stats),
        response_metadata=_response_metadata(item, streamed.model_name),
        chunk_position="last",
    )
    return ChatGenerationChunk(message=message)


def _usage(stats: StepStats) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=stats.prompt_tokens,
        output_tokens=stats.output_tokens,
        total_tokens=stats.prompt_tokens + stats.output_tokens,
        input_token_details={"cache_read": stats.prompt_tokens - stats.computed_tokens},
    )


def _response_metadata(reply: StepReply, model_name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "model_name": model_name,
        "finish_reason": reply.finish_reason,
        "agentkv": reply.stats.model_dump(),
    }
    if reply.error is not None:
        metadata["agentkv_error"] = reply.error  # the output could not be read; it is the message's text
    return metadata
