"""agentkv as a LangChain chat model (LangChain and LangGraph agents): `ChatAgentKV`.

Needs ``langchain-core`` (``pip install "agentkv-vllm[langchain]"``); LangGraph is optional.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelConnectionError,
    ModelError,
    ModelInvalidRequestError,
)
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

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
from ._langchain_messages import Streamed, chunk_of, chunks_of, openai_messages, result_of
from ._pooled import SAMPLING_NAMES, CallLimits, PooledAccess, PooledModel, sampling_of

__all__ = ["ChatAgentKV"]


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
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop sequences of every call (a call's own ``stop`` replaces them)."""
    streaming: bool = False
    """Whether ``invoke`` streams from the engine (LangChain's callbacks then see each token)."""
    timeout: float | None = None
    """Seconds a call may take: past it the step is cancelled (its session unchanged) and `TimeoutError` raised."""
    max_retries: int = 0
    """How often a call whose server could not be reached (`agentkv.EngineUnavailableError`: a launched or remote
    pair) is made again; such a failed call changed nothing. In-process engines fail in no way a retry mends."""
    api_key: SecretStr | None = None
    """Accepted for code written for hosted models; unused (the engine runs in this process)."""

    model_config = ConfigDict(populate_by_name=True)

    _pooled: PooledModel = PrivateAttr()

    def __init__(self, *, engine: Engine | None = None, pool: SessionPool | None = None, **options: Any) -> None:
        names = set(type(self).model_fields) | {"stop_sequences"}
        fields = {name: options.pop(name) for name in list(options) if name in names}
        super().__init__(**fields)
        self._pooled = PooledModel(engine=engine, pool=pool, owner=type(self).__name__, **options)

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
        return {"model_name": self._model_name(), "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _model_name(self) -> str:
        """The model the pool serves (its engine's model folder's name); ``agentkv`` until its engine is open."""
        return self._pooled.model_name() or "agentkv"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        """LangSmith's standard parameters: the provider, the model (a call's ``model`` if given), sampling."""
        params = LangSmithParams(
            ls_provider="agentkv", ls_model_name=str(kwargs.get("model") or self._model_name()), ls_model_type="chat"
        )
        temperature = kwargs.get("temperature", self.temperature)
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if temperature is not None:
            params["ls_temperature"] = temperature
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

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
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Structured output: by tool calling (``"function_calling"``, the default: a forced call of a tool with the
        schema), or with the output itself forced (vLLM's structured outputs): to the JSON schema (``"json_schema"``)
        or to any JSON object (``"json_mode"``: say in the prompt what it should hold; ``schema`` may be None then)."""
        if kwargs.pop("strict", None) not in (None, True, False):
            raise NotImplementedError("ChatAgentKV's with_structured_output takes strict=True/False/None")
        if kwargs:
            raise NotImplementedError(f"ChatAgentKV's with_structured_output does not take {', '.join(sorted(kwargs))}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise NotImplementedError(f"ChatAgentKV has no structured output method {method!r}")
        if method == "json_schema" and schema is None:
            raise ValueError("method='json_schema' needs a schema")
        forced = {"json": convert_to_json_schema(schema)} if method == "json_schema" else {"json_object": True}
        traced = {"kwargs": {"method": method}, "schema": schema}
        bound = self.bind(structured_outputs=forced, ls_structured_output_format=traced)
        pydantic = isinstance(schema, type) and issubclass(schema, BaseModel)
        parser: Runnable[Any, Any] = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return bound | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=bound) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:  # `streaming=True` without LangChain's stream switch (a subclass's own invoke): stream here
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        chat, options = openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            reply = self._pooled.call_sync(chat, conversation_id=conversation_id, limits=self._limits(), **options)
        return result_of(reply, self._model_name())

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        chat, options = openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            reply = await self._pooled.call(chat, conversation_id=conversation_id, limits=self._limits(), **options)
        return result_of(reply, self._model_name())

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        chat, options = openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            home = self.pool.home  # the pool's loop thread: the stream runs there; closed early, it cancels the step
            assert home is not None  # set when the pool opened
            items = self._pooled.stream(
                chat, conversation_id=conversation_id, deltas=True, limits=self._limits(), **options
            )
            yield from chunks_of(home.iterate(items), self._model_name())

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        chat, options = openai_messages(messages), self._call_options(stop, kwargs)
        with self._conversation(run_manager) as conversation_id, _langchain_errors():
            streamed = Streamed(self._model_name())
            items = self._pooled.stream(
                chat, conversation_id=conversation_id, deltas=True, limits=self._limits(), **options
            )
            async for item in items:
                yield chunk_of(item, streamed)

    # ----------------------------------------------------------------- helpers

    def _limits(self) -> CallLimits:
        return CallLimits(timeout_s=self.timeout, max_retries=self.max_retries)

    def _call_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The pool's step options from the model's fields and the call's (bound) options."""
        kwargs.pop("stream", None)  # LangChain's own switch, already acted on
        kwargs.pop("ls_structured_output_format", None)  # for tracing, read by LangChain's callbacks
        model = kwargs.pop("model", None)
        if model is not None and model != self._model_name():
            raise NotImplementedError(
                f"ChatAgentKV serves one model ({self._model_name()!r}); a call cannot ask for model={model!r}"
            )
        forced = kwargs.pop("structured_outputs", None)  # with_structured_output's json_schema and json_mode
        if forced is not None:
            kwargs["sampling"] = {**_sampling_dict(kwargs.get("sampling")), "structured_outputs": forced}
        unknown = sorted(set(kwargs) - set(_CALL_OPTIONS) - _SAMPLING_OPTIONS)
        if unknown:
            raise NotImplementedError(f"ChatAgentKV does not support the call options {', '.join(unknown)}")
        sampling = sampling_of({name: kwargs.pop(name) for name in list(kwargs) if name in _SAMPLING_OPTIONS})
        options: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature, "seed": self.seed}
        options.update(kwargs)
        if sampling:  # over a bound sampling=, field by field
            options["sampling"] = _sampling_dict(options.get("sampling")) | sampling
        if stop or self.stop:
            options["stop"] = stop or self.stop
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
        with self._pooled.claimed(_thread_conversation(run_manager)) as conversation_id:
            yield conversation_id


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


def _sampling_dict(given: SamplingOptions | Mapping[str, Any] | None) -> dict[str, Any]:
    """A bound ``sampling=`` as a dict of the fields it sets."""
    return given.model_dump(exclude_unset=True) if isinstance(given, SamplingOptions) else dict(given or {})


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
