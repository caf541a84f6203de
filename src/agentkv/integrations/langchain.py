"""agentkv as a LangChain chat model (LangChain and LangGraph agents): `ChatAgentKV`.

Needs ``langchain-core`` (``pip install "agentkv-vllm[langchain]"``); LangGraph is optional.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelConnectionError,
    ModelError,
    ModelInvalidRequestError,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import BaseModel, PrivateAttr

from .._engines import Engine
from .._engines._sampling import SamplingOptions
from .._errors import (
    AgentKVError,
    ContextLengthError,
    EngineDeadError,
    EngineError,
    EngineUnavailableError,
    UserError,
)
from .._session._pool import SessionPool
from .._session._results import ReasoningDelta, StepReply, ToolCallDelta
from .._stats._stats import StepStats
from .._surfaces._openai_chat import StreamedCalls
from ._pooled import SAMPLING_NAMES, PooledAccess, PooledModel, joined_text, sampling_of

__all__ = ["ChatAgentKV"]

_Item = str | ToolCallDelta | ReasoningDelta | StepReply
"""What the pool streams (``deltas=True``): answer text, tool-call and reasoning pieces, then the reply."""

_CALL_OPTIONS = ("tools", "tool_choice", "max_tokens", "temperature", "seed", "sampling")
_SAMPLING_OPTIONS = SAMPLING_NAMES - {"logprobs"}
"""Call options passed on as `SamplingOptions` under vLLM's names (``logprobs``: LangChain's own meaning, refused)."""
"""What a call may carry besides the messages (``bind_tools`` binds the first two)."""

_LANGCHAIN_ERRORS: tuple[tuple[type[AgentKVError], type[ModelError]], ...] = (
    (ContextLengthError, ContextOverflowError),
    (UserError, ModelInvalidRequestError),  # bad messages or call options
    (EngineUnavailableError, ModelConnectionError),  # the next call tries again
    (EngineDeadError, ModelError),  # not worth retrying: the engine is closed
    (EngineError, ModelAPIError),
)


class ChatAgentKV(PooledAccess, BaseChatModel):
    """A LangChain chat model whose calls run on agentkv sessions, one per conversation.

    Every call sends the whole conversation; it goes to the session that holds that
    conversation's KV (its LangGraph thread, else the session whose history the messages
    extend exactly), so D's KV of everything before is pushed back instead of recomputed.
    Tools bound with `bind_tools` come back as `AIMessage.tool_calls` for your code (or
    LangGraph's ``ToolNode``) to run; send the `AIMessage` back unchanged.

        from langchain_core.messages import HumanMessage
        from langchain_core.tools import tool

        @tool
        def add(a: int, b: int) -> int:
            '''Add two integers.'''
            return a + b

        model = ChatAgentKV(engine=pair, max_tokens=48)
        messages = [HumanMessage("What is 1234 + 4321?")]
        reply = model.bind_tools([add], tool_choice="any").invoke(messages)
        messages += [reply, *(add.invoke(call) for call in reply.tool_calls)]
        print(model.bind_tools([add]).invoke(messages).content)
        model.close()

    Args:
        engine: an agentkv engine. One given open stays open (its owner closes it); one given
            unopened, or the embedded pair started when none is given, `close` closes.
        pool: a `SessionPool` shared with other models (its owner closes it); not with ``engine``
            or session options.
        max_tokens, temperature, seed: sampling of every call (default: the session's);
            ``model.bind(max_tokens=...)`` or ``invoke(..., max_tokens=...)`` set them per call.
        options: the other `Session` options (``system``, ``tool_format``, ``cache_salt``, ...),
            `SessionPool`'s (``max_sessions``, ``idle_ttl_s``) and `BaseChatModel`'s fields.

    Stop sequences (``invoke(..., stop=[...])``) end the answer before the first one (`Session.step`'s
    ``stop``). Bound or call options under vLLM's names (``model.bind(top_p=0.9, top_k=20)``: every
    `agentkv.SamplingOptions` field but ``logprobs``), or ``sampling={...}``, set the call's sampling
    over the session's (``sampling=`` of the model: every call's). Not supported (a clear error): images
    and other non-text content, structured output other than by tool calling, ``logprobs``, and other
    call options.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None

    _pooled: PooledModel = PrivateAttr()
    _running: set[str] = PrivateAttr(default_factory=set)
    _running_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, *, engine: Engine | None = None, pool: SessionPool | None = None, **options: Any) -> None:
        fields = {name: options.pop(name) for name in list(options) if name in type(self).model_fields}
        super().__init__(**fields)
        self._pooled = PooledModel(engine=engine, pool=pool, **options)

    # ----------------------------------------------------------------- agentkv side

    def close(self) -> None:
        """Close the pool if this model started it (and with it an engine it started)."""
        self._pooled.close()

    # ----------------------------------------------------------------- LangChain side

    @property
    def _llm_type(self) -> str:
        return "agentkv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed}

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """The model with ``tools`` offered on every call.

        ``tool_choice``: ``"auto"`` (default), ``"any"``/``"required"``/``True`` (a call is
        forced), ``"none"``, a tool's name, or OpenAI's ``{"type": "function", ...}`` dict.
        """
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        return self.bind(tools=[convert_to_openai_tool(tool) for tool in tools], **kwargs)

    def with_structured_output(
        self, schema: dict[str, Any] | type, *, include_raw: bool = False, **kwargs: Any
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Structured output by tool calling (``method="function_calling"``, the default), the only method."""
        method = kwargs.get("method") or "function_calling"
        if method != "function_calling":
            raise NotImplementedError(
                f"ChatAgentKV gives structured output by tool calling only, not method={method!r}"
            )
        return super().with_structured_output(schema, include_raw=include_raw, **kwargs)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chat, options = _openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            reply = self._pooled.call_sync(chat, conversation_id=conversation_id, **options)
        return _result(reply)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        chat, options = _openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            reply = await self._pooled.call(chat, conversation_id=conversation_id, **options)
        return _result(reply)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        chat, options = _openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            home = self.pool.home  # the pool's loop thread: the stream runs there; closed early, it cancels the step
            assert home is not None  # set when the pool opened
            items = self._pooled.stream(chat, conversation_id=conversation_id, deltas=True, **options)
            yield from _chunks(home.iterate(items))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        chat, options = _openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            streamed = _Streamed()
            async for item in self._pooled.stream(chat, conversation_id=conversation_id, deltas=True, **options):
                yield _chunk(item, streamed)

    # ----------------------------------------------------------------- helpers

    def _call_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The pool's step options from the model's fields and the call's (bound) options."""
        kwargs.pop("stream", None)  # LangChain's own switch, already acted on
        unknown = sorted(set(kwargs) - set(_CALL_OPTIONS) - _SAMPLING_OPTIONS)
        if unknown:
            raise NotImplementedError(f"ChatAgentKV does not support the call options {', '.join(unknown)}")
        sampling = sampling_of({name: kwargs.pop(name) for name in list(kwargs) if name in _SAMPLING_OPTIONS})
        options: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed}
        options.update(kwargs)
        if sampling:  # over a bound sampling=, field by field
            given = options.get("sampling")
            base = given.model_dump(exclude_unset=True) if isinstance(given, SamplingOptions) else dict(given or {})
            options["sampling"] = base | sampling
        if stop:
            options["stop"] = stop
        choice = options.get("tool_choice")
        if choice is None:
            options.pop("tool_choice", None)
        elif choice is True or choice == "any":  # LangChain's names for a forced call
            options["tool_choice"] = "required"
        return options

    @contextlib.contextmanager
    def _conversation(
        self, run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None
    ) -> Iterator[str | None]:
        """The call's conversation id: its LangGraph thread and graph node, while no other call runs on it.

        A second call on a conversation that is mid-call (parallel branches of one thread) is
        matched by its messages instead, as calls outside a thread are.
        """
        conversation_id = _thread_conversation(run_manager)
        with self._running_lock:
            if conversation_id in self._running:
                conversation_id = None
            elif conversation_id is not None:
                self._running.add(conversation_id)
        try:
            yield conversation_id
        finally:
            if conversation_id is not None:
                with self._running_lock:
                    self._running.discard(conversation_id)


