"""A store that fails (docs/reliability.md, "The door under faults"): the front door over a real SQLite file that
another process locks, that fills up, or that is read-only. While the fault lasts, every step that would have to
be saved gets a 503 naming the file (OpenAI's error shape, ``Retry-After``) and is not answered; nothing is
half-written and every answered turn is in the file; once the fault clears, the next request of each
conversation resumes from its last saved step and saving goes on. On engine doubles: no model runs here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentkv import SessionPool, SessionSnapshot, SqliteSessionStore, StoreUnavailableError, UserError
from agentkv._engines._system import free_port
from agentkv._session._session_store import conversation_key
from agentkv._sqlite import SqliteTable
from agentkv.engines import StepRequest
from agentkv.serve import FrontDoor, SqliteResponseStore
from agentkv.testing import HonestPairEngine
from serve_cli import serve_with_doubles

ANSWER = "Forty-two, as far as I can tell."

FAULT_WORDS = {
    "locked": "the database is locked: ",
    "full": "the database or disk is full",
    "read_only": "the file is read-only to this process",
    "io": "the disk could not be read or written",
}
"""What each fault's message says, after the file's name."""


def answer(request: StepRequest) -> str:
    return ANSWER


@dataclass
class Door:
    url: str
    engine: HonestPairEngine
    pool: SessionPool
    sessions: SqliteSessionStore
    responses: SqliteResponseStore


@contextlib.contextmanager
def door_on(path: Path, *, timeout_s: float = 0.5, max_model_len: int = 4096) -> Iterator[Door]:
    """The door, its pool and both stores on one SQLite file, as ``agentkv serve --store PATH`` runs them."""
    with (
        SqliteSessionStore(path, timeout_s=timeout_s) as sessions,
        SqliteResponseStore(path, timeout_s=timeout_s) as responses,
        HonestPairEngine(answer, max_model_len=max_model_len) as engine,
        SessionPool(engine=engine, store=sessions, max_tokens=16) as pool,
        FrontDoor(pool, model_name="smol", port=free_port(), store=responses) as door,
    ):
        yield Door(door.url, engine, pool, sessions, responses)
    engine.assert_honest()


class Chat:
    """One conversation as an OpenAI client keeps it: the whole history goes with every request, and an answer
    joins it only when it came (a refused turn is asked again)."""

    def __init__(self, url: str, name: str | None = None) -> None:
        self.url, self.name = url, name
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]

    def ask(self, question: str) -> httpx.Response:
        response = httpx.post(
            self.url + "/v1/chat/completions", json=self._body(question), headers=self._headers(), timeout=60
        )
        if response.status_code == 200:
            self._answered(question, response.json()["choices"][0]["message"]["content"])
        return response

    def stream(self, question: str) -> list[Any]:
        """A streamed request's ``data:`` payloads, read as JSON (``"[DONE]"`` as it is); its answer joins the
        history when the stream ended with ``[DONE]``."""
        body = self._body(question, stream=True)
        with httpx.stream(
            "POST", self.url + "/v1/chat/completions", json=body, headers=self._headers(), timeout=60
        ) as response:
            assert response.status_code == 200
            events = [_payload(line) for line in response.iter_lines() if line.startswith("data: ")]
        if events[-1] == "[DONE]":
            self._answered(question, "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]))
        return events

    def first_chunk(self, question: str, then: Callable[[], Any]) -> tuple[float, Any]:
        """Seconds from sending a streamed request to its first chunk (the step's first token), and what ``then()``
        returned at that moment; the stream is then read to its end, and its answer not kept."""
        started = time.monotonic()
        body = self._body(question, stream=True)
        with httpx.stream(
            "POST", self.url + "/v1/chat/completions", json=body, headers=self._headers(), timeout=60
        ) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            first, seen = time.monotonic() - started, then()
            for _ in lines:
                pass
        return first, seen

    def _body(self, question: str, **fields: Any) -> dict[str, Any]:
        return {"model": "smol", "messages": [*self.messages, {"role": "user", "content": question}], **fields}

    def _headers(self) -> dict[str, str]:
        return {"x-session-id": self.name} if self.name else {}

    def _answered(self, question: str, text: str) -> None:
        assert text == ANSWER
        self.messages += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]


def _payload(line: str) -> Any:
    data = line.removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


def stats(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()["agentkv"]["stats"]
    return found


def refused_by_the_store(response: httpx.Response, path: Path, reason: str) -> None:
    """A 503 in OpenAI's error shape, with ``Retry-After``, saying what is wrong with the store (not where it is)."""
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable" and error["code"] == "StoreUnavailableError"
    assert error["message"].startswith("could not ") and " the store: " in error["message"]
    assert str(path) not in error["message"]  # where the door keeps its data is for its log, not its clients
    assert FAULT_WORDS[reason] in error["message"] and "nothing of this call was kept" in error["message"]


def streamed_refusal(events: list[Any], path: Path, reason: str) -> None:
    """A chat stream whose step could not be saved: the answer's text came, then the store's error instead of
    the end (no finish reason, no ``[DONE]``)."""
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == ANSWER
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    error = events[-1]["error"]
    assert error["code"] == "StoreUnavailableError" and " the store: " in error["message"]
    assert str(path) not in error["message"]
    assert FAULT_WORDS[reason] in error["message"]


def saved_turns(path: Path, conversation: str) -> int:
    """How many turns the file holds for a named conversation (read on a connection of the test's own)."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        row = db.execute("SELECT snapshot FROM sessions WHERE key = ?", (conversation_key(conversation),)).fetchone()
    return len(SessionSnapshot.model_validate_json(row[0]).turns)


def intact(path: Path) -> bool:
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def resumed(response: httpx.Response, turn: int) -> None:
    """The step was answered by a session restored from the file (its KV recomputed once), as turn ``turn``."""
    found = stats(response)
    assert found["miss_reason"] == "resumed" and found["turn"] == turn, found


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after 30 s"
        time.sleep(0.01)


def two_turns(*chats: Chat) -> None:
    for chat in chats:
        assert stats(chat.ask("One?"))["turn"] == 1
        assert stats(chat.ask("Two?"))["handle_forwarded"]


# ------------------------------------------------------------------ the faults

LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Another process holds the file's write lock (``BEGIN EXCLUSIVE``) until the block ends."""
    with subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        try:
            assert holder.stdout.readline() == "locked\n"
            yield
        finally:
            holder.stdin.close()
            assert holder.wait(timeout=30) == 0


def _tables(*stores: SqliteSessionStore | SqliteResponseStore) -> list[SqliteTable]:
    return [store._table for store in stores]


@contextlib.contextmanager
def size_limited(*stores: SqliteSessionStore | SqliteResponseStore) -> Iterator[None]:
    """The file may grow by no page (``PRAGMA max_page_count`` on each store's connection): SQLite's own
    ``database or disk is full`` (SQLITE_FULL) for a write that needs a new page."""
    limits = []
    for table in _tables(*stores):
        with table.lock:
            assert table._db is not None
            (pages,) = table._db.execute("PRAGMA page_count").fetchone()
            limits.append(table._db.execute("PRAGMA max_page_count").fetchone()[0])
            assert table._db.execute(f"PRAGMA max_page_count = {pages}").fetchone() == (pages,)
    try:
        yield
    finally:
        for table, limit in zip(_tables(*stores), limits, strict=True):
            with table.lock:
                assert table._db is not None  # a full store keeps its connection
                table._db.execute(f"PRAGMA max_page_count = {limit}")


@contextlib.contextmanager
def small_disk(folder: Path) -> Iterator[Callable[[], Callable[[], None]]]:
    """A 4 MiB tmpfs at ``folder`` (root only); yields ``fill``, which fills it and returns what frees it."""
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs takes root; the size-limited variant runs everywhere")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs could be mounted here: {mounted.stderr.decode().strip()}")

    def fill() -> Callable[[], None]:
        filler = folder / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == 28  # ENOSPC
        finally:
            os.close(fd)
        return filler.unlink

    try:
        yield fill
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def _chattr(flag: str, *paths: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True).returncode == 0


