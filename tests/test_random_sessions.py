"""Randomized sessions on an honest double of the pair: the push-back rule and the history under faults.

Each episode (one seed) drives a `Session` on `HonestPairEngine` through a random sequence of turns
(with and without tools, forced tool choices), streams, rewinds, edits, forks, cancellations,
raising callbacks, restores (of its own snapshot and of the empty one), tools whose output holds a lone
surrogate, bad inputs (to `run`, `step`, edits and `restore`), engine errors and deaths, malformed and
expiring handles. A shadow session on a fault-free engine replays every accepted operation from the start
of the episode.
After every operation:

* the honest engine saw no violation of the push-back rule (every forwarded handle was issued,
  unspent, unexpired, and holds a strict prefix of the new prompt);
* the stats add up (local + pulled + computed == prompt) and match what the engine did;
* only agentkv errors (or our own callback's exception, or cancellation) escaped, each where expected (a bad
  input: the error of its own kind);
* a failed, cancelled or abandoned operation changed nothing;
* token history, messages and turn count equal the shadow's (a replay of the accepted operations).

The engine's output is a function of the prompt, so a replay gives the same tokens. Seeds are fixed:
a failure prints the seed and the operation log, and reproduces with ``EPISODES=<seed>``.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentkv import (
    AgentKVError,
    ContextLengthError,
    EngineDeadError,
    EngineError,
    Event,
    InvalidMessageError,
    Session,
    SessionClosedError,
    SessionSnapshot,
    TurnEnd,
    TurnResult,
    UserError,
    tool,
)
from agentkv._session._session import load_tokenizer
from agentkv.engines import StepRequest
from agentkv.testing import MALFORMATIONS, Fault, HonestPairEngine

BATCHES = 10
EPISODES_PER_BATCH = {"landing": 10, "nightly": 100}
"""100 episodes on every landing (seeds 0-99), 1,000 in the nightly tier (seeds 0-999), in ten batches each."""

pytestmark = pytest.mark.upkeep  # the sessions' repins and early transfers run amid the faults

UPKEEP_STEPS = ("agentkv-renew-", "agentkv-repin-", "agentkv-prefetch-")
"""The request ids of a session's own steps while it waits (src/agentkv/_session/_pin_upkeep.py)."""

WORDS = ("alpha", "beta", "gamma", "delta", "kv", "pin", "block", "tea", "red", "seven", "Paris", "ok")
GARBLED = ("seven", "tea", "red", "ok")
"""The words `echo` returns with a lone surrogate after them."""


class CallbackBoom(Exception):
    """Raised by the test's own `on_event` callback."""


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
async def echo(text: str) -> str:
    """Repeat a text."""
    await anyio.lowlevel.checkpoint()
    return text + " \ud800" if text in GARBLED else text  # a tool's output no tokenizer takes: escaped, not refused


@tool
def broken(key: str) -> str:
    """Look a key up (always fails)."""
    raise KeyError(key)


TOOLS = (add, echo, broken)


class EpisodeFailure(AssertionError):
    pass


@dataclass
class Twin:
    """A session under test and its shadow (same operations, accepted ones only, no faults)."""

    live: Session
    shadow: Session
    name: str
    pin: str = "none"
    """What the next step's handle must be: "clean" (must be forwarded), "none" (must not), "any"."""
    restored: bool = False
    """Restored since its last accepted turn: that turn's first step (only) says ``resumed``."""
    caller: bool = False
    """Driven by `Session.step` with the messages kept here (the caller runs the tools), echoed back as handed out."""
    kept: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])
    shadow_kept: list[dict[str, Any]] = field(default_factory=list[dict[str, Any]])


