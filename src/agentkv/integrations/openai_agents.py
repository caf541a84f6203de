"""agentkv as a model of openai-agents (``pip install "agentkv-vllm[openai-agents]"``).

`AgentKVModel` implements openai-agents' `Model`: the framework's `Runner` runs the agent loop
and the tools; every model call of a conversation goes to one pinned `agentkv.Session` (through
a `agentkv.SessionPool`), so each call after the first pulls the conversation's KV back from D.
`AgentKVProvider` serves it as a `ModelProvider` for ``RunConfig(model_provider=...)``.

The framework's input items and tools become chat messages with its own Chat Completions
converter, and the reply becomes its output items the same way, so what the runner sends back
next call is exactly what agentkv answered (same tool call ids and arguments).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import Any, cast

from agents.agent_output import AgentOutputSchemaBase
from agents.exceptions import ModelBehaviorError
from agents.exceptions import UserError as AgentsUserError
from agents.handoffs import Handoff
from agents.items import ModelResponse, TResponseInputItem, TResponseStreamEvent
from agents.model_settings import ModelSettings
from agents.models.chatcmpl_converter import Converter
from agents.models.chatcmpl_helpers import ChatCmplHelpers
from agents.models.chatcmpl_stream_handler import ChatCmplStreamHandler
from agents.models.interface import Model, ModelProvider, ModelTracing
from agents.retry import ModelRetryAdvice, ModelRetryAdviceRequest
from agents.tool import FunctionTool, Tool
from agents.tracing import GenerationSpanData, Span, generation_span
from agents.usage import Usage
from openai import AsyncStream, omit
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.responses import Response, ResponseOutputMessage, ResponseOutputText, ResponseUsage
from openai.types.responses.response_prompt_param import ResponsePromptParam

from .._conversation._conversation import Message
from .._conversation._transcript import MessageLike
from .._engines import Engine
from .._errors import EngineUnavailableError
from .._errors import UserError as AgentKVUserError
from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from .._surfaces._logprobs import logprob_writer
from .._surfaces._openai_chat import CompletionIds, StreamedCalls, chat_message, chunk
from .._surfaces._openai_responses import ResponsesRequest, response_object, response_usage, status_of
from .._surfaces._response_store import MemoryResponseStore, ResponseStore, StoredResponse
from ._pooled import SAMPLING_NAMES, PooledAccess, PooledModel, sampling_of

__all__ = ["AgentKVModel", "AgentKVProvider"]

MODEL_NAME = "agentkv"
"""The model name in the framework's responses and traces (the engine serves one model)."""

REMEMBERED_RESPONSES = 256
"""How many recent responses a model keeps the conversation of, for ``previous_response_id``."""

_ECHOED_REQUEST = ResponsesRequest(input=[], parallel_tool_calls=False)
"""What a streamed response says of its request (the door's `response_object` of it): tool choice auto, no tools
listed, no parallel calls."""

_SAMPLING_SETTINGS = ("top_p", "frequency_penalty", "presence_penalty")
"""`ModelSettings` fields that are `SamplingOptions` fields of the same name (``top_logprobs`` is ``logprobs``)."""
_ACCEPTED_EXTRA_ARGS = ("seed", "stop", "prompt_cache_key", *sorted(SAMPLING_NAMES - {"logprobs"}))
"""``extra_args`` read: ``seed``, ``stop`` (as the chat-completions ``stop``), every `SamplingOptions` field under
vLLM's name but ``logprobs`` (which is ``top_logprobs``), and ``prompt_cache_key`` (the conversation's identity:
`_identity`)."""