def _thread_conversation(run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None) -> str | None:
    """``thread_id`` from the run's metadata (LangGraph copies it there), with the node's path in the graph.

    Streaming calls get no run manager: the metadata then comes from the runnable config the
    call runs in (a LangGraph node's).
    """
    metadata = {**(ensure_config().get("metadata") or {}), **(run_manager.metadata if run_manager else {})}
    thread_id = metadata.get("thread_id")
    if thread_id is None:
        return None
    namespace = str(metadata.get("langgraph_checkpoint_ns") or metadata.get("checkpoint_ns") or "")
    node_path = "|".join(part.split(":")[0] for part in namespace.split("|") if part)  # task ids dropped
    return f"{thread_id}|{node_path}" if node_path else str(thread_id)


def _openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the OpenAI chat dicts a pool step reads."""
    converted: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        content = _text(index, message)
        if isinstance(message, SystemMessage):
            converted.append({"role": "system", "content": content})
        elif isinstance(message, HumanMessage):
            converted.append({"role": "user", "content": content})
        elif isinstance(message, AIMessage):
            calls = [
                {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["args"]}}
                for call in message.tool_calls
            ]
            converted.append({"role": "assistant", "content": content, "tool_calls": calls})
        elif isinstance(message, ToolMessage):
            converted.append({"role": "tool", "content": content, "tool_call_id": message.tool_call_id})
        else:
            raise NotImplementedError(
                f"message {index}: ChatAgentKV reads system, human, AI and tool messages, not {type(message).__name__}"
            )
    return converted


def _text(index: int, message: BaseMessage) -> str:
    def block_text(block: dict[str, Any]) -> str | None:
        if block.get("type") == "text":
            return str(block.get("text", ""))
        if block.get("type") == "tool_call":  # output_version="v1" repeats the tool calls as blocks
            return None
        raise NotImplementedError(
            f"message {index}: ChatAgentKV reads text only, not {block.get('type')!r} content "
            "(images, audio and files are not supported)"
        )

    return joined_text(message.content, block_text)


def _result(reply: StepReply) -> ChatResult:
    message = AIMessage(
        content=reply.text,
        additional_kwargs={"reasoning_content": reply.reasoning} if reply.reasoning is not None else {},
        tool_calls=[tool_call(name=call.name, args=call.arguments, id=call.id) for call in reply.tool_calls],
        usage_metadata=_usage(reply.stats),
        response_metadata=_response_metadata(reply),
    )
    return ChatResult(generations=[ChatGeneration(message=message)])


class _Streamed:
    """What a stream gave so far: the answer's pieces, and the tool calls' (LangChain joins chunks by call index)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.calls = StreamedCalls()


def _chunks(items: Iterator[_Item]) -> Iterator[ChatGenerationChunk]:
    streamed = _Streamed()
    for item in items:
        yield _chunk(item, streamed)


def _chunk(item: _Item, streamed: _Streamed) -> ChatGenerationChunk:
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
        response_metadata=_response_metadata(item),
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


def _response_metadata(reply: StepReply) -> dict[str, Any]:
    metadata: dict[str, Any] = {"finish_reason": reply.finish_reason, "agentkv": reply.stats.model_dump()}
    if reply.error is not None:
        metadata["agentkv_error"] = reply.error  # the output could not be read; it is the message's text
    return metadata


@contextlib.contextmanager
def _langchain_errors() -> Iterator[None]:
    """agentkv's errors as LangChain's model errors (the agentkv error is the ``__cause__``)."""
    try:
        yield
    except AgentKVError as exc:
        for agentkv_error, langchain_error in _LANGCHAIN_ERRORS:
            if isinstance(exc, agentkv_error):
                raise langchain_error(str(exc)) from exc
        raise
