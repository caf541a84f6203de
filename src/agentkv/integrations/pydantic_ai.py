"""agentkv as a pydantic-ai model: `AgentKVModel` (``pip install "agentkv-vllm[pydantic-ai]"``).

Every model call of an agent run goes to the `agentkv.Session` that holds the conversation's KV
(through a `agentkv.SessionPool`); pydantic-ai runs the tools and sends their results back.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Self

from pydantic_ai.exceptions import (
    ModelContextWindowExceededError,
    ModelServerError,
    ModelUnavailableError,
)
from pydantic_ai.exceptions import UserError as PydanticAIUserError
from pydantic_ai.messages import (
    CachePoint,
    FinishReason,
    InstructionPart,
    ModelMessage,
    ModelResponse,
    ModelResponsePart,
    ModelResponseStreamEvent,
    RetryPromptPart,
    SystemPromptPart,
    TextContent,
    TextPart,
    ThinkingPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
from pydantic_ai.models._tool_choice import resolve_tool_choice
from pydantic_ai.profiles import InlineDefsJsonSchemaTransformer, ModelProfile
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext
from pydantic_ai.usage import RequestUsage

from .._conversation._conversation import Message
from .._conversation._tools import ToolCall
from .._engines import Engine
from .._errors import ContextLengthError, EngineError, EngineUnavailableError, SessionClosedError, UserError
from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from .._stats._stats import StepStats
from ._pooled import SAMPLING_NAMES, PooledAccess, PooledModel, joined_text, sampling_of

__all__ = ["AgentKVModel", "AgentKVStreamedResponse"]

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "tool_calls": "tool_call"}


class _Named:
    """The model's name, as the model and each of its streamed answers report it to pydantic-ai."""

    _model_name: str

    @property
    def model_name(self) -> str:
        return self._model_name