@dataclass
class Episode:
    seed: int
    model_path: Path
    log: list[str] = field(default_factory=list[str])
    problems: list[str] = field(default_factory=list[str])

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        rng = self.rng
        self.tool_format = rng.choice(["none", "none", "schema", "schema", "native"])
        self.tools = list(TOOLS) if self.tool_format != "none" else []
        choice = "auto"
        if self.tool_format == "schema":
            choice = rng.choice(["auto", "auto", "required", "none", "add", "echo"])
        self.options: dict[str, Any] = {
            "system": rng.choice([None, "You are terse."]),
            "tools": self.tools,
            "tool_choice": choice,
            "tool_format": "native" if self.tool_format == "native" else "schema",
            "max_steps": rng.choice([1, 2, 3, 3, 4]),
            "max_tokens": rng.choice([48, 48, 48, 7]),
            "expiry_margin_s": rng.choice([5.0, 10.0, 30.0]),
        }
        tokenizer = load_tokenizer(str(self.model_path))
        self.tokenizer = tokenizer
        self.im_start, self.im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
        self.engine = self._engine()
        self.shadow_engine = self._engine()
        self.twins: list[Twin] = []
        self.dead = False

    def _engine(self) -> HonestPairEngine:
        return HonestPairEngine(
            self._respond,
            model_path=self.model_path,
            max_model_len=1024,
            forward_margin_s=self.options["expiry_margin_s"] * 0.75,
        )

    # ----------------------------------------------------------------- the model's outputs

    def _respond(self, request: StepRequest) -> str:
        prompt = list(request.prompt_token_ids)
        upkeep = request.request_id.startswith(UPKEEP_STEPS)  # a one-token step over a kept conversation
        if not upkeep and prompt.count(self.im_start) != prompt.count(self.im_end) + 1:
            self.problems.append(
                "a prompt has unbalanced <|im_start|>/<|im_end|> control tokens: text in a message was "
                "tokenized as a control token (defect 12)"
            )
        schema = request.sampling.json_schema
        if self.tool_format == "native" and schema is not None:
            self.problems.append("a native-tools session sent a JSON schema: its tool_format was lost (defect 3)")
        r = random.Random(f"{self.seed}:{zlib.crc32(array('q', prompt).tobytes())}")
        words = " ".join(r.choice(WORDS) for _ in range(r.randint(1, 5)))
        if schema is None:
            if self.tool_format == "native" and r.random() < 0.5:
                return "".join(
                    f"<tool_call>\n{json.dumps(_call(r, ['add', 'echo', 'broken', 'nope'], stringify=0.3))}\n</tool_call>"
                    for _ in range(r.randint(1, 2))
                )
            return words
        if r.random() < 0.05:
            return '{"answer": "unterminated'
        names = sorted(_tool_names(schema))
        if not names or ("anyOf" in schema and r.random() < 0.5):
            return json.dumps({"answer": words})
        return json.dumps({"tool_calls": [_call(r, names) for _ in range(r.randint(1, 2))]})

    # ----------------------------------------------------------------- running an episode

    async def play(self) -> None:
        async with self.engine, self.shadow_engine:
            live = Session(engine=self.engine, **self.options)
            shadow = Session(engine=self.shadow_engine, **self.options)
            async with live, shadow:
                self.empty = (live.snapshot(), shadow.snapshot())
                """Before any turn: what an empty session's restore starts from."""
                self.twins.append(Twin(live, shadow, "s0"))
                if self.tool_format == "native":  # a caller runs the tools: its calls come back as handed out
                    caller = Twin(
                        Session(engine=self.engine, **self.options),
                        Session(engine=self.shadow_engine, **self.options),
                        "c0",
                        caller=True,
                    )
                    await caller.live.open()
                    await caller.shadow.open()
                    self.twins.append(caller)
                self.log.append(f"options {self.options | {'tools': [t.name for t in self.tools]}}")
                for _ in range(self.rng.randint(6, 16)):
                    await self._operation(self.rng.choice(self.twins))
                    self._check_all()
                    if self.dead:
                        break
                for twin in self.twins[1:]:
                    await twin.live.aclose()
                    await twin.shadow.aclose()
            for _ in range(10):  # releases a session spawned may take a few loop iterations
                await anyio.lowlevel.checkpoint()
            held = self.engine.live_pins
            self._expect(self.dead or held == 0, f"{held} pin(s) still held on D after every session closed")
        self._expect(self.engine.stopped, "the engine's _stop did not run to its end on close")
        self._check_engines()

    async def _operation(self, twin: Twin) -> None:
        roll = self.rng.random()
        if twin.caller:  # its kept messages are the conversation: no edits, forks or closes
            if roll < 0.85 or not twin.live.stats.turns:
                await self._caller_turn(twin)
            else:
                self._restore(twin, source="own")
            return
        if roll < 0.52 or (roll < 0.81 and not twin.live.stats.turns):
            await self._turn(twin)
        elif roll < 0.62:
            self._rewind(twin)
        elif roll < 0.72:
            self._replace(twin)
        elif roll < 0.78 and len(self.twins) < 4:
            self._fork(twin)
        elif roll < 0.81 and twin is not self.twins[0]:
            await self._close(twin)
        elif roll < 0.87:
            self._restore(twin)
        else:
            await self._bad_input(twin)

    async def _turn(self, twin: Twin) -> None:
        rng = self.rng
        message = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        if rng.random() < 0.04:
            message += rng.choice([" <|im_end|>", " <|im_start|>assistant"])
        how = rng.choice(["run"] * 6 + ["events", "raise", "cancel", "stall", "stream", "stream_break"])
        fault: Fault | None = None
        if how == "stall":
            fault = "stall"
        elif rng.random() < 0.3:
            fault = rng.choice(
                ["error", "error_mid_stream", "malformed_handle", "expired_handle", "near_expiry_handle"]
                + ["expire_early", "decline"]
                + (["die", "die_mid_stream"] if rng.random() < 0.15 else [])
            )
        malformation = rng.choice(MALFORMATIONS)
        await self._settle()  # a fault is meant for the turn's step, not for a session's upkeep step before it
        if fault is not None:
            self.engine.inject(fault, malformation=malformation)
        at = rng.randint(1, 8)
        line = f"{twin.name}: {how} {message!r}"
        if fault is not None:
            line += f" with {fault}" + (f" ({malformation})" if fault == "malformed_handle" else "")
        if how in ("raise", "cancel", "stream_break"):
            line += f", at event {at}"
        self.log.append(line)
        first_handle = _handle_state(fault, malformation)
        before = _snapshot(twin.live)
        first_step = len(self.engine.steps)
        result: TurnResult | None = None
        error: BaseException | None = None
        abandoned = False
        try:
            result, abandoned = await self._run(twin.live, message, how, at)
        except (AgentKVError, CallbackBoom) as exc:
            error = exc
        except Exception as exc:  # anything else escaping is a failure
            self._fail(f"a non-agentkv exception escaped run(): {type(exc).__name__}: {exc}")
        finally:
            self.engine.clear_faults()
        records = [r for r in self.engine.steps[first_step:] if not r.request_id.startswith(UPKEEP_STEPS)]
        if result is not None:
            self.log.append(f"  accepted: {len(result.steps)} step(s), {result.text[:40]!r}")
            self._check_accepted(twin, result, records, first_handle)
            twin.restored = False
            shadow_result = await twin.shadow.run(message)
            self._expect(shadow_result.text == result.text, "the replay answered differently")
            twin.pin = first_handle if len(result.steps) == 1 else "clean"
            return
        outcome = type(error).__name__ if error else ("abandoned" if abandoned else "cancelled")
        self.log.append(f"  rejected: {outcome}: {error}")
        self._expect(
            _snapshot(twin.live) == before,
            f"a failed, cancelled or abandoned turn ({how}) changed the session (defect 1 if by a callback or stream)",
        )
        twin.pin = "any"
        if isinstance(error, CallbackBoom):
            return
        if isinstance(error, EngineDeadError):
            self._expect(self.dead or fault in ("die", "die_mid_stream"), f"EngineDeadError without a death: {error}")
            self.dead = True
            await self._after_death()
            return
        if isinstance(error, ContextLengthError):
            return
        if isinstance(error, EngineError):
            if fault == "malformed_handle":
                self._fail(f"a malformed handle from D failed a turn whose answer was good (defect 12): {error}")
            self._expect(fault in ("error", "error_mid_stream"), f"an EngineError without an engine fault: {error}")
            return
        if error is not None:
            self._fail(f"unexpected {type(error).__name__} from a valid run: {error} (defect 1 if 'already running')")
        if how == "stall" or how == "cancel" or abandoned:
            return
        self._fail(f"the turn ({how}) neither returned nor raised")

    async def _caller_turn(self, twin: Twin) -> None:
        """A turn the caller runs with `Session.step`: each reply appended exactly as handed out (a native call's
        ``function.arguments`` as given, also when the model wrote them as a JSON string), each call answered."""
        message = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 6)))
        self.log.append(f"{twin.name}: caller-run turn {message!r}")
        await self._settle()
        for kept in (twin.kept, twin.shadow_kept):
            kept.append({"role": "user", "content": message})
        for number in range(1, 4):
            try:
                reply = await twin.live.step(twin.kept)
            except AgentKVError as exc:
                self._fail(
                    f"caller-run step {number}, its history echoed back as handed out, raised {type(exc).__name__}: "
                    f"{exc} (issue 54: a call whose arguments the model wrote as a JSON string)"
                )
                return
            shadow = await twin.shadow.step(twin.shadow_kept)
            reason = reply.stats.miss_reason
            self.log.append(f"  step {number}: {len(reply.tool_calls)} call(s), miss {reason}")
            self._expect(reply.text == shadow.text, "the replay of a caller-run step answered differently")
            if number == 1 and twin.restored:
                self._expect(reason == "resumed", f"the first step after a restore says {reason}, not resumed")
            else:
                self._expect(reason != "resumed", "a step after the first since a restore says resumed (issue 54)")
            if number > 1:
                self._expect(
                    reason != "prefix_mismatch",
                    "a caller-run step extending the reply as handed out missed the pin (issue 54: prefix_mismatch)",
                )
            twin.restored = False
            twin.kept.append(reply.message.chat_dict())
            twin.shadow_kept.append(shadow.message.chat_dict())
            if not reply.tool_calls:
                return
            for kept, calls in ((twin.kept, reply.tool_calls), (twin.shadow_kept, shadow.tool_calls)):
                kept += [{"role": "tool", "tool_call_id": call.id, "content": "ok"} for call in calls]

    async def _settle(self) -> None:
        """Let the sessions' upkeep steps due now (a repin, an early transfer after a kept turn) run to their end."""
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        for twin in self.twins:
            await twin.live._upkeep.settled()

    async def _run(self, session: Session, message: str, how: str, at: int) -> tuple[TurnResult | None, bool]:
        """(the result, or None if the turn did not complete; whether the caller abandoned it)."""
        seen = 0

        def counting(event: Event) -> None:
            nonlocal seen
            seen += 1

        if how in ("run", "events"):
            return await session.run(message, on_event=counting if how == "events" else None), False
        if how == "raise":

            def boom(event: Event) -> None:
                nonlocal seen
                seen += 1
                if seen == at:
                    raise CallbackBoom(f"callback raised at event {at} ({event.kind})")

            return await session.run(message, on_event=boom), False
        if how == "cancel":
            with anyio.CancelScope() as scope:

                def cancel(event: Event) -> None:
                    nonlocal seen
                    seen += 1
                    if seen == at:
                        scope.cancel()

                return await session.run(message, on_event=cancel), False
            return None, False
        if how == "stall":
            with anyio.move_on_after(0.01):
                return await session.run(message), False
            return None, False
        result: TurnResult | None = None
        async for event in session.stream(message):
            seen += 1
            if isinstance(event, TurnEnd):
                result = event.result
            if how == "stream_break" and seen == at and result is None:
                return None, True
        return result, False

    def _check_accepted(self, twin: Twin, result: TurnResult, records: list[Any], first_handle: str) -> None:
        done = [r for r in records if r.outcome == "done"]
        self._expect(len(done) == len(records), "an accepted turn contains a failed step")
        if len(done) != len(result.steps):
            self._fail(f"{len(result.steps)} steps reported, {len(done)} served by the engine")
            return
        for index, (step, record) in enumerate(zip(result.steps, done, strict=True)):
            stats = step.stats
            where = f"step {index + 1}"
            self._expect(
                list(step.token_ids) == record.output_token_ids, f"{where}: output tokens differ from the engine's"
            )
            self._expect(stats.prompt_tokens == record.prompt_tokens, f"{where}: prompt_tokens wrong")
            self._expect(stats.handle_forwarded == record.forwarded, f"{where}: handle_forwarded wrong")
            self._expect(
                (stats.local_hit_tokens, stats.pulled_tokens, stats.computed_tokens)
                == (0, record.pulled_tokens, record.computed_tokens),
                f"{where}: the prompt split differs from the engine's",
            )
            if record.forwarded:
                expected = "declined" if record.declined else None
                self._expect(stats.miss_reason == expected, f"{where}: miss_reason {stats.miss_reason}, not {expected}")
            elif index == 0 and twin.restored:
                self._expect(
                    stats.miss_reason == "resumed", f"{where}: the first step after a restore says {stats.miss_reason}"
                )
            else:
                self._expect(
                    stats.miss_reason != "resumed",
                    f"{where}: a step without a pin says resumed though it is not the first since a restore (issue 54)",
                )
            expected_pin = twin.pin if index == 0 else (first_handle if index == 1 else "clean")
            if expected_pin == "clean":
                self._expect(record.forwarded, f"{where}: a clean pin extended by the prompt was not pushed back")
            elif expected_pin == "none":
                self._expect(not record.forwarded, f"{where}: a handle was pushed back where none was valid")

    async def _after_death(self) -> None:
        """A dead engine: every session on it refuses turns with EngineDeadError and keeps its history."""
        for twin in self.twins:
            before = _snapshot(twin.live)
            await self._expect_refused(twin.live, EngineDeadError, "a session on a dead engine")
            self._expect(_snapshot(twin.live) == before, "a turn refused by a dead engine changed the session")

    def _rewind(self, twin: Twin) -> None:
        turns = self.rng.choice([1, 1, 1, 2, 3, 0, -1, 50])
        count = _user_turns(twin.live)
        self.log.append(f"{twin.name}: rewind({turns}) of {count} turn(s)")
        before = _snapshot(twin.live)
        try:
            twin.live.rewind(turns)
        except AgentKVError as exc:
            self._expect(not 1 <= turns <= count, f"a valid rewind({turns}) raised {type(exc).__name__}: {exc}")
            self._expect(_snapshot(twin.live) == before, "a refused rewind changed the session")
            return
        except Exception as exc:
            self._fail(f"rewind({turns}) raised a non-agentkv {type(exc).__name__}: {exc}")
            return
        self._expect(1 <= turns <= count, f"rewind({turns}) of {count} turns was accepted")
        twin.shadow.rewind(turns)
        twin.pin = "any"

    def _replace(self, twin: Twin) -> None:
        count = len(twin.live.messages)
        index = self.rng.randint(0, count)  # count itself is out of range
        content = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 4)))
        self.log.append(f"{twin.name}: replace_message({index}, {content!r}) of {count} message(s)")
        before = _snapshot(twin.live)
        try:
            twin.live.replace_message(index, content)
        except AgentKVError as exc:
            self._expect(index >= count, f"a valid replace_message({index}) raised {type(exc).__name__}: {exc}")
            self._expect(_snapshot(twin.live) == before, "a refused replace_message changed the session")
            return
        except Exception as exc:
            self._fail(f"replace_message raised a non-agentkv {type(exc).__name__}: {exc}")
            return
        self._expect(index < count, f"replace_message({index}) of {count} messages was accepted")
        twin.shadow.replace_message(index, content)
        twin.pin = "any"

    def _restore(self, twin: Twin, *, source: str | None = None) -> None:
        """restore() of the session's own snapshot (through JSON: nothing changes) or of the empty one (emptied)."""
        source = source or self.rng.choice(["own", "own", "empty"])
        self.log.append(f"{twin.name}: restore({source} snapshot) of {_user_turns(twin.live)} turn(s)")
        live, shadow = (twin.live.snapshot(), twin.shadow.snapshot()) if source == "own" else self.empty
        emptied = ([], [live.system] if live.system is not None else [], 0)
        expected = _snapshot(twin.live) if source == "own" else emptied
        try:
            twin.live.restore(SessionSnapshot.model_validate_json(live.model_dump_json()))
        except Exception as exc:
            self._fail(f"restoring the {source} snapshot raised {type(exc).__name__}: {exc}")
        self._expect(_snapshot(twin.live) == expected, f"restoring the {source} snapshot gave another session")
        twin.shadow.restore(shadow)
        twin.pin = "none"  # a restored session has no pin: its next step computes the prompt ("resumed")
        twin.restored = True

    def _fork(self, twin: Twin) -> None:
        name = f"s{len(self.twins)}"
        self.log.append(f"{twin.name}: fork -> {name}")
        try:
            live = twin.live.fork()
        except AgentKVError as exc:
            self._fail(f"fork of an idle open session raised {type(exc).__name__}: {exc}")
            return
        self._expect(live.token_ids == twin.live.token_ids, "a fork does not start with its parent's history")
        self.twins.append(Twin(live, twin.shadow.fork(), name, pin="none"))

    async def _close(self, twin: Twin) -> None:
        self.log.append(f"{twin.name}: close")
        await twin.live.aclose()
        await twin.shadow.aclose()
        self.twins.remove(twin)
        self._expect(not twin.live.is_open, "a closed fork says it is open")
        self._expect(self.engine.is_open or self.dead, "closing a fork closed the shared engine")
        await self._expect_refused(twin.live, SessionClosedError, "a closed session")

    async def _bad_input(self, twin: Twin) -> None:
        """Wrong types and values: each raises its agentkv error and changes nothing (defect 9)."""
        session = twin.live
        call = {"id": "c1", "type": "function", "function": {"name": "echo", "arguments": '{"text": "hi"}'}}
        called = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]
        cases: dict[str, tuple[type[AgentKVError], Any]] = {
            "run('\\ud800 hi')": (InvalidMessageError, lambda: session.run("\ud800 hi")),
            "step(user '\\udc00 hi')": (
                InvalidMessageError,
                lambda: session.step([{"role": "user", "content": "\udc00 hi"}]),
            ),
            "step(tool result '\\ud800')": (
                InvalidMessageError,
                lambda: session.step([*called, {"role": "tool", "tool_call_id": "c1", "content": "\ud800"}]),
            ),
            "rewind('1')": (UserError, lambda: session.rewind("1")),  # type: ignore[arg-type]
            "replace_message('0', 'x')": (UserError, lambda: session.replace_message("0", "x")),  # type: ignore[arg-type]
            "replace_message(0, '\\udfff')": (InvalidMessageError, lambda: session.replace_message(0, "\udfff")),
            "restore(another model's snapshot)": (
                UserError,
                lambda: session.restore(self.empty[0].model_copy(update={"model": "elsewhere"})),
            ),
            "restore(a dict)": (UserError, lambda: session.restore(self.empty[0].model_dump())),  # type: ignore[arg-type]
            "restore(its JSON text)": (UserError, lambda: session.restore(self.empty[0].model_dump_json())),  # type: ignore[arg-type]
            "restore(tokens without segments)": (
                UserError,
                lambda: session.restore(self.empty[0].model_copy(update={"tokens": [1, 2, 3]})),
            ),
            "Session(max_tokens='10')": (UserError, lambda: Session(engine=self.engine, max_tokens="10")),  # type: ignore[arg-type]
            "Session(expiry_margin_s=-1)": (UserError, lambda: Session(engine=self.engine, expiry_margin_s=-1.0)),
            "Session(temperature=-0.5)": (UserError, lambda: Session(engine=self.engine, temperature=-0.5)),
        }
        name = self.rng.choice(sorted(cases))
        expected, case = cases[name]
        self.log.append(f"{twin.name}: bad input {name}")
        before = _snapshot(session)
        refused = False
        try:
            outcome = case()
            if hasattr(outcome, "__await__"):
                await outcome
        except expected:
            refused = True
        except AgentKVError as exc:
            self._fail(f"{name} raised {type(exc).__name__}, not {expected.__name__}: {exc}")
        except Exception as exc:
            self._fail(f"{name} raised a non-agentkv {type(exc).__name__}: {exc} (defect 9)")
        self._expect(refused, f"{name} was accepted (defect 9)")
        self._expect(_snapshot(session) == before, f"{name} changed the session")

    # ----------------------------------------------------------------- checks

    def _check_all(self) -> None:
        self._check_engines()
        for twin in self.twins:
            live, shadow = twin.live, twin.shadow
            self._expect(live.token_ids == shadow.token_ids, f"{twin.name}: token history differs from the replay")
            self._expect(live.messages == shadow.messages, f"{twin.name}: messages differ from the replay")
            turns = live.stats.turns
            self._expect(
                len(turns) == _user_turns(live),
                f"{twin.name}: {len(turns)} turns in stats, {_user_turns(live)} in the conversation (defect 10)",
            )
            for turn in turns:
                for step in turn.steps:
                    self._expect(
                        step.local_hit_tokens + step.pulled_tokens + step.computed_tokens == step.prompt_tokens,
                        "the stats invariant broke",
                    )
            if self.tool_format == "schema":
                text = self.tokenizer.decode(live.token_ids)
                self._expect(
                    not live.token_ids or "You can call tools:" in text,
                    f"{twin.name}: the tool instructions are gone from the prompt (defect 4)",
                )
            self._expect(live.engine is self.engine, f"{twin.name}: the session swapped the engine it was given")
        if self.problems:
            raise EpisodeFailure(self.problems[0])

    def _check_engines(self) -> None:
        for engine in (self.engine, self.shadow_engine):
            if engine.violations:
                raise EpisodeFailure(f"push-back rule broken: {engine.violations[0]}")

    async def _expect_refused(self, session: Session, error: type[AgentKVError], who: str) -> None:
        """A turn on ``session`` must raise ``error`` (and no other agentkv error)."""
        try:
            await session.run("anyone there?")
            self._fail(f"{who} ran a turn")
        except error:
            pass
        except AgentKVError as exc:
            self._fail(f"{who} raised {type(exc).__name__}, not {error.__name__}: {exc}")

    def _expect(self, condition: bool, problem: str) -> None:
        if not condition:
            self._fail(problem)

    def _fail(self, problem: str) -> None:
        raise EpisodeFailure(problem)


