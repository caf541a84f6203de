"""``agentkv serve`` killed with SIGKILL while 8 conversations stream, then restarted on the same store.

The door runs as a subprocess (``.venv/bin/agentkv serve --store PATH``, its own embedded pair), saving each
conversation after every step (`SessionPool._save` in src/agentkv/_session/_pool.py, before the stream's last
chunk goes out: src/agentkv/_surfaces/_serve.py). What the crash may cost is the turn in flight, whole: what
a client saw answered (its stream's ``finish_reason``) is in the store, what was cut off is not, half of it
nowhere; the restarted door resumes every conversation from its last completed step (``miss_reason`` is
``"resumed"`` in the step's stats, the ``agentkv`` object of the usage chunk: docs/serve.md). The engine
processes of the killed door stop on their own: each engine core watches the process that started it
(``_stop_when_the_owner_dies`` in src/_agentkv_vllm/_patches.py), and the door's watchdog
(src/agentkv/_engines/_watchdog.py) ends what is left; its ports are freed (tests/freed.py).
docs/reliability.md, "The door under faults", has the figures of a run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agentkv import SqliteSessionStore
from agentkv._engines._platform_settings import resolve_dtype
from agentkv._engines._system import alive, descendants, free_port
from agentkv._engines._watchdog import _WATCHDOG
from agentkv._session._session_store import conversation_key
from freed import assert_ports_freed, listening_ports, running_pids

pytestmark = [pytest.mark.pair, pytest.mark.nightly]

AGENTKV = Path(sys.executable).with_name("agentkv")
"""The ``agentkv`` command of this environment (.venv/bin)."""
TOPICS = ("giraffes", "violins", "copper", "glaciers", "tulips", "owls", "volcanoes", "saffron")
"""One conversation each."""
TURNS: tuple[tuple[str, int], ...] = (
    ("Tell me one fact about {topic}.", 16),
    ("Say it again in other words.", 16),
    ("Count from 1 to 60, separated by commas.", 64),  # the turn the door is killed in: long enough to be cut
    ("Thank you. Name one colour.", 16),
)
"""Each turn's user message and ``max_tokens``; the door is killed during the third."""
KILLED_TURN = 3
START_S = 600.0
"""The most a door may take to serve (its pair starts: about a minute here)."""
ENGINES_GONE_S = 30.0
"""The most the killed door's processes may outlive it (the watchdog: SIGTERM, 3 s, SIGKILL, 3 s, exit)."""


@dataclass
class Streamed:
    """One streamed turn as its client saw it."""

    text: str = ""
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)
    """Set at the first chunk (the model's first token), or when the request failed before it."""

    @property
    def answered(self) -> bool:
        """Whether the client saw the answer end (its ``finish_reason``: the door sends it once the step is
        saved); the connection may have been cut after it, before the usage chunk."""
        return self.finish_reason is not None


@dataclass
class Conversation:
    """A conversation as its client keeps it: the messages, and what each streamed turn gave."""

    name: str
    topic: str
    messages: list[dict[str, Any]]
    turns: list[Streamed] = field(default_factory=list)
    """The answered turns, in order."""

    @classmethod
    def new(cls, name: str, topic: str) -> Conversation:
        return cls(name, topic, [{"role": "system", "content": "You are terse."}])

    def request(self, turn: int) -> tuple[list[dict[str, Any]], int]:
        """The messages and ``max_tokens`` of turn ``turn`` (1-based), after the answered turns."""
        assert len(self.turns) == turn - 1
        text, max_tokens = TURNS[turn - 1]
        return [*self.messages, {"role": "user", "content": text.format(topic=self.topic)}], max_tokens

    def stream(self, client: openai.OpenAI, model: str, turn: int, into: Streamed | None = None) -> Streamed:
        """Stream turn ``turn``; an answered turn is appended to the conversation, a failed one changes nothing."""
        messages, max_tokens = self.request(turn)
        streamed = into if into is not None else Streamed()
        try:
            parts = client.chat.completions.create(  # type: ignore[call-overload]
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"x-session-id": self.name},
            )
            for part in parts:
                streamed.started.set()
                if part.choices:
                    streamed.text += part.choices[0].delta.content or ""
                    streamed.finish_reason = part.choices[0].finish_reason or streamed.finish_reason
                else:
                    streamed.stats = (part.model_extra or {})["agentkv"]["stats"]
        except Exception as exc:  # a door killed mid-stream: the connection is cut
            streamed.error = exc
        finally:
            streamed.started.set()
        if streamed.answered:
            self.messages = [*messages, {"role": "assistant", "content": streamed.text}]
            self.turns.append(streamed)
        return streamed