@contextlib.contextmanager
def read_only(path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """The file read-only to this process from now (a connection opened later is read-only, as SQLite opens a
    file it cannot write); yields what makes it writable again. A user's process: ``chmod 444``. Root ignores
    modes: ``chattr +i`` where the file system has the flag, else SQLite's own read-only open (``mode=ro``)."""
    clear: Callable[[], object]
    if os.geteuid() != 0:
        path.chmod(0o444)
        clear = functools.partial(path.chmod, 0o644)
    elif _chattr("+i", path):
        clear = functools.partial(_chattr, "-i", path)
    else:
        opener = sqlite3.connect

        def connect(database: Any, *args: Any, **kwargs: Any) -> sqlite3.Connection:
            if Path(database) == path:
                return opener(f"file:{path}?mode=ro", *args, uri=True, **kwargs)
            return opener(database, *args, **kwargs)

        monkeypatch.setattr(sqlite3, "connect", connect)
        clear = monkeypatch.undo
    cleared = threading.Event()

    def make_writable() -> None:
        if not cleared.is_set():
            cleared.set()
            clear()

    try:
        yield make_writable
    finally:
        make_writable()


# ------------------------------------------------------------------ locked


def test_a_locked_store_gets_503s_and_the_conversations_resume_once_it_is_released(tmp_path: Path) -> None:
    """Another process holds the write lock: plain and streamed steps are refused, named and unnamed, each
    within the store's timeout; released, each conversation resumes from its last saved turn."""
    path = tmp_path / "serve.sqlite3"
    with door_on(path, timeout_s=0.5) as door:
        named, unnamed = Chat(door.url, "s1"), Chat(door.url)
        two_turns(named, unnamed)
        with locked(path):
            for chat in (named, unnamed):
                started = time.monotonic()
                refused_by_the_store(chat.ask("Three?"), path, "locked")
                assert time.monotonic() - started < 0.5 + 1.0  # the store's timeout, and the step
                streamed_refusal(chat.stream("Three?"), path, "locked")
            assert door.pool.session_for("s1") is None  # the live session is not kept past its unsaved step
            assert saved_turns(path, "s1") == 2  # readable while locked, and what was answered
        for chat in (named, unnamed):
            resumed(chat.ask("Three?"), turn=3)
            assert stats(chat.ask("Four?"))["handle_forwarded"]
        assert saved_turns(path, "s1") == 4
    assert intact(path)


def test_a_locked_store_never_stalls_the_door(tmp_path: Path) -> None:
    """Eight conversations' saves wait on a locked file at once: each is refused within about the store's timeout
    (not one after another), and meanwhile another conversation's step streams its first token at once (the
    store is called in worker threads, off the event loops)."""
    path, timeout_s, waiting = tmp_path / "serve.sqlite3", 1.0, 8
    with door_on(path, timeout_s=timeout_s) as door:
        chats = [Chat(door.url, f"c{i}") for i in range(waiting)]
        other = Chat(door.url, "other")
        for chat in (*chats, other):
            assert stats(chat.ask("One?"))["turn"] == 1

        def saving() -> bool:  # every step answered by the engine, none refused yet: their saves wait on the lock
            sessions = [door.pool.session_for(chat.name or "") for chat in chats]
            return all(session is not None and len(session.stats.turns) == 2 for session in sessions)

        def timed(chat: Chat) -> tuple[httpx.Response, float]:
            started = time.monotonic()
            return chat.ask("Two?"), time.monotonic() - started

        with locked(path), ThreadPoolExecutor(waiting) as threads:
            asked = [threads.submit(timed, chat) for chat in chats]
            until(saving, "saving")
            first_s, any_refused = other.first_chunk("Two?", lambda: any(future.done() for future in asked))
            assert first_s < timeout_s / 2 and not any_refused  # it ran while they waited on the store
            for future in asked:
                response, elapsed = future.result()
                refused_by_the_store(response, path, "locked")
                assert elapsed < 2 * timeout_s  # one after another, the last would take 8 x the timeout
        for chat in chats:
            resumed(chat.ask("Two?"), turn=2)  # nothing of the refused turns was kept
    assert intact(path)


# ------------------------------------------------------------------ full


@pytest.mark.parametrize("limit", ["max_page_count", "tmpfs"])
def test_a_full_store_gets_503s_and_saving_resumes_once_there_is_room(limit: str, tmp_path: Path) -> None:
    """The file cannot grow (SQLite's page limit; or, as root, a tmpfs filled to its last byte): a turn that needs
    room is refused with the store named; once there is room, it goes on from the last saved turn."""
    long_question = "Why? " * 1500  # needs new pages in the file, whatever the earlier turns freed
    with contextlib.ExitStack() as stack:
        if limit == "tmpfs":
            fill = stack.enter_context(small_disk(tmp_path / "disk"))
            path = tmp_path / "disk" / "serve.sqlite3"
        else:
            path = tmp_path / "serve.sqlite3"
        door = stack.enter_context(door_on(path, max_model_len=16384))
        named, unnamed = Chat(door.url, "s1"), Chat(door.url)
        two_turns(named, unnamed)
        with contextlib.ExitStack() as fault:
            if limit == "tmpfs":
                fault.callback(fill())
            else:
                fault.enter_context(size_limited(door.sessions, door.responses))
            for chat in (named, unnamed):
                refused_by_the_store(chat.ask(long_question), path, "full")
                streamed_refusal(chat.stream(long_question), path, "full")
            assert saved_turns(path, "s1") == 2
        for chat in (named, unnamed):
            resumed(chat.ask(long_question), turn=3)
            assert stats(chat.ask("Four?"))["handle_forwarded"]
        assert saved_turns(path, "s1") == 4
        assert intact(path)


# ------------------------------------------------------------------ read-only


def test_a_read_only_store_serves_what_it_holds_and_saves_again_once_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server restarted on a file it cannot write: it opens, kept responses are read back, every step (chat
    completions and Responses) is refused with the store named; made writable while the server runs, the
    conversations and the response chain resume from their last saved turn."""
    path = tmp_path / "serve.sqlite3"
    with door_on(path) as door:
        named, unnamed = Chat(door.url, "s1"), Chat(door.url)
        two_turns(named, unnamed)
        first = respond(door.url, "One?")
        kept = respond(door.url, "Two?", previous=first["id"])
    with read_only(path, monkeypatch) as make_writable, door_on(path) as door:
        named.url = unnamed.url = door.url
        for chat in (named, unnamed):
            refused_by_the_store(chat.ask("Three?"), path, "read_only")
        refused_by_the_store(_respond(door.url, "Three?", previous=kept["id"]), path, "read_only")
        assert httpx.get(f"{door.url}/v1/responses/{kept['id']}", timeout=60).json() == kept
        make_writable()
        for chat in (named, unnamed):
            resumed(chat.ask("Three?"), turn=3)
        third = respond(door.url, "Three?", previous=kept["id"])  # its store's connection was opened read-only
        assert third["agentkv"]["stats"]["miss_reason"] == "resumed"
        assert httpx.get(f"{door.url}/v1/responses/{third['id']}", timeout=60).json() == third
        assert saved_turns(path, "s1") == 3
    assert intact(path)


def test_a_file_made_immutable_under_a_live_door_is_refused_then_reopened(tmp_path: Path) -> None:
    """As root, ``chattr +i`` on the file and its log under a running door (as a disk that stops taking writes):
    the open connection's writes fail (an I/O error), the file opened again is read-only, each a 503; once the
    flag is gone the store opens the file afresh and saving goes on. (A mode change, ``chmod``, does not reach
    a connection already open: the OS checks modes when a file is opened.)"""
    path = tmp_path / "serve.sqlite3"
    if os.geteuid() != 0:
        pytest.skip("chattr takes root")
    with door_on(path) as door:
        named = Chat(door.url, "s1")
        two_turns(named)
        log = path.with_name(path.name + "-wal")  # never the -shm, which SQLite maps into memory
        if not _chattr("+i", path, log):
            pytest.skip("this file system has no immutable flag")
        try:
            refused_by_the_store(named.ask("Three?"), path, "io")
            refused_by_the_store(named.ask("Three?"), path, "read_only")
        finally:
            assert _chattr("-i", path, log)
        resumed(named.ask("Three?"), turn=3)
        assert saved_turns(path, "s1") == 3
    assert intact(path)


def _respond(url: str, text: str, *, previous: str | None = None) -> httpx.Response:
    body = {"model": "smol", "input": text, **({"previous_response_id": previous} if previous else {})}
    return httpx.post(url + "/v1/responses", json=body, timeout=60)


def respond(url: str, text: str, *, previous: str | None = None) -> dict[str, Any]:
    """A Responses-API call continuing ``previous``; the response object, checked to be answered."""
    response = _respond(url, text, previous=previous)
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    assert found["output"][0]["content"][0]["text"] == ANSWER
    return found


# ------------------------------------------------------------------ settings


def test_the_store_timeout_is_a_checked_setting_and_agentkv_serve_passes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for wrong in (0, -1.0, float("nan"), "2", True):
        with pytest.raises(UserError, match="timeout_s must be a positive number of seconds"):
            SqliteSessionStore(tmp_path / "s.sqlite3", timeout_s=wrong)  # type: ignore[arg-type]
    with SqliteResponseStore(tmp_path / "s.sqlite3") as default:
        assert default.timeout_s == 2.0
    from agentkv._surfaces import _cli

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)  # the command sets it; put back after the test
    with pytest.raises(SystemExit):
        _cli.main(["serve", "--store-timeout-s", "0"])
    assert "--store-timeout-s: must be a positive number of seconds, not 0" in capsys.readouterr().err
    argv = ["serve", "--store", str(tmp_path / "serve.sqlite3"), "--store-timeout-s", "0.25"]
    code, pool, door = serve_with_doubles(monkeypatch, argv)
    assert code == 0
    assert pool["store"].timeout_s == door["store"].timeout_s == 0.25


def test_a_store_locked_when_it_opens_says_so(tmp_path: Path) -> None:
    """A store whose table must be made while another process holds the file's lock fails at once, naming it."""
    path = tmp_path / "serve.sqlite3"
    with SqliteSessionStore(path):
        pass
    with locked(path), pytest.raises(StoreUnavailableError, match=f"could not open the store {path}: ") as raised:
        SqliteResponseStore(path, timeout_s=0.2)  # its table is not there yet
    assert raised.value.reason == "locked" and raised.value.path == str(path)