class AgentKVModel(PooledAccess, Model):
    """An openai-agents `Model` running on an agentkv engine, one pinned session per conversation.

    Example::

        from agents import Agent, Runner, function_tool
        from agentkv.integrations.openai_agents import AgentKVModel

        @function_tool
        def add(a: int, b: int) -> int:
            "Add two integers."
            return a + b

        with AgentKVModel(engine=pair, max_tokens=48) as model:
            agent = Agent(name="calc", instructions="Use the tools.", tools=[add], model=model)
            result = Runner.run_sync(agent, "What is 2 + 3?")
            print(result.final_output, model.last_reply.stats.summary())

    Args:
        engine: an agentkv engine, open or not. One given open is its owner's to close; one given
            unopened, or the embedded pair started when none is given, `close` closes.
        pool: a `SessionPool` shared with other adapters (its owner closes it); not with ``engine``.
        response_store: where responses and named conversations are kept (its owner closes it); default:
            this model's memory, the last `REMEMBERED_RESPONSES` responses.
        session_options: keyword arguments of each `agentkv.Session` (``max_tokens``,
            ``temperature``, ``seed``, ``tool_format``, ``cache_salt``, ...).

    Conversations: the runner sends the whole conversation each call, and the pool finds the
    session whose history it extends. With ``Runner.run(..., conversation_id=...)`` that id names
    the conversation's session; the framework then sends only new items, and the model adds them
    to the conversation it keeps for that id. With ``previous_response_id`` (or
    ``auto_previous_response_id``) the model continues the conversation of that response, which
    it keeps for its last `REMEMBERED_RESPONSES` responses; an id it does not know raises
    `agents.exceptions.UserError`. Both live in a `ResponseStore`, the front door's (`agentkv.serve`):
    by default one in this object's memory; give ``response_store=SqliteResponseStore(path)`` and a
    model made again on the same file (another process, after a restart) continues them.

    Sampling: ``temperature``, ``max_tokens``, ``top_p``, ``frequency_penalty``, ``presence_penalty`` and
    ``top_logprobs`` (the output text's ``logprobs``; `get_response` only) apply, and ``extra_args`` takes
    ``seed``, ``stop`` and every `agentkv.SamplingOptions` field under vLLM's name (``top_k``, ``min_p``,
    ``repetition_penalty``, ``logit_bias``, ``structured_outputs``...).
    Function tools and handoffs only: hosted tools, structured output (``output_type``),
    reusable prompts, images, ``top_logprobs`` when streaming and other ``extra_args`` raise
    `agents.exceptions.UserError`.
    """

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        pool: SessionPool | None = None,
        response_store: ResponseStore | None = None,
        **session_options: Any,
    ):
        self._pooled = PooledModel(engine=engine, pool=pool, **session_options)
        self._owns_store = response_store is None
        self._store = MemoryResponseStore(REMEMBERED_RESPONSES) if response_store is None else response_store
        """Response ids -> the conversation through that response (no system message); a named conversation's
        latest under `_conversation_key` (its id)."""

    # ----------------------------------------------------------------- agentkv side

    async def close(self) -> None:
        """Close the pool if this model started it (and the engine, if it started that); forget the conversations."""
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        if self._owns_store:  # its memory is forgotten; a store the caller gave stays theirs
            self._store = MemoryResponseStore(REMEMBERED_RESPONSES)
        self._pooled.close()

    def __enter__(self) -> AgentKVModel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._close()

    async def __aenter__(self) -> AgentKVModel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ----------------------------------------------------------------- the framework's Model

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: ResponsePromptParam | None = None,
    ) -> ModelResponse:
        call = _Call.build(system_instructions, input, model_settings, tools, output_schema, handoffs, prompt)
        history = self._history(previous_response_id, conversation_id)
        with _generation(tracing) as span, self._pooled.claimed(_identity(conversation_id, model_settings)) as named:
            reply = await self._pooled.call([*call.system, *history, *call.new], conversation_id=named, **call.options)
            usage = Usage(requests=1, **response_usage(reply))
            _record_usage(span, usage, reply)
        _check_readable(reply)
        response_id = self._remember([*history, *call.new, reply.message], conversation_id)
        # the door's message without its reasoning: get_response has given no reasoning item (stream_response does)
        message = {key: value for key, value in chat_message(reply).items() if key != "reasoning_content"}
        items = Converter.message_to_output_items(ChatCompletionMessage.model_validate(message))
        if model_settings.top_logprobs is not None:
            await _attach_logprobs(items, reply, self._pooled.pool, model_settings.top_logprobs)
        return ModelResponse(output=items, usage=usage, response_id=response_id)

    async def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        *,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: ResponsePromptParam | None = None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        """`get_response`, as the framework's stream events: the answer's text deltas, then the
        tool calls, then ``response.completed`` with the output items and usage."""
        call = _Call.build(system_instructions, input, model_settings, tools, output_schema, handoffs, prompt)
        if model_settings.top_logprobs is not None:
            raise AgentsUserError("AgentKVModel writes top_logprobs in get_response only, not when streaming")
        history = self._history(previous_response_id, conversation_id)
        response_id = _new_response_id()
        ids = CompletionIds(response_id, int(time.time()), MODEL_NAME)
        opened = response_object(_ECHOED_REQUEST, response_id=response_id, created_at=ids.created, model=MODEL_NAME)
        finished: list[StepReply] = []

        async def chunks() -> AsyncGenerator[ChatCompletionChunk]:
            """The door's chunks of the step (`agentkv._surfaces._openai_chat.chunk`), the usage in one of its own."""
            messages = [*call.system, *history, *call.new]
            with self._pooled.claimed(_identity(conversation_id, model_settings)) as named:
                async for piece in step_chunks(messages, named):
                    yield piece

        async def step_chunks(messages: list[MessageLike], named: str | None) -> AsyncGenerator[ChatCompletionChunk]:
            stream = self._pooled.stream(messages, conversation_id=named, deltas=True, **call.options)
            streamed = StreamedCalls()
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    if isinstance(item, ToolCallDelta):  # the handler streams a call's arguments as they come
                        streamed.add(item)
                        pieces = [chunk("tool_call", ids, call=item)]
                    elif isinstance(item, ReasoningDelta):  # the handler makes a reasoning item of these
                        pieces = [chunk("reasoning", ids, text=item.text)]
                    elif isinstance(item, str):
                        pieces = [chunk("text", ids, text=item)]
                    else:
                        _check_readable(item)
                        self._remember([*history, *call.new, item.message], conversation_id, response_id)
                        finished.append(item)
                        pieces = [chunk("end", ids, reply=item, streamed=streamed), chunk("usage", ids, reply=item)]
                    for piece in pieces:
                        yield ChatCompletionChunk.model_validate(piece)

        with _generation(tracing) as span:
            async with contextlib.aclosing(chunks()) as stream:
                events = ChatCmplStreamHandler.handle_stream(
                    Response.model_validate(opened), cast(AsyncStream[ChatCompletionChunk], stream), model=MODEL_NAME
                )
                async for event in events:
                    if event.type == "response.completed":  # the handler's copy of the opened response, finished
                        event.response.status = status_of(finished[-1])
                        if event.response.usage is not None:
                            _record_usage(span, event.response.usage, finished[-1])
                    yield event

    def _supports_default_prompt_cache_key(self) -> bool:
        """The runner gives this model its ``prompt_cache_key`` (openai-agents asks models for it by this name): a
        key of the run's conversation, SDK session or trace group routes the call to that conversation's session."""
        return True

    def get_retry_advice(self, request: ModelRetryAdviceRequest) -> ModelRetryAdvice | None:
        """An unreachable server of a launched or remote pair may be retried: the failed call changed nothing."""
        if isinstance(request.error, EngineUnavailableError):
            return ModelRetryAdvice(suggested=True, replay_safety="safe", reason=str(request.error))
        return None

    # ----------------------------------------------------------------- conversations

    def _history(self, previous_response_id: str | None, conversation_id: str | None) -> list[MessageLike]:
        """The conversation before the items the framework sends (it sends only new ones when it names one)."""
        if previous_response_id is not None and conversation_id is not None:
            raise AgentsUserError("give conversation_id or previous_response_id, not both")
        if conversation_id is not None:
            kept = self._store.get(_conversation_key(conversation_id))
            return list(kept.messages) if kept is not None else []
        if previous_response_id is None:
            return []
        stored = self._store.get(previous_response_id)
        if stored is None:
            raise AgentsUserError(
                f"previous_response_id {previous_response_id!r} is not one this AgentKVModel's response store "
                "keeps: agentkv cannot rebuild that conversation from the new items alone; send the whole "
                "conversation (result.to_input_list()) instead"
            )
        return list(stored.messages)

    def _remember(
        self, conversation: list[MessageLike], conversation_id: str | None, response_id: str | None = None
    ) -> str:
        """Keep the conversation through a reply under its response id (and conversation id); return the id."""
        response_id = response_id or _new_response_id()
        messages = tuple(m.chat_dict() if isinstance(m, Message) else dict(m) for m in conversation)
        self._store.put(StoredResponse(response_id, conversation_id, messages, {}))
        if conversation_id is not None:
            self._store.put(StoredResponse(_conversation_key(conversation_id), conversation_id, messages, {}))
        return response_id


