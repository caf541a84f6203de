"""``agentkv smoke``: a few turns with a tool on a pair, checking that the KV of every step after the first
comes back from D.

The first thing to run on a new host (a GPU host, another vLLM build, a user's own model): it opens a pair
with the platform's defaults (``docs/engines.md``, "Platforms, devices and engine arguments"), runs a short
conversation whose every turn calls a small deterministic tool, and checks what a working pair must show.
`run_smoke` does the work on an engine it is given (the tests give it the suite's shared pair);
`smoke_command` is the command's: it opens the pair, runs `run_smoke` and prints the report.

What is checked (`SmokeReport.checks`):

* **push-back**: the engine serves mode ``bidirectional`` (D pins KV, P can pull it back);
* **tool**: every turn called the tool, with arguments that validated;
* **pull-back**: every step after the conversation's first had D's handle forwarded and pulled KV from D,
  or pulled nothing for the one expected reason, ``below_threshold`` (P's own prefix cache already held all
  but fewer than the pair's ``recompute_threshold`` tokens of D's pin, so P computed them: reported in the
  notes, not a failure); and every turn from the second on pulled something in one of its steps.
  With ``mode="auto"`` (``--mode auto``) the pair may place a step on D alone, which reuses D's own cache of
  the pinned conversation instead of pulling: such a step counts as reuse when D's cache served tokens.

The session runs without the early transfer (``Session(early_transfer=False)``): with it, the KV a turn needs is
pulled by a one-token step between turns (src/agentkv/_session/_pin_upkeep.py), out of the turn's own stats, and
the check would see only P's own cache. The pull it checks is the same one.

A turn that raises is a failed check too (the report says which turn and what was raised).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .._conversation._tools import ToolCall, tool
from .._engines import EmbeddedPair, Engine, LaunchedPair
from .._engines._platforms import current_platform
from .._errors import AgentKVError
from .._session._modes import modes_of, off_reason
from .._session._session import Session
from .._stats._stats import StepStats, text_table
from ._engine_placement import engine_placement, installed_versions, server_versions

__all__ = [
    "SMOKE_MAX_STEPS",
    "SMOKE_MAX_TOKENS",
    "SmokeCheck",
    "SmokeReport",
    "SmokeStep",
    "add",
    "run_smoke",
    "smoke_command",
    "smoke_question",
]

SMOKE_MAX_TOKENS = 48
"""Answer length of every step: a tool call of the schema format fits with room to spare."""
SMOKE_MAX_STEPS = 3
"""Steps per turn: the forced call, one free step, and a last one made to answer."""


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


_FIRST_QUESTIONS = ("What is 1234 + 4321?", "Thanks. And 1 + 1?")
"""The two turns `tests/test_pair_tools.py` runs on the bundled model (later turns follow their pattern)."""


def smoke_question(turn: int) -> str:
    """The user message of ``turn`` (from 1): deterministic, each a sum for `add`."""
    if turn <= len(_FIRST_QUESTIONS):
        return _FIRST_QUESTIONS[turn - 1]
    return f"And {20 * turn} + {turn + 1}?"


@dataclass(frozen=True)
class SmokeCheck:
    """One thing the smoke run checked."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class SmokeStep:
    """One model call of the smoke conversation: its stats and the tools it called."""

    stats: StepStats
    tool_calls: tuple[ToolCall, ...] = ()
    tool_errors: tuple[str, ...] = ()
    """Errors of its tool results (``invalid_arguments``, ...), empty when every call ran."""
    text: str = ""


