"""LangChain's standard chat-model suites (``langchain-tests``: `ChatModelUnitTests`, `ChatModelIntegrationTests`),
the tests every LangChain integration is held to, on both ways a LangChain user reaches agentkv:

* `ChatAgentKV` (agentkv.integrations.langchain) on `HonestPairEngine`, scripted as a competent model
  (tests/competent.py), which checks every pin pushed back;
* LangChain's own `ChatOpenAI` (langchain-openai) pointed at an ``agentkv serve`` door on the same double, with
  ``stream_usage=True`` (without it ChatOpenAI asks for no usage in streams).

Each test the suites switch off is switched off by a claim the code backs (the properties below, each saying why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from agentkv import SessionPool
from agentkv._engines._system import free_port
from agentkv.integrations.langchain import ChatAgentKV
from agentkv.serve import FrontDoor
from agentkv.testing import HonestPairEngine
from competent import respond

MODEL = "test_model"
"""The model the doubles serve (their model folder's name): what the door and `ChatAgentKV` report."""

pytestmark = [
    # langchain-openai's own warnings about its own use of the openai SDK (parsed replies it dumps; a pydantic v1
    # schema it moves to function calling): a third party's, as pyproject's filterwarnings lets third parties' pass
    pytest.mark.filterwarnings("ignore:Pydantic serializer warnings:UserWarning"),
    pytest.mark.filterwarnings("ignore:Received a Pydantic BaseModel V1 schema:UserWarning"),
    # pytest-benchmark's, about the suite's benchmark of streaming, which the suite itself skips (enable_vcr_tests)
    pytest.mark.filterwarnings("ignore:Benchmark fixture was not used at all"),
]


class _Doubles:
    """The honest double (and a door on it), opened at the first test that asks, closed with the module."""

    engine: HonestPairEngine | None = None
    pool: SessionPool | None = None
    door: FrontDoor | None = None
    clients: list[httpx.Client | httpx.AsyncClient] = []
    """The HTTP clients of the suites' ChatOpenAI models, closed with the module."""

    @classmethod
    def open_engine(cls) -> HonestPairEngine:
        if cls.engine is None:
            cls.engine = HonestPairEngine(respond).start()
        return cls.engine

    @classmethod
    def door_url(cls) -> str:
        if cls.door is None:
            cls.pool = SessionPool(engine=cls.open_engine()).__enter__()
            cls.door = FrontDoor(cls.pool, port=free_port()).start()
        return cls.door.url

    @classmethod
    def http_clients(cls) -> dict[str, Any]:
        """A ChatOpenAI model's own HTTP clients to the door (langchain-openai's shared async client would outlive
        a test's event loop)."""
        door = _ToTheDoor()
        sync, asynchronous = httpx.Client(transport=door), httpx.AsyncClient(transport=door)
        cls.clients += [sync, asynchronous]
        return {"http_client": sync, "http_async_client": asynchronous}

    @classmethod
    async def close_clients(cls) -> None:
        """Close the HTTP clients made so far (the async ones on the loop their connections belong to)."""
        clients, cls.clients = cls.clients, []
        for client in clients:
            if isinstance(client, httpx.Client):
                client.close()
            else:
                await client.aclose()

    @classmethod
    def close(cls) -> None:
        anyio.run(cls.close_clients)
        engine, door, pool = cls.engine, cls.door, cls.pool
        cls.engine = cls.door = cls.pool = None
        if door is not None:
            door.stop()
        if pool is not None:
            pool.close()
        if engine is not None:
            engine.close()
            engine.assert_honest()


@pytest.fixture(scope="module", autouse=True)
def _doubles() -> Iterator[None]:
    yield
    _Doubles.close()


DOOR_BASE_URL = "http://agentkv-door.test/v1"
"""The base URL the suites' ChatOpenAI models are made with: their HTTP clients send it to the door's real address
(`_ToTheDoor`), so the model serializes without the door's port (the suites compare it with a stored snapshot)."""


class _ToTheDoor(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """An HTTP transport that sends every request to the door (its host and port), sync and async."""

    def __init__(self) -> None:
        self._sync = httpx.HTTPTransport()
        # no connection kept between requests: each async test runs on a loop of its own, which a kept connection
        # would outlive (its socket left to the garbage collector)
        self._async = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))

    @staticmethod
    def _to_door(request: httpx.Request) -> httpx.Request:
        door = httpx.URL(_Doubles.door_url())
        request.url = request.url.copy_with(scheme=door.scheme, host=door.host, port=door.port)
        request.headers["host"] = f"{door.host}:{door.port}"
        return request

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._sync.handle_request(self._to_door(request))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._async.handle_async_request(self._to_door(request))

    def close(self) -> None:
        self._sync.close()

    async def aclose(self) -> None:
        await self._async.aclose()