@dataclass
class Door:
    """``agentkv serve`` as a subprocess, its output in a file."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    start_s: float = 0.0
    """From the command to its first healthy answer."""

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@contextlib.contextmanager
def door_process(store: Path, port: int, log: Path) -> Iterator[Door]:
    """A door serving on ``port`` over ``store``; on the way out, whatever it left running is killed (so that a
    failing test leaves no engine behind: the checks are made before)."""
    with log.open("ab") as output:
        process = subprocess.Popen(
            [str(AGENTKV), "serve", "--store", str(store), "--port", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    door = Door(process, f"http://127.0.0.1:{port}", log)
    below: set[int] = set()
    try:
        started = time.monotonic()
        deadline = started + START_S
        while not _healthy(door.url):
            assert process.poll() is None, f"the door exited with {process.returncode}:\n{door.tail()}"
            assert time.monotonic() < deadline, f"the door did not serve in {START_S:.0f} s:\n{door.tail()}"
            time.sleep(1.0)
        door.start_s = time.monotonic() - started
        below = descendants(process.pid)
        yield door
    finally:
        below |= descendants(process.pid) if process.poll() is None else set()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=60)
        for pid in alive(below):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _client(door: Door) -> openai.OpenAI:
    return openai.OpenAI(base_url=door.url + "/v1", api_key="none", max_retries=0, timeout=300.0)


def _turns(client: openai.OpenAI, model: str, conversations: list[Conversation], turns: range) -> list[Streamed]:
    """``turns`` of every conversation, the conversations at once (each turn after the one before it)."""

    def run(conversation: Conversation) -> list[Streamed]:
        return [conversation.stream(client, model, turn) for turn in turns]

    with ThreadPoolExecutor(len(conversations)) as threads:
        return [step for steps in threads.map(run, conversations) for step in steps]


def _gone_within(pids: set[int], seconds: float) -> tuple[set[int], dict[int, float]]:
    """The pids still running after ``seconds`` at most, and when each of the others went (seconds from now)."""
    started, gone = time.monotonic(), dict[int, float]()
    while (running := alive(pids)) and time.monotonic() - started < seconds:
        gone |= {pid: time.monotonic() - started for pid in pids - running if pid not in gone}
        time.sleep(0.1)
    gone |= {pid: time.monotonic() - started for pid in pids - running if pid not in gone}
    return running, gone


def _what(pid: int) -> str:
    """What a process below the door is: an engine's (by vLLM's process title), the watchdog, a Python helper."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    if any("resource_tracker" in a or "forkserver" in a for a in arguments):
        return "python-helper"
    if _WATCHDOG in arguments:
        return "watchdog"
    return name