@dataclass(frozen=True)
class SmokeReport:
    """What `run_smoke` found: where the engines ran, every step's stats, and the checks."""

    engine: str
    """The engine's class name."""
    model: str
    platform: str
    """``"cpu"``, ``"cuda"``, or what is known where the engine does not say (remote servers, a test double)."""
    placement: dict[str, str]
    """Where each engine of the pair computes, by role (``"prefill"``, ``"decode"``; ``"engine"`` for one
    engine): ``"cores 0-3"``, ``"GPUs 0,1 (tensor-parallel 2)"``, a server's URL; on CPU also the pair's
    ``"core policy"``, and for a group of pairs their number (``"pairs"``)."""
    versions: dict[str, str] = field(default_factory=dict[str, str])
    """vLLM, NIXL and torch as installed in this process (absent ones left out), and for a pair of servers what
    each said it runs (``"P's server"``, ``"D's server"``)."""
    steps: list[SmokeStep] = field(default_factory=list[SmokeStep])
    checks: list[SmokeCheck] = field(default_factory=list[SmokeCheck])
    notes: list[str] = field(default_factory=list[str])
    """What a reader should know that is not a failure (a ``below_threshold`` step, the open time)."""
    turns: int = 0
    """Turns asked for."""
    opened_s: float | None = None
    """How long the pair took to open (set by `smoke_command`; None when the engine was given open)."""

    @property
    def passed(self) -> bool:
        """Whether every check passed (and there was at least one)."""
        return bool(self.checks) and all(check.passed for check in self.checks)

    @property
    def failures(self) -> list[SmokeCheck]:
        return [check for check in self.checks if not check.passed]

    @property
    def exit_code(self) -> Literal[0, 1]:
        """The command's exit status: 0 when every check passed, 1 otherwise."""
        return 0 if self.passed else 1

    def table(self) -> str:
        """One line per step: TTFT, where each prompt token's KV came from, and the tool calls it made."""
        header = (
            "turn",
            "step",
            "ttft_s",
            "prompt",
            "local",
            "pulled",
            "computed",
            "on",
            "out",
            "kv_MB",
            "miss",
            "tool calls",
        )
        rows = [
            (
                str(step.stats.turn),
                str(step.stats.step),
                f"{step.stats.ttft_s:.3f}",
                str(step.stats.prompt_tokens),
                str(step.stats.local_hit_tokens),
                str(step.stats.pulled_tokens),
                str(step.stats.computed_tokens),
                {"prefill": "P", "decode": "D"}.get(step.stats.prefill_engine or "", "-"),
                str(step.stats.output_tokens),
                "-" if step.stats.kv_bytes is None else f"{step.stats.kv_bytes / 1e6:.2f}",
                step.stats.miss_reason or "-",
                "; ".join(_call_text(call) for call in step.tool_calls) or "-",
            )
            for step in self.steps
        ]
        return text_table(header, rows)

    def text(self) -> str:
        """The whole report, as the command prints it."""
        versions = ", ".join(f"{name} {version}" for name, version in self.versions.items())
        lines = [
            f"agentkv smoke: {self.engine}, model {self.model}",
            f"platform: {self.platform}" + (f" ({versions})" if versions else ""),
        ]
        width = max((len(_ROLE_LABELS.get(role, role)) for role in self.placement), default=0)
        lines += [f"{_ROLE_LABELS.get(role, role).ljust(width)}: {where}" for role, where in self.placement.items()]
        if not self.placement:
            lines.append("engines: where they compute was not reported by this engine")
        if self.opened_s is not None:
            lines.append(f"opened in {self.opened_s:.1f} s")
        if self.steps:
            lines += ["", self.table()]
        lines += ["", "checks:"]
        lines += [f"  {'ok  ' if check.passed else 'FAIL'}  {check.name}: {check.detail}" for check in self.checks]
        if self.notes:
            lines += ["notes:", *(f"  {note}" for note in self.notes)]
        steps = f"{len({s.stats.turn for s in self.steps})} turns, {len(self.steps)} steps"
        if self.passed:
            lines.append(f"\nagentkv smoke: passed ({steps})")
        else:
            failed = ", ".join(check.name for check in self.failures) or "no check ran"
            lines.append(f"\nagentkv smoke: FAILED ({failed}; {steps})")
        return "\n".join(lines)


_ROLE_LABELS = {"prefill": "prefill (P)", "decode": "decode (D)"}


def _call_text(call: ToolCall) -> str:
    arguments = ", ".join(f"{name}={value!r}" for name, value in call.arguments.items())
    return f"{call.name}({arguments})"