def second_call_of_a_conversation(model: BaseChatModel, *, stream: bool) -> AIMessage:
    """A conversation's second call: its first call's KV is pulled back, so the prompt's cached tokens are > 0."""
    messages: list[BaseMessage] = [HumanMessage("Tell me about KV caches.")]
    messages.append(model.invoke(messages))
    messages.append(HumanMessage("And what does a pin hold?"))
    if not stream:
        reply = model.invoke(messages)
    else:
        chunks = list(model.stream(messages))
        reply = chunks[0]
        for chunk in chunks[1:]:
            reply = reply + chunk
    assert isinstance(reply, AIMessage) and reply.usage_metadata is not None
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0, reply.usage_metadata
    return reply


class _AgentKVClaims:
    """What `ChatAgentKV` claims of itself, each backed by its code (agentkv.integrations.langchain) and docs
    (docs/integrations.md, "LangChain and LangGraph")."""

    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatAgentKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": _Doubles.open_engine()}

    @property
    def has_tool_choice(self) -> bool:
        return True  # bind_tools(tool_choice=...): "any"/"required"/True, "none", a tool's name

    @property
    def supports_json_mode(self) -> bool:
        return True  # with_structured_output(method="json_mode"): vLLM's json_object structured output

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine serves one model: invoke(model=<another>) raises NotImplementedError naming it

    @property
    def supports_image_inputs(self) -> bool:
        return False  # text only: an image part raises NotImplementedError (the engines serve text models)

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True  # tool_use blocks (read from tool_calls), tool_result blocks, thinking blocks

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}


class TestChatAgentKVUnit(_AgentKVClaims, ChatModelUnitTests):
    pass


@pytest.mark.anyio  # the suite's async tests (LangChain's repositories run them in pytest-asyncio's auto mode)
class TestChatAgentKVIntegration(_AgentKVClaims, ChatModelIntegrationTests):
    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return second_call_of_a_conversation(ChatAgentKV(**self.chat_model_params), stream=stream)


class _DoorClaims:
    """What LangChain's `ChatOpenAI` gets from an ``agentkv serve`` door (docs/serve.md, docs/integrations.md)."""

    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatOpenAI

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {
            "base_url": DOOR_BASE_URL,
            "api_key": "unused",
            "model": MODEL,
            "stream_usage": True,  # ChatOpenAI asks for no usage in streams without it
            **_Doubles.http_clients(),
        }

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        """The door from ChatOpenAI's environment variables, as an OpenAI-compatible server is named."""
        environment = {"OPENAI_API_KEY": "unused", "OPENAI_API_BASE": DOOR_BASE_URL}
        return environment, {"model": MODEL}, {"openai_api_key": "unused", "openai_api_base": DOOR_BASE_URL}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True  # response_format json_object, as vLLM's server

    @property
    def supports_model_override(self) -> bool:
        return False  # the door serves one model (another is a 404, as vLLM's server answers)

    @property
    def supports_image_inputs(self) -> bool:
        return False  # image parts are a 400 naming them

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True  # ChatOpenAI sends them in OpenAI's shapes; the door reads those

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}


class TestChatOpenAIOnTheDoorUnit(_DoorClaims, ChatModelUnitTests):
    pass


@pytest.mark.anyio
class TestChatOpenAIOnTheDoorIntegration(_DoorClaims, ChatModelIntegrationTests):
    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return second_call_of_a_conversation(ChatOpenAI(**self.chat_model_params), stream=stream)