def test_a_door_killed_mid_stream_resumes_every_conversation_from_its_last_step(tmp_path: Path) -> None:
    """8 conversations stream two turns; the door is SIGKILLed while their third streams. Its engine processes
    stop and its ports are freed; the store holds every answered turn and nothing of the cut ones; a new door
    on the store resumes each conversation at its next step (``resumed``), the cut turn resent whole, and its
    greedy answers are those of conversations that never saw a crash (replayed on the same door)."""
    began = time.monotonic()
    store, port = tmp_path / "serve.sqlite3", free_port()
    conversations = [Conversation.new(f"crash-{i}", topic) for i, topic in enumerate(TOPICS)]
    running_before, shm_before = running_pids(), set(os.listdir("/dev/shm"))

    # ---- the first door: two turns each, then the third, killed while it streams
    with door_process(store, port, tmp_path / "door-1.log") as door, _client(door) as client:
        starts = [door.start_s]
        model = _model(client)
        before = _turns(client, model, conversations, range(1, KILLED_TURN))
        assert all(s.answered and s.error is None for s in before), [(s.error, s.finish_reason) for s in before]
        cut = [Streamed() for _ in conversations]
        with ThreadPoolExecutor(len(conversations)) as threads:
            for conversation, streamed in zip(conversations, cut, strict=True):
                threads.submit(conversation.stream, client, model, KILLED_TURN, streamed)
            for streamed in cut:  # every third turn has its first token (or already failed)
                assert streamed.started.wait(300), "a third turn got no first chunk in 300 s"
            killed = descendants(door.process.pid)  # its engines' processes, the watchdog, Python's helpers
            kinds = {pid: _what(pid) for pid in killed}
            ports = listening_ports(held_by=killed | {door.process.pid})
            door.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            door.process.wait(timeout=60)
        assert door.process.returncode == -signal.SIGKILL
        # what the kill left (checked before the fixture's clean-up kills what is left): no process, no port
        assert killed and port in ports, (killed, ports)
        left, gone_s = _gone_within(killed, ENGINES_GONE_S)
        assert not left, f"processes of the killed door still run after {ENGINES_GONE_S:.0f} s: {_named(left)}"
        assert_ports_freed(ports, running_before=running_before)
        shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before)

    answered_at_kill = [s for s in cut if s.answered]
    in_flight = [s for s in cut if not s.answered]
    assert in_flight, "every third turn was answered before the kill: the door was not killed mid-turn"
    for streamed in in_flight:  # a cut stream fails: it never ends as if answered
        assert isinstance(streamed.error, httpx.HTTPError | openai.APIError), repr(streamed.error)
    # the store: every answered turn, none of the cut ones (not half of one)
    with contextlib.closing(sqlite3.connect(store)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with SqliteSessionStore(store) as saved:
        for conversation in conversations:
            snapshot = saved.get(conversation_key(conversation.name))
            assert snapshot is not None and snapshot.transcript is not None, conversation.name
            assert len(snapshot.turns) == len(conversation.turns), conversation.name
            said = [(m.role, m.content) for m in snapshot.transcript.messages]
            assert said == [(m["role"], m["content"]) for m in conversation.messages], conversation.name

    # ---- a second door on the same store and port: each conversation goes on from its last answered turn
    resumed: dict[str, tuple[int, Streamed]] = {}
    with door_process(store, port, tmp_path / "door-2.log") as door, _client(door) as client:
        starts.append(door.start_s)
        model = _model(client)

        def go_on(conversation: Conversation) -> None:
            for turn in range(len(conversation.turns) + 1, len(TURNS) + 1):
                streamed = conversation.stream(client, model, turn)
                resumed.setdefault(conversation.name, (turn, streamed))
                if not streamed.answered:
                    return

        with ThreadPoolExecutor(len(conversations)) as threads:
            list(threads.map(go_on, conversations))
        for conversation in conversations:
            turn, first = resumed[conversation.name]
            assert len(conversation.turns) == len(TURNS), (conversation.name, first.error)
            assert first.stats is not None
            assert (first.stats["turn"], first.stats["miss_reason"]) == (turn, "resumed"), conversation.name
            assert not first.stats["handle_forwarded"] and first.stats["pulled_tokens"] == 0
            for later in conversation.turns[turn:]:  # the steps after it push back again
                assert later.stats is not None and later.stats["handle_forwarded"], conversation.name

        # the same conversations on the same door, uninterrupted (new names: nothing saved to resume)
        references = [Conversation.new(f"reference-{i}", topic) for i, topic in enumerate(TOPICS)]
        _turns(client, model, references, range(1, len(TURNS) + 1))
        assert all(len(r.turns) == len(TURNS) for r in references)
        assert all(r.turns[0].stats and r.turns[0].stats["miss_reason"] == "no_handle" for r in references)
        compared = 0
        if resolve_dtype("auto") == "float32":  # bf16 KV differs in its last bits with where it came from
            for conversation, reference in zip(conversations, references, strict=True):
                assert [t.text for t in conversation.turns] == [t.text for t in reference.turns], conversation.name
                compared += len(TURNS)

        engines = descendants(door.process.pid)
        ports = listening_ports(held_by=engines | {door.process.pid})
        door.process.send_signal(signal.SIGTERM)  # a clean stop this time
        door.process.wait(timeout=120)
        assert door.process.returncode == 0, door.tail()
        left, _ = _gone_within(engines, ENGINES_GONE_S)
        assert not left, f"processes of the stopped door still run: {_named(left)}"
        assert_ports_freed(ports, running_before=running_before)
    assert not alive(descendants(os.getpid()) - running_before)  # no process of this test's left below it

    gone = ", ".join(f"{kinds[pid]} {gone_s[pid]:.1f} s" for pid in sorted(killed, key=gone_s.__getitem__))
    print(
        f"door crash: {len(conversations)} conversations; {len(before) + len(answered_at_kill)} turns answered "
        f"before the kill ({len(answered_at_kill)} of them third turns), {len(in_flight)} in flight, cut whole and "
        f"resent; 0 answered turns lost; {len(resumed)} steps resumed; {compared} turns equal to the uninterrupted "
        f"replay; killed {killed_at - began:.0f} s in; the killed door's processes gone after {gone}; new in "
        f"/dev/shm after the kill: {shm_left or 'nothing'}; door starts {starts[0]:.0f} s and {starts[1]:.0f} s; "
        f"{time.monotonic() - began:.0f} s in all"
    )


def _named(pids: set[int]) -> str:
    """Pids with their command lines, for a failure's message."""
    names = []
    for pid in sorted(pids):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            command = "gone"
        names.append(f"{pid} ({command[:120]})")
    return ", ".join(names)