class AgentKVProvider(ModelProvider):
    """A `ModelProvider` whose every model name is one `AgentKVModel` (the engine serves one model).

    Example::

        from agents import RunConfig, Runner

        with AgentKVProvider(engine=pair, max_tokens=48) as provider:
            result = Runner.run_sync(agent, "Hi", run_config=RunConfig(model_provider=provider))

    Takes `AgentKVModel`'s arguments; `aclose` (or leaving ``with``) closes the model and what it
    started. The runner never closes a provider it was given.
    """

    def __init__(self, *, engine: Engine | None = None, pool: SessionPool | None = None, **session_options: Any):
        self.model = AgentKVModel(engine=engine, pool=pool, **session_options)

    def get_model(self, model_name: str | None) -> Model:
        return self.model

    async def aclose(self) -> None:
        await self.model.close()

    def __enter__(self) -> AgentKVProvider:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.model.__exit__(*exc_info)


# --------------------------------------------------------------------- the framework's shapes


class _Call:
    """One model call's new messages and options, from the framework's arguments (unsupported features raise)."""

    def __init__(self, system: list[MessageLike], new: list[MessageLike], options: dict[str, Any]) -> None:
        self.system = system
        self.new = new
        self.options = options

    @classmethod
    def build(
        cls,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        settings: ModelSettings,
        tools: Sequence[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: Sequence[Handoff],
        prompt: ResponsePromptParam | None,
    ) -> _Call:
        if output_schema is not None and not output_schema.is_plain_text():
            raise AgentsUserError(
                f"AgentKVModel does not support structured output (output_type {output_schema.name()}); "
                "use a plain-text agent, or a function tool the model calls with the structure"
            )
        if prompt is not None:
            raise AgentsUserError("AgentKVModel does not support reusable prompts (prompt=); give instructions")
        for tool in tools:
            if not isinstance(tool, FunctionTool):
                raise AgentsUserError(
                    f"AgentKVModel runs function tools only; the hosted tool {tool.name!r} "
                    f"({type(tool).__name__}) is not supported"
                )
        extra_args = settings.extra_args or {}
        extra = [key for key in extra_args if key not in _ACCEPTED_EXTRA_ARGS]
        if extra:
            names = ", ".join(f"extra_args[{k!r}]" for k in extra)
            raise AgentsUserError(f"AgentKVModel does not support the model settings {names}")
        sampling = sampling_of(extra_args) | sampling_of({n: getattr(settings, n) for n in _SAMPLING_SETTINGS})
        if settings.top_logprobs is not None:
            sampling["logprobs"] = settings.top_logprobs
        chat_tools = [Converter.tool_to_openai(t) for t in tools] + [
            Converter.convert_handoff_tool(h) for h in handoffs
        ]
        tool_choice = Converter.convert_tool_choice(settings.tool_choice)
        options: dict[str, Any] = {
            "tools": chat_tools,
            "tool_choice": "auto" if tool_choice is omit else tool_choice,
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
            "seed": extra_args.get("seed"),
            "stop": extra_args.get("stop"),
            "sampling": sampling or None,
        }
        new = cast(list[MessageLike], Converter.items_to_messages(input, strict_feature_validation=True))
        system: list[MessageLike] = [{"role": "system", "content": system_instructions}] if system_instructions else []
        return cls(system, new, options)


async def _attach_logprobs(items: list[Any], reply: StepReply, pool: SessionPool, top: int) -> None:
    """The reply's token logprobs on its output text, as the framework's chat-completions model attaches them
    (token strings as vLLM's server writes them: `agentkv._surfaces._logprobs`)."""
    writer = await logprob_writer(pool, top, as_token_ids=False)
    assert writer is not None
    tokens = [ChatCompletionTokenLogprob.model_validate(entry) for entry in writer.rest(reply)]
    logprobs = ChatCmplHelpers.convert_logprobs_for_output_text(tokens)
    for item in items:
        if isinstance(item, ResponseOutputMessage):
            for part in item.content:
                if isinstance(part, ResponseOutputText):
                    part.logprobs = logprobs


def _conversation_key(conversation_id: str) -> str:
    """Where a named conversation's latest state is kept in the response store (no response id has a colon)."""
    return f"conversation:{conversation_id}"


def _new_response_id() -> str:
    return f"agentkv-{uuid.uuid4().hex}"


@contextlib.contextmanager
def _generation(tracing: ModelTracing) -> Iterator[Span[GenerationSpanData]]:
    """The model call's trace span; agentkv's usage errors in it as the framework's (engine and context-length
    errors stay agentkv's)."""
    with generation_span(model=MODEL_NAME, disabled=tracing.is_disabled()) as span:
        try:
            yield span
        except AgentKVUserError as exc:
            raise AgentsUserError(str(exc)) from exc


def _identity(conversation_id: str | None, settings: ModelSettings) -> str | None:
    """The pool's name for the call's conversation: the runner's ``conversation_id``, else a ``prompt_cache_key``
    that outlives one run (the runner's key of an SDK session or a trace group, or the caller's own); a key of one
    run only (``agents-sdk:run:...``) names nothing the messages do not already find."""
    if conversation_id is not None:
        return conversation_id
    key = (settings.extra_args or {}).get("prompt_cache_key")
    if not isinstance(key, str) or not key or key.startswith("agents-sdk:run:"):
        return None
    return f"prompt_cache_key:{key}"


def _record_usage(span: Span[GenerationSpanData], usage: Usage | ResponseUsage, reply: StepReply) -> None:
    """The call's usage on its trace span: tokens, the cached ones, and agentkv's facts of the step (exporters keep
    keys they do not know under ``details``): whether the pin was pushed back, why not, where the KV came from."""
    stats = reply.stats
    span.span_data.usage = {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cached_tokens": stats.prompt_tokens - stats.computed_tokens,
        "details": {
            "agentkv_handle_forwarded": stats.handle_forwarded,
            "agentkv_miss_reason": stats.miss_reason,
            "agentkv_pulled_tokens": stats.pulled_tokens,
            "agentkv_local_hit_tokens": stats.local_hit_tokens,
            "agentkv_computed_tokens": stats.computed_tokens,
            "agentkv_ttft_s": stats.ttft_s,
        },
    }


def _check_readable(reply: StepReply) -> None:
    if reply.error is not None:
        raise ModelBehaviorError(
            f"agentkv could not read the model's output ({reply.error}; finish_reason {reply.finish_reason})"
        )