class AgentKVModel(_Named, PooledAccess, Model):
    """A pydantic-ai model served by agentkv: each conversation's calls run on the session holding its KV.

    Example::

        from pydantic_ai import Agent
        from agentkv.integrations.pydantic_ai import AgentKVModel

        def add(a: int, b: int) -> int:
            return a + b

        with AgentKVModel(engine=pair, max_tokens=64) as model:
            agent = Agent(model, tools=[add], instructions="Use the tools.")
            print(agent.run_sync("What is 2 + 3?").output)
            print(model.last_reply.stats.summary())

    The calls of one conversation go to one session, pinned by pydantic-ai's ``conversation_id``
    (one per run, or the one a ``message_history`` carries). The history is sent back exactly as
    this model answered it (same tool call ids and arguments), so each call after the first
    extends the session's conversation and D's KV of it is pushed back instead of recomputed.

    Function tools and output tools (structured ``output_type``) are offered to the model as
    agentkv tools; ``tool_choice``, ``max_tokens``, ``temperature``, ``seed``, ``stop_sequences``, ``top_p``,
    ``top_k``, ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` settings apply, and ``extra_body``
    takes every `agentkv.SamplingOptions` field under vLLM's name (``min_p``, ``repetition_penalty``,
    ``structured_outputs``...; another key raises `pydantic_ai.exceptions.UserError`).
    Builtin (native) tools, native structured output, images, audio, documents and other files
    raise `pydantic_ai.exceptions.UserError`; other generic settings are ignored (pydantic-ai
    warns about those that change what a request guarantees).

    Args:
        engine: an agentkv engine. One given open is shared and never closed here; one given
            unopened, or the embedded pair started when none is given, is closed by `close`
            (or at the end of ``with AgentKVModel(...) as model``).
        pool: a `SessionPool` to share (its owner closes it); not with ``engine``.
        model_name: the name pydantic-ai reports for this model.
        settings: default pydantic-ai `ModelSettings` for every request.
        session_options: keyword arguments of each `agentkv.Session` (``max_tokens``,
            ``temperature``, ``tool_format``, ``cache_salt``, ...).
    """

    unsupported_settings = frozenset(
        {
            "timeout",
            "max_retries",
            "parallel_tool_calls",
            "extra_headers",
            "citations",
            "service_tier",
        }
    )
    _unsupported_file_inputs = frozenset({"image", "document", "audio", "video"})

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        pool: SessionPool | None = None,
        model_name: str = "agentkv",
        settings: ModelSettings | None = None,
        **session_options: Any,
    ) -> None:
        with _pydantic_ai_errors(model_name):
            self._pooled = PooledModel(engine=engine, pool=pool, **session_options)
        self._model_name = model_name
        profile = ModelProfile(
            # agentkv nests each tool's schema in the output schema it forces: ``$ref``s must be inlined.
            json_schema_transformer=InlineDefsJsonSchemaTransformer,
            # how long a conversation's KV stays after its last call (the pin's TTL after its renewals): pydantic-ai
            # tells a cache collapse within it ("unexpected") from one past it ("ttl_expired")
            default_cache_retention=timedelta(seconds=self._pooled.cache_retention_s()),
        )
        super().__init__(settings=settings, profile=profile)

    @property
    def system(self) -> str:
        return "agentkv"

    def close(self) -> None:
        """Close the pool if this model started it (and with it an engine it started); later calls raise."""
        self._pooled.close()

    async def aclose(self) -> None:
        """`close`, from async code."""
        await self._pooled.aclose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        _, chat, options = self._prepare_call(messages, model_settings, model_request_parameters)
        with _pydantic_ai_errors(self._model_name):
            reply = await self._pooled.call(chat, **options)
        return ModelResponse(
            parts=_response_parts(reply),
            usage=_usage(reply.stats),
            model_name=self._model_name,
            provider_name=self.system,
            finish_reason=_FINISH_REASONS[reply.finish_reason],
            provider_details=_details(reply),
        )

    @contextlib.asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: RunContext[Any] | None = None,
    ) -> AsyncGenerator[StreamedResponse]:
        params, chat, options = self._prepare_call(messages, model_settings, model_request_parameters)
        items = self._pooled.stream(chat, deltas=True, **options)
        try:
            with _pydantic_ai_errors(self._model_name):
                first = await anext(items)  # the step started (errors before any output raise here)
            yield AgentKVStreamedResponse(
                model_request_parameters=params, _model_name=self._model_name, _first=first, _rest=items
            )
        finally:
            await items.aclose()  # stopping early cancels the step, which then changes nothing

    def _prepare_call(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> tuple[ModelRequestParameters, list[Message], dict[str, Any]]:
        """The prepared parameters, and the messages and options of `PooledModel.call` for a request."""
        settings, params = self.prepare_request(model_settings, model_request_parameters)
        if params.native_tools:
            names = ", ".join(type(tool).__name__ for tool in params.native_tools)
            raise PydanticAIUserError(f"AgentKVModel does not support builtin (native) tools: {names}")
        tools, tool_choice = _tools_and_choice(settings, params)
        instructions = InstructionPart.join(self._get_instruction_parts(messages, params) or [])
        settings = settings or {}
        options = {
            "conversation_id": _conversation_id(messages),
            "tools": tools,
            "tool_choice": tool_choice,
            "max_tokens": settings.get("max_tokens"),
            "temperature": settings.get("temperature"),
            "seed": settings.get("seed"),
            "stop": settings.get("stop_sequences"),
            "sampling": _sampling(settings) or None,
        }
        return params, _chat_messages(messages, instructions), options

    def __repr__(self) -> str:
        return f"AgentKVModel(model_name={self._model_name!r})"


@dataclass
class AgentKVStreamedResponse(_Named, StreamedResponse):
    """A streamed `AgentKVModel` answer: its text as it is generated, then its tool calls and usage."""

    _model_name: str
    _first: str | ToolCallDelta | ReasoningDelta | StepReply
    _rest: AsyncGenerator[str | ToolCallDelta | ReasoningDelta | StepReply]
    _timestamp: datetime = field(default_factory=lambda: datetime.now(UTC))

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        streamed = ""
        item = self._first
        thought = False
        with _pydantic_ai_errors(self._model_name):
            while not isinstance(item, StepReply):
                if isinstance(item, ToolCallDelta):  # its arguments as they are written; the finished call below
                    args = item.arguments or None
                    manager = self._parts_manager
                    called = manager.handle_tool_call_delta(
                        vendor_part_id=item.id, tool_name=item.name, args=args, tool_call_id=item.id
                    )
                    if called is not None:
                        yield called
                elif isinstance(item, ReasoningDelta):
                    thought = True
                    for event in self._parts_manager.handle_thinking_delta(
                        vendor_part_id="reasoning", content=item.text
                    ):
                        yield event
                else:
                    streamed += item
                    for event in self._parts_manager.handle_text_delta(vendor_part_id="answer", content=item):
                        yield event
                item = await anext(self._rest)
        reply = item
        if reply.reasoning is not None and not thought:
            yield self._parts_manager.handle_part(vendor_part_id="reasoning", part=ThinkingPart(reply.reasoning))
        if reply.text != streamed:  # the history must hold the answer exactly as the session keeps it
            yield self._parts_manager.handle_part(vendor_part_id="answer", part=TextPart(reply.text))
        for call in reply.tool_calls:
            yield self._parts_manager.handle_tool_call_part(
                vendor_part_id=call.id, tool_name=call.name, args=dict(call.arguments), tool_call_id=call.id
            )
        self._usage = _usage(reply.stats)
        self.finish_reason = _FINISH_REASONS[reply.finish_reason]
        self.provider_details = _details(reply)

    async def close_stream(self) -> None:
        await self._rest.aclose()

    @property
    def provider_name(self) -> str:
        return "agentkv"

    @property
    def provider_url(self) -> None:
        return None

    @property
    def timestamp(self) -> datetime:
        return self._timestamp


# --------------------------------------------------------------------- pydantic-ai -> agentkv


def _chat_messages(messages: Sequence[ModelMessage], instructions: str | None) -> list[Message]:
    """The conversation as agentkv messages: the same history always gives the same messages.

    The first request's leading system prompts and the instructions make the system message; a system prompt
    later in the conversation is a system message where it stands (the chat template renders it, or refuses it by
    name); each request's tool results come before its user text (tool messages follow their calls).
    """
    system: list[str] = []
    chat: list[Message] = []
    for message in messages:
        if isinstance(message, ModelResponse):
            chat.append(_assistant_message(message))
            continue
        tool_messages: list[Message] = []
        user_messages: list[Message] = []
        for part in message.parts:
            if isinstance(part, SystemPromptPart):
                if chat or tool_messages or user_messages:
                    user_messages.append(Message(role="system", content=part.content))
                else:
                    system.append(part.content)
            elif isinstance(part, UserPromptPart):
                user_messages.append(Message(role="user", content=_user_text(part)))
            elif isinstance(part, ToolReturnPart):
                tool_messages.append(_tool_message(part))
            elif isinstance(part, RetryPromptPart):  # deprecated: an agent sends a ToolReturnPart or user text
                if part.tool_name is None:
                    user_messages.append(Message(role="user", content=part.model_response()))
                else:
                    content = part.model_response()
                    tool_messages.append(Message(role="tool", content=content, tool_call_id=part.tool_call_id))
            else:
                raise PydanticAIUserError(f"AgentKVModel does not support {type(part).__name__} in a request")
        chat += tool_messages + user_messages
    system_text = "\n\n".join([*system, *([instructions] if instructions else [])])
    return [Message(role="system", content=system_text), *chat] if system_text else chat


def _user_text(part: UserPromptPart) -> str:
    def item_text(item: object) -> str | None:
        if isinstance(item, TextContent):
            return item.content
        if isinstance(item, CachePoint):  # agentkv caches every prefix anyway
            return None
        raise PydanticAIUserError(f"AgentKVModel takes text only; {type(item).__name__} is not supported")

    return joined_text(part.content, item_text, sep="\n\n")


def _tool_message(part: ToolReturnPart) -> Message:
    if part.files:
        raise PydanticAIUserError(f"AgentKVModel takes text tool results only; tool {part.tool_name!r} returned files")
    return Message(role="tool", content=part.model_response_str(), tool_call_id=part.tool_call_id)


def _assistant_message(response: ModelResponse) -> Message:
    """The assistant message as agentkv returned it (content "" when the model only called tools)."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    for part in response.parts:
        if isinstance(part, TextPart):
            texts.append(part.content)
        elif isinstance(part, ToolCallPart):
            calls.append(ToolCall(id=part.tool_call_id, name=part.tool_name, arguments=part.args_as_dict()))
        elif isinstance(part, ThinkingPart):  # the reasoning is not part of the message (the session kept its tokens)
            continue
        else:
            raise PydanticAIUserError(f"AgentKVModel does not support {type(part).__name__} in the message history")
    return Message(role="assistant", content="".join(texts), tool_calls=tuple(calls))


def _sampling(settings: ModelSettings) -> dict[str, Any]:
    """The settings that are `SamplingOptions` (pydantic-ai's names are vLLM's), and ``extra_body``'s (vLLM's names;
    ``logprobs``, whose output pydantic-ai has no place for, and any other key are refused by name)."""
    extra = settings.get("extra_body") or {}
    if not isinstance(extra, Mapping):
        raise PydanticAIUserError("AgentKVModel takes extra_body as a mapping of vLLM sampling parameters")
    unknown = sorted(str(key) for key in extra if key not in SAMPLING_NAMES or key == "logprobs")
    if unknown:
        raise PydanticAIUserError(f"AgentKVModel does not support extra_body {', '.join(unknown)}")
    return sampling_of(extra) | sampling_of(
        {name: settings.get(name) for name in ("top_p", "top_k", "presence_penalty", "frequency_penalty", "logit_bias")}
    )


def _tools_and_choice(
    settings: ModelSettings | None, params: ModelRequestParameters
) -> tuple[list[dict[str, Any]], str]:
    """The function and output tools the model may call (OpenAI tool dicts), and agentkv's ``tool_choice``."""
    definitions = [*params.function_tools, *params.output_tools]
    resolved = resolve_tool_choice(settings, params)
    if isinstance(resolved, tuple):  # only some tools, "auto" or "required"
        mode, allowed = resolved
        definitions = [tool for tool in definitions if tool.name in allowed]
        choice = definitions[0].name if mode == "required" and len(definitions) == 1 else mode
    else:
        choice = resolved if definitions else "auto"
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.parameters_json_schema},
        }
        for t in definitions
    ]
    return tools, choice