def run_smoke(
    engine: Engine, *, turns: int = 3, mode: Literal["bidirectional", "auto"] = "bidirectional"
) -> SmokeReport:
    """Run ``turns`` turns of a conversation with a tool on ``engine`` and check that turns 2+ pull from D.

    ``mode="auto"``: the session lets the pair place each step on P or on D alone (a step on D reuses D's cache
    instead of pulling, and counts as reuse); an open engine that serves no mode ``auto`` fails the check.

    ``engine`` is used as a Session uses one: an open engine (opened with ``with``) is shared and stays
    open; an unopened one opens and closes with the run. Every turn's first step must call `add`
    (``tool_choice="required"``, which the schema tool format forces even on a model never trained for tools);
    the conversation runs under a cache salt of its own, so that no other conversation's blocks in P's
    prefix cache stand in for the pull. Engine errors during a turn end the run with a failed check; the
    report says which turn. Blocking: call it outside an event loop (or from a thread).
    """
    if turns < 2:
        raise ValueError("a smoke run needs at least 2 turns: pull-back starts at turn 2")
    steps: list[SmokeStep] = []
    checks: list[SmokeCheck] = []
    notes: list[str] = []
    report = SmokeReport(engine=type(engine).__name__, model="?", platform="?", placement={}, turns=turns)
    if mode == "auto" and engine.is_open and "auto" not in modes_of(engine.info):
        why = off_reason(engine.info, "auto") or "it places every step on P"
        return dataclasses.replace(report, checks=[SmokeCheck("push-back", False, f"the engine serves no auto: {why}")])
    with (
        Session(
            mode="auto" if mode == "auto" else None,  # None: the engine's own mode, checked below
            engine=engine,
            tools=[add],
            tool_choice="required",
            max_steps=SMOKE_MAX_STEPS,
            max_tokens=SMOKE_MAX_TOKENS,
            cache_salt=f"agentkv-smoke-{uuid.uuid4().hex[:12]}",
            early_transfer=False,  # the pull is checked at the step (the early transfer makes it between turns)
        ) as session
    ):
        info = session.engine.info
        platform, placement = engine_placement(info, session.engine)
        versions = {
            **installed_versions(),
            **{f"{role}'s server": said for role, said in server_versions(info.details).items()},
        }
        report = dataclasses.replace(
            report, model=str(info.model_path), platform=platform, placement=placement, versions=versions
        )
        if session.mode != mode:
            checks.append(
                SmokeCheck(
                    "push-back",
                    False,
                    f"the engine does not push back: it serves {', '.join(sorted(modes_of(info)))}, so a session runs "
                    f"{session.mode!r} (a pair opened with push_back=False, or servers without push-back)",
                )
            )
            return dataclasses.replace(report, checks=checks)
        checks.append(SmokeCheck("push-back", True, f"the engine serves {mode}; the session runs it"))
        raised: str | None = None
        for turn in range(1, turns + 1):
            try:
                result = session.run_sync(smoke_question(turn))
            except AgentKVError as exc:
                raised = f"turn {turn} raised {type(exc).__name__}: {exc}"
                break
            steps += [
                SmokeStep(
                    stats=step.stats,
                    tool_calls=tuple(step.tool_calls),
                    tool_errors=tuple(r.error for r in step.tool_results if r.error is not None),
                    text=step.text,
                )
                for step in result.steps
            ]
    if raised is not None:
        checks.append(SmokeCheck("turns", False, raised))
    checks += _check_steps(steps, turns=turns, notes=notes)
    return dataclasses.replace(report, steps=steps, checks=checks, notes=notes)


