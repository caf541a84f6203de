"""Test doubles for agent code: a scripted engine for loop logic, no model needed; two "hosts" on one machine.

    from agentkv.testing import ScriptedEngine

    engine = ScriptedEngine(["Paris.", "Rome."])
    async with engine, Session(engine=engine) as s:
        assert (await s.run("Capital of France?")).text == "Paris."
    engine.assert_complete()

A scripted engine never claims anything about KV reuse: it reports every prompt token as
computed and returns no handle. Tests that claim the pair works use the real pair.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from ._engines import Engine, EngineInfo, StepDone, StepEvent, StepRequest, StepTimings, TokenDelta, _vllm
from ._errors import AgentKVError
from ._model import DEFAULT_MODEL, cache_dir, prepare_model

__all__ = [
    "NamespacesUnavailableError",
    "ScriptedEngine",
    "TwoHosts",
    "UnconsumedScriptError",
    "block_real_engines",
    "two_hosts",
]


@contextlib.contextmanager
def block_real_engines() -> Iterator[None]:
    """Within this block, starting a real vLLM engine raises `UserError` (use it around unit tests)."""
    previous = _vllm.ALLOW_REAL_ENGINES
    _vllm.ALLOW_REAL_ENGINES = False
    try:
        yield
    finally:
        _vllm.ALLOW_REAL_ENGINES = previous


class UnconsumedScriptError(AgentKVError):
    """`ScriptedEngine.assert_complete` found outputs the code under test never asked for."""


class ScriptedEngine(Engine):
    """Answers each step with the next scripted output, tokenized by the bundled model's tokenizer.

    Args:
        outputs: texts (or callables taking the request and returning text), one per step.
        model_path: the HF folder whose tokenizer the session uses (default: the bundled model).
        max_model_len: the context length to report.
        delay_s: how long each step takes before its output (for cancellation and timeout tests).
    """

    def __init__(
        self,
        outputs: Sequence[str | Callable[[StepRequest], str]],
        *,
        model_path: Path | None = None,
        max_model_len: int = 4096,
        delay_s: float = 0.0,
    ) -> None:
        super().__init__()
        self._outputs = list(outputs)
        self._model_path = model_path
        self._max_model_len = max_model_len
        self._delay_s = delay_s
        self.requests: list[StepRequest] = []
        """Every step request received, in order."""
        self._tokenizer: Any = None

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            kind="scripted",
            model_path=self._model_path or cache_dir() / DEFAULT_MODEL,
            max_model_len=self._max_model_len,
            push_back=False,
        )

    async def _start(self) -> None:
        if self._model_path is None:  # the bundled model's tokenizer; prepared once per machine
            self._model_path = await anyio.to_thread.run_sync(prepare_model)

    async def step(self, request: StepRequest) -> AsyncIterator[StepEvent]:
        self.check_open()
        if not self._outputs:
            raise UnconsumedScriptError("the script ran out: the code under test asked for one more step")
        started = time.perf_counter()
        await anyio.sleep(self._delay_s)
        self.requests.append(request)
        output = self._outputs.pop(0)
        text = output(request) if callable(output) else output
        token_ids = self._encode(text)
        yield TokenDelta(token_ids=token_ids, text=text)
        yield StepDone(
            token_ids=token_ids,
            text=text,
            finish_reason="stop",
            handle=None,
            timings=StepTimings(ttft_s=time.perf_counter() - started, computed_tokens=len(request.prompt_token_ids)),
        )

    def _encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.info.model_path))
        tokenizer = self._tokenizer
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return [*ids, int(tokenizer.eos_token_id)]

    def assert_complete(self) -> None:
        """Raise `UnconsumedScriptError` if scripted outputs were left unused."""
        if self._outputs:
            raise UnconsumedScriptError(f"{len(self._outputs)} scripted output(s) were never used")


class NamespacesUnavailableError(AgentKVError):
    """This machine does not let agentkv create network namespaces (not root, no ``ip``, ...)."""


@dataclasses.dataclass(frozen=True)
class TwoHosts:
    """Two network namespaces joined by a bridge in this one: two "hosts" on one machine.

    Each namespace has its own address; this namespace reaches both through the bridge, and
    traffic between them crosses two veth links (NIXL over UCX/TCP sees a real network path).
    """

    namespaces: tuple[str, str]
    addresses: tuple[str, str]
    links: tuple[str, str]
    """The host-side ends of the veth links (their counters see every byte to or from a namespace)."""

    @property
    def launch_prefixes(self) -> tuple[list[str], list[str]]:
        """``LaunchedPair(launch_prefixes=...)``: run P in the first namespace, D in the second."""
        return (["ip", "netns", "exec", self.namespaces[0]], ["ip", "netns", "exec", self.namespaces[1]])

    def link_bytes(self) -> int:
        """Bytes sent and received so far on both links."""
        total = 0
        for link in self.links:
            for counter in ("rx_bytes", "tx_bytes"):
                total += int(Path(f"/sys/class/net/{link}/statistics/{counter}").read_text())
        return total


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Create two network namespaces for a cross-"host" pair; remove them on the way out.

    Raises `NamespacesUnavailableError` (with the reason) where the machine does not allow it.
    """
    if shutil.which("ip") is None:
        raise NamespacesUnavailableError("the `ip` command (iproute2) is not installed")
    tag = uuid.uuid4().hex[:5]
    subnet = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
    bridge = f"akvbr{tag}"
    namespaces = (f"akv-{tag}-p", f"akv-{tag}-d")
    hosts = TwoHosts(namespaces, (f"{subnet}.1", f"{subnet}.2"), (f"akv{tag}h0", f"akv{tag}h1"))
    created: list[list[str]] = []  # undo commands, run in reverse
    try:
        _ip(["link", "add", bridge, "type", "bridge"], created, undo=["link", "del", bridge])
        _ip(["addr", "add", f"{subnet}.254/24", "dev", bridge], created)
        _ip(["link", "set", bridge, "up"], created)
        for index, namespace in enumerate(namespaces):
            host_end, inner_end = hosts.links[index], f"akv{tag}n{index}"
            _ip(["netns", "add", namespace], created, undo=["netns", "del", namespace])
            _ip(["link", "add", host_end, "type", "veth", "peer", "name", inner_end], created)
            _ip(["link", "set", inner_end, "netns", namespace], created)
            _ip(["link", "set", host_end, "master", bridge, "up"], created)
            _ip(["-n", namespace, "addr", "add", f"{hosts.addresses[index]}/24", "dev", inner_end], created)
            _ip(["-n", namespace, "link", "set", inner_end, "up"], created)
            _ip(["-n", namespace, "link", "set", "lo", "up"], created)
        yield hosts
    finally:
        for undo in reversed(created):
            subprocess.run(["ip", *undo], capture_output=True, check=False)


def _ip(args: list[str], created: list[list[str]], *, undo: list[str] | None = None) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise NamespacesUnavailableError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    if undo is not None:
        created.append(undo)