def _conversation_id(messages: Sequence[ModelMessage]) -> str | None:
    """pydantic-ai's id of the conversation (on the messages of an agent run), if any."""
    return next((m.conversation_id for m in reversed(messages) if m.conversation_id is not None), None)


# --------------------------------------------------------------------- agentkv -> pydantic-ai


def _response_parts(reply: StepReply) -> list[ModelResponsePart]:
    parts: list[ModelResponsePart] = [ThinkingPart(reply.reasoning)] if reply.reasoning is not None else []
    parts += [TextPart(reply.text)] if reply.text else []
    parts += [ToolCallPart(c.name, dict(c.arguments), tool_call_id=c.id) for c in reply.tool_calls]
    return parts


def _usage(stats: StepStats) -> RequestUsage:
    """Tokens, the cached ones (pulled back from D or found in P's cache), and where the prompt's KV came from."""
    return RequestUsage(
        input_tokens=stats.prompt_tokens,
        output_tokens=stats.output_tokens,
        cache_read_tokens=stats.prompt_tokens - stats.computed_tokens,
        details={
            "agentkv_pulled_tokens": stats.pulled_tokens,
            "agentkv_local_hit_tokens": stats.local_hit_tokens,
            "agentkv_computed_tokens": stats.computed_tokens,
        },
    )


def _details(reply: StepReply) -> dict[str, Any]:
    """agentkv's facts of the step: whether the pin was pushed back and why not (``agentkv_miss_reason``); and why
    the output could not be read as an answer or tool calls, when it could not (its raw text is then the answer)."""
    details: dict[str, Any] = {
        "agentkv_handle_forwarded": reply.stats.handle_forwarded,
        "agentkv_miss_reason": reply.stats.miss_reason,
    }
    if reply.error is not None:
        details["output_error"] = reply.error
    return details


@contextlib.contextmanager
def _pydantic_ai_errors(model_name: str) -> Iterator[None]:
    """agentkv's errors as pydantic-ai's."""
    try:
        yield
    except (UserError, SessionClosedError) as exc:
        raise PydanticAIUserError(str(exc)) from exc
    except ContextLengthError as exc:
        raise ModelContextWindowExceededError(model_name, str(exc)) from exc
    except EngineUnavailableError as exc:
        raise ModelUnavailableError(model_name, str(exc)) from exc
    except EngineError as exc:
        raise ModelServerError(model_name, str(exc)) from exc