def _check_steps(steps: Sequence[SmokeStep], *, turns: int, notes: list[str]) -> list[SmokeCheck]:
    """The tool and pull-back checks over the steps that ran (``notes`` gets what is expected but worth saying)."""
    by_turn: dict[int, list[SmokeStep]] = {}
    for step in steps:
        by_turn.setdefault(step.stats.turn, []).append(step)
    ran = sorted(by_turn)
    checks: list[SmokeCheck] = []

    without_call = [t for t in ran if not any(call.name == "add" for s in by_turn[t] for call in s.tool_calls)]
    errors = [f"turn {s.stats.turn} step {s.stats.step}: {', '.join(s.tool_errors)}" for s in steps if s.tool_errors]
    if not ran:
        checks.append(SmokeCheck("tool", False, "no turn ran"))
    elif without_call or errors:
        what = [f"turn {t} did not call add" for t in without_call] + errors
        checks.append(SmokeCheck("tool", False, "; ".join(what)))
    else:
        calls = sum(len(s.tool_calls) for s in steps)
        checks.append(SmokeCheck("tool", True, f"every turn called add ({calls} calls, all ran)"))

    problems: list[str] = []
    for step in steps[1:]:  # the conversation's first step has nothing to pull
        stats = step.stats
        where = f"turn {stats.turn} step {stats.step}"
        if not stats.handle_forwarded:
            problems.append(f"{where}: D's handle was not forwarded (miss_reason {stats.miss_reason})")
        elif _reused(stats):
            continue
        elif stats.miss_reason == "below_threshold":
            notes.append(
                f"{where} pulled nothing (below_threshold): P's own prefix cache held all but fewer than the "
                "pair's recompute_threshold tokens of D's pin, so P computed them (expected; not a failure)"
            )
        elif stats.miss_reason is None:
            notes.append(f"{where} pulled nothing: P's own prefix cache held all D's pin held (not a failure)")
        else:
            problems.append(
                f"{where}: the handle was forwarded but nothing was pulled (miss_reason {stats.miss_reason})"
            )
    later = [t for t in ran if t >= 2]
    empty = [t for t in later if not any(_reused(s.stats) for s in by_turn[t])]
    problems += [f"turn {t} pulled nothing from D in any of its steps" for t in empty]
    if len(ran) < turns:
        problems.append(f"{len(ran)} of {turns} turns ran")
    if not later:
        problems.append("no turn after the first ran: nothing could be pulled back")
    if problems:
        checks.append(SmokeCheck("pull-back", False, "; ".join(problems)))
    else:
        pulled = ", ".join(f"turn {t}: {sum(s.stats.pulled_tokens for s in by_turn[t])}" for t in later)
        unpulled = sum(1 for s in steps[1:] if not _reused(s.stats))
        but = f"; {unpulled} step(s) pulled nothing for an expected reason (notes)" if unpulled else ""
        on_decode = sum(1 for s in steps if s.stats.prefill_engine == "decode")
        but += f"; {on_decode} step(s) ran on D alone, from D's own cache" if on_decode else ""
        detail = "every step after the first had D's handle forwarded, every turn from 2 on pulled KV back from D"
        checks.append(SmokeCheck("pull-back", True, f"{detail} (tokens pulled: {pulled}){but}"))
    return checks


def _reused(stats: StepStats) -> bool:
    """The step's prompt came back from the pin: pulled from D, or computed on D alone over D's cache of it."""
    return stats.pulled_tokens > 0 or (stats.prefill_engine == "decode" and stats.local_hit_tokens > 0)


def smoke_command(
    *,
    model: str | None = None,
    engine: Literal["embedded", "launched"] = "embedded",
    max_model_len: int = 4096,
    turns: int = 3,
    prefill_devices: Sequence[int | str] | None = None,
    decode_devices: Sequence[int | str] | None = None,
    engine_args: Mapping[str, Any] | None = None,
    mode: Literal["bidirectional", "auto"] = "bidirectional",
    out: Callable[[str], None] = print,
) -> int:
    """``agentkv smoke``: open a pair with the platform's defaults, run `run_smoke` on it, print the report.

    Only what is given is passed to the pair: the rest are its defaults on this host's platform. Returns the
    exit status: 0 when every check passed, 1 otherwise. A pair that does not open raises (the command line
    reports it).
    """
    current_platform()  # first: on a host vLLM finds no platform on, say so in seconds (`no_platform_message`)
    kind = LaunchedPair if engine == "launched" else EmbeddedPair
    options: dict[str, Any] = {"engine_args": dict(engine_args)} if engine_args else {}
    if prefill_devices is not None or decode_devices is not None:
        options.update(prefill_devices=prefill_devices, decode_devices=decode_devices)
    pair = kind(model, max_model_len=max_model_len, **options)
    out(f"agentkv smoke: opening {kind.__name__} (model {model or 'bundled'}) on this host's platform ...")
    started = time.perf_counter()
    with pair:
        opened_s = time.perf_counter() - started
        report = run_smoke(pair, turns=turns, mode=mode)
    report = dataclasses.replace(report, opened_s=opened_s)
    out(report.text())
    return report.exit_code