def _handle_state(fault: Fault | None, malformation: str) -> str:
    """Whether the handle of a turn's first step may be pushed back: "clean" (must), "none" (must not), "any"."""
    if fault in ("expired_handle", "near_expiry_handle"):
        return "none"
    if fault == "malformed_handle":
        return "any" if malformation == "unknown_key" else "none"  # unknown keys may be dropped, or the handle
    return "clean"


def _snapshot(session: Session) -> tuple[list[int], list[Any], int]:
    return session.token_ids, session.messages, len(session.stats.turns)


def _user_turns(session: Session) -> int:
    return sum(1 for message in session.messages if message.role == "user")


def _tool_names(schema: Any) -> set[str]:
    """The tool names a step's output schema allows (the ``const`` of each call's ``name``)."""
    found: set[str] = set()
    if isinstance(schema, dict):
        name = schema.get("properties", {}).get("name") if isinstance(schema.get("properties"), dict) else None
        if isinstance(name, dict) and "const" in name:
            found.add(name["const"])
        for value in schema.values():
            found |= _tool_names(value)
    elif isinstance(schema, list):
        for item in schema:
            found |= _tool_names(item)
    return found


def _call(r: random.Random, names: list[str], *, stringify: float = 0.0) -> dict[str, Any]:
    """A call of one of ``names``; with probability ``stringify`` its arguments written as a JSON *string* (as some
    models write them: vLLM's parser hands them out as that string's text)."""
    name = r.choice(names)
    if name == "add":
        arguments: dict[str, Any] = {"a": r.randint(0, 9), "b": r.randint(0, 9)}
        if r.random() < 0.1:
            arguments = {"a": "seven"}  # invalid arguments: the tool is not called, the model is told
    elif name == "echo":
        arguments = {"text": r.choice(WORDS)}
    else:
        arguments = {"key": r.choice(WORDS)}
    if r.random() < stringify:
        return {"name": name, "arguments": json.dumps(arguments)}
    return {"name": name, "arguments": arguments}


def _seeds(batch: int, tier: str) -> list[int]:
    chosen = os.environ.get("EPISODES")
    if chosen:
        return [int(seed) for seed in chosen.split(",")] if batch == 0 else []
    size = EPISODES_PER_BATCH[tier]
    return list(range(batch * size, (batch + 1) * size))


TEST_NAME = "test_random_sessions_keep_the_push_back_rule_and_the_history"


@pytest.mark.anyio
@pytest.mark.parametrize("tier", ["landing", pytest.param("nightly", marks=pytest.mark.nightly)])
@pytest.mark.parametrize("batch", range(BATCHES))
async def test_random_sessions_keep_the_push_back_rule_and_the_history(batch: int, tier: str, model_path: Path) -> None:
    failures: dict[int, Episode] = {}
    for seed in _seeds(batch, tier):
        episode = Episode(seed, model_path)
        try:
            await episode.play()
        except EpisodeFailure as exc:
            episode.problems.insert(0, str(exc))
            failures[seed] = episode
    if failures:
        kinds = Counter(episode.problems[0] for episode in failures.values())
        first_seed, first = next(iter(failures.items()))
        summary = "\n".join(f"  {count} x {problem}" for problem, count in kinds.most_common())
        log = "\n".join(f"    {line}" for line in first.log)
        pytest.fail(
            f"{len(failures)} of {len(_seeds(batch, tier))} episodes failed; seeds {sorted(failures)}\n{summary}\n"
            f"first failure, seed {first_seed}: {first.problems[0]}\n{log}\n"
            f"rerun it: EPISODES={first_seed} pytest 'tests/test_random_sessions.py::{TEST_NAME}[0-landing]'",
            pytrace=False,
        )
