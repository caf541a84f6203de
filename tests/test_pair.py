"""The real pair: two vLLM engines joined by NIXL, on the bundled model (docs/concepts.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import anyio
import pytest

from agentkv import Colocated, ContextLengthError, EmbeddedPair, InvalidMessageError, Session, StepStats, TurnResult
from agentkv._engines._pair_layer import PairLayer
from agentkv._engines._system import alive

pytestmark = pytest.mark.pair

SYSTEM = "You are a terse assistant for a Python project. " + " ".join(
    f"Fact {i}: module m{i} exports function f{i}." for i in range(30)
)  # ~300 tokens: more than two CPU blocks, so P's own cache and the pull both show
QUESTIONS = ("Which module exports f3?", "And f7?", "Name one more module.")
MAX_TOKENS = 12


def _run(session: Session, questions: Sequence[str] = QUESTIONS) -> list[TurnResult]:
    return [session.run_sync(question) for question in questions]


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU time (user + system, all threads) used so far by those of these processes still alive."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def _assert_invariant(step: StepStats) -> None:
    assert step.local_hit_tokens + step.pulled_tokens + step.computed_tokens == step.prompt_tokens


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at output token {index}: {list(a[index : index + 5])} vs {list(b[index : index + 5])}"


def test_push_back_pulls_from_d_from_turn_two(pair: EmbeddedPair) -> None:
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
        results = _run(session)
    steps = [result.steps[0].stats for result in results]
    for step in steps:
        _assert_invariant(step)
    assert steps[0].pulled_tokens == 0 and steps[0].miss_reason == "no_handle"
    for step in steps[1:]:
        assert step.handle_forwarded and step.miss_reason is None
        assert step.pulled_tokens > 0, step
        assert step.computed_tokens < step.prompt_tokens - step.pulled_tokens
        assert step.kv_bytes is not None and step.kv_bytes > 0


def test_a_stop_string_ends_the_answer_and_the_conversation_goes_on(pair: EmbeddedPair) -> None:
    """vLLM ends a request at a stop string by aborting it: D pins nothing for that step, so the next step
    recomputes; its output ends normally, and the step after it pulls back again."""
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    replies = []
    with Session(engine=pair, max_tokens=MAX_TOKENS) as session:
        for question, stop in zip(QUESTIONS, ([" "], None, None), strict=True):
            history.append({"role": "user", "content": question})
            replies.append(session.step_sync(history, stop=stop))
            history.append({"role": "assistant", "content": replies[-1].text})
    stopped, after, pulled = (reply.stats for reply in replies)
    assert replies[0].finish_reason == "stop" and " " not in replies[0].text
    assert replies[0].step.finish_reason == "stop" and " " not in replies[0].step.text
    assert (after.turn, after.handle_forwarded, after.miss_reason) == (2, False, "no_handle")
    assert (pulled.turn, pulled.handle_forwarded, pulled.miss_reason) == (3, True, None)
    assert pulled.pulled_tokens > 0 and stopped.output_tokens >= 1


def test_disaggregated_mode_never_pulls(pair: EmbeddedPair) -> None:
    with Session(engine=pair, mode="disaggregated", system=SYSTEM, max_tokens=MAX_TOKENS) as session:
        results = _run(session)
    for result in results:
        step = result.steps[0].stats
        _assert_invariant(step)
        assert step.pulled_tokens == 0 and not step.handle_forwarded
        assert step.miss_reason == "push_back_off"


def test_greedy_output_is_the_same_with_and_without_push_back(pair: EmbeddedPair) -> None:
    """docs/concepts.md, "The token-exact rule": pulling D's KV back must not change greedy output.

    KV that D computed while decoding and KV that P computes in a prefill could in principle
    differ in the last bits (different kernels); with the same CPU kernels on both engines
    (float32 here) they do not, and this test requires equality token for token.
    """
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) as pushed:
        with_push_back = _run(pushed)
    with Session(engine=pair, mode="disaggregated", system=SYSTEM, max_tokens=MAX_TOKENS) as plain:
        without = _run(plain)
    assert [r.steps[0].stats.pulled_tokens > 0 for r in with_push_back] == [False, True, True]
    for turn, (a, b) in enumerate(zip(with_push_back, without, strict=True), start=1):
        ids_a, ids_b = a.steps[0].token_ids, b.steps[0].token_ids
        assert ids_a == ids_b, f"turn {turn}: {_first_difference(ids_a, ids_b)}"


def test_edited_history_never_forwards_the_handle(pair: EmbeddedPair) -> None:
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
        _run(session, QUESTIONS[:2])
        session.replace_message(1, "Which module exports f5?")
        reference = session.fork()  # same tokens, no pin: what a fresh session would compute
        edited = session.run_sync(QUESTIONS[2])
        fresh = reference.run_sync(QUESTIONS[2])
        reference.close()
    step = edited.steps[0].stats
    assert not step.handle_forwarded and step.pulled_tokens == 0
    # the session gives its pin back at the edit (no_handle), or keeps it and the rule refuses it
    assert step.miss_reason in ("prefix_mismatch", "no_handle")
    assert fresh.steps[0].stats.miss_reason == "no_handle"
    assert edited.steps[0].token_ids == fresh.steps[0].token_ids, _first_difference(
        edited.steps[0].token_ids, fresh.steps[0].token_ids
    )


def test_rewound_history_never_forwards_the_handle(pair: EmbeddedPair) -> None:
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
        _run(session, QUESTIONS[:2])
        session.rewind()
        again = session.run_sync("And f9?")
        after = session.run_sync("And f2?")
    assert again.steps[0].stats.miss_reason in ("prefix_mismatch", "no_handle")  # see the edited-history test
    assert not again.steps[0].stats.handle_forwarded
    assert after.steps[0].stats.pulled_tokens > 0  # the new branch is pinned again


def test_an_expiring_pin_is_not_pushed_back(pair: EmbeddedPair) -> None:
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS, expiry_margin_s=10, renew_pins=False) as session:
        session.run_sync(QUESTIONS[0])
        time.sleep(pair.pin_ttl_s - 10 + 1)  # inside the margin before D's pin expires
        late = session.run_sync(QUESTIONS[1])
        on_time = session.run_sync(QUESTIONS[2])
    step = late.steps[0].stats
    _assert_invariant(step)
    assert step.miss_reason == "expired" and not step.handle_forwarded and step.pulled_tokens == 0
    assert on_time.steps[0].stats.pulled_tokens > 0


def test_a_read_p_declines_is_recomputed(pair: EmbeddedPair) -> None:
    """Forwarded too late on purpose (margin 0): P declines reads within 5 s of expiry."""
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS, expiry_margin_s=0, renew_pins=False) as session:
        first = session.run_sync(QUESTIONS[0])
        time.sleep(pair.pin_ttl_s - 3)
        late = session.run_sync(QUESTIONS[1])
    step = late.steps[0].stats
    _assert_invariant(step)
    assert step.handle_forwarded and step.miss_reason == "declined" and step.pulled_tokens == 0
    assert late.text and first.text


def test_bad_input_leaves_the_session_usable(pair: EmbeddedPair) -> None:
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
        session.run_sync(QUESTIONS[0])
        before = session.token_ids
        with pytest.raises(InvalidMessageError):
            session.run_sync("")
        with pytest.raises(ContextLengthError):
            session.run_sync("word " * 3000)
        assert session.token_ids == before
        after = session.run_sync(QUESTIONS[1])
    assert after.steps[0].stats.pulled_tokens > 0  # the pin survived the refused inputs


@pytest.mark.anyio
async def test_concurrent_sessions_share_the_pair(pair: EmbeddedPair) -> None:
    """Two conversations at once on one pair (a copilot backend), from an async caller."""
    sessions = [Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) for _ in range(2)]
    for session in sessions:
        await anyio.to_thread.run_sync(session.__enter__)
    results: dict[int, list[TurnResult]] = {0: [], 1: []}

    async def converse(index: int) -> None:
        for question in QUESTIONS[:2]:
            results[index].append(await sessions[index].run(question))

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(converse, 0)
            group.start_soon(converse, 1)
    finally:
        for session in sessions:
            await anyio.to_thread.run_sync(session.close)
    for turns in results.values():
        assert turns[1].steps[0].stats.pulled_tokens > 0
        _assert_invariant(turns[1].steps[0].stats)
    assert results[0][0].text == results[1][0].text  # greedy, same prompt


def test_streamed_text_matches_the_answer(pair: EmbeddedPair) -> None:
    deltas: list[str] = []
    with Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
        result = session.run_sync(QUESTIONS[0], on_event=lambda e: deltas.append(getattr(e, "text", "")))
    assert "".join(deltas) == result.text and result.text


def test_greedy_answers_agree_across_modes(pair: EmbeddedPair, colocated: Colocated) -> None:
    """The same conversation, greedy, on the pair with and without push-back and on one engine.

    The colocated engine runs the same float32 CPU kernels, and its prefix cache reuses KV
    like P does, so the answers are required to be equal token for token.
    """
    answers: dict[str, list[list[int]]] = {}
    for mode in ("bidirectional", "disaggregated"):
        with Session(engine=pair, mode=mode, system=SYSTEM, max_tokens=MAX_TOKENS) as session:
            answers[mode] = [result.steps[0].token_ids for result in _run(session)]
    with Session(engine=colocated, system=SYSTEM, max_tokens=MAX_TOKENS) as session:  # float32 as the pair: exact
        results = _run(session)
        answers["colocated"] = [result.steps[0].token_ids for result in results]
        assert results[1].steps[0].stats.local_hit_tokens > 0  # its prefix cache served turn 2
    for mode in ("disaggregated", "colocated"):
        for turn, (a, b) in enumerate(zip(answers["bidirectional"], answers[mode], strict=True), start=1):
            assert a == b, f"{mode}, turn {turn}: {_first_difference(a, b)}"


def test_pins_past_d_s_budget_are_released_and_their_conversations_recompute(pair: EmbeddedPair) -> None:
    check_pin_budget_evicts_the_oldest(pair)


def check_pin_budget_evicts_the_oldest(pair: PairLayer) -> None:
    """D's pins never fill its cache: past the budget the least recently pinned conversation is released;
    its next step recomputes (``evicted``) and answers as a session that never pushed back. The same for
    every pair kind (the pair layer): tests/test_launched.py runs it on the launched servers."""
    budget = pair._pin_budget()
    salt = f"budget-{time.monotonic_ns()}"
    first, second = (Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS, cache_salt=salt) for _ in range(2))
    plain = Session(engine=pair, system=SYSTEM, max_tokens=MAX_TOKENS, mode="disaggregated", cache_salt=salt)
    with first, second, plain:
        answers = [first.run_sync(QUESTIONS[0])]
        budget.max_pinned_blocks = 1  # below one conversation: the next step's pin evicts every other
        try:
            second.run_sync(QUESTIONS[0])
        finally:
            budget.max_pinned_blocks = None
        answers += [first.run_sync(question) for question in QUESTIONS[1:]]
        evicted, again = (answer.steps[0].stats for answer in answers[1:])
        assert evicted.miss_reason == "evicted" and evicted.pulled_tokens == 0
        assert again.miss_reason is None and again.pulled_tokens > 0  # pinned again, pushed back as before
        assert second.run_sync(QUESTIONS[1]).steps[0].stats.pulled_tokens > 0  # the newer pin was kept
        for answer in answers:
            _assert_invariant(answer.steps[0].stats)
        reference = [plain.run_sync(question).steps[0].token_ids for question in QUESTIONS]
    assert [answer.steps[0].token_ids for answer in answers] == reference


def test_an_idle_pair_leaves_the_cores_free(pair: EmbeddedPair) -> None:
    """With KV parked on D (a pinned conversation), the pair's processes sleep until work comes.

    vLLM's and NIXL's busy loops kept ~1.8 cores busy here before agentkv made them wait
    (src/_agentkv_vllm/_patches.py); the bound leaves a wide margin for a noisy machine.
    """
    with Session(engine=pair, system=SYSTEM, max_tokens=4) as session:
        session.run_sync(QUESTIONS[0])  # D now pins this conversation's blocks
        time.sleep(1)
        before, started = cpu_seconds(pair.pids), time.monotonic()
        time.sleep(4)
        cores_busy = (cpu_seconds(pair.pids) - before) / (time.monotonic() - started)
        assert cores_busy < 0.5, f"the idle pair kept {cores_busy:.2f} cores busy"
        assert session.run_sync(QUESTIONS[1]).steps[0].stats.pulled_tokens > 0  # the pin was still there


def test_a_cache_salt_keeps_sessions_apart(pair: EmbeddedPair) -> None:
    def first_turn(salt: str) -> StepStats:
        with Session(engine=pair, system=SYSTEM, max_tokens=2, cache_salt=salt) as session:
            return session.run_sync(QUESTIONS[2]).steps[0].stats

    salt = f"tenant-{time.monotonic_ns()}"
    assert first_turn(salt).local_hit_tokens == 0
    assert first_turn(salt).local_hit_tokens > 0  # the same tenant finds its blocks
    assert first_turn(salt + "-other").local_hit_tokens == 0  # another tenant does not


_EXIT_SCRIPT = """
import anyio
from agentkv import EmbeddedPair, Session
from agentkv._engines import Sampling, StepRequest

async def d_holds_no_block(pair: EmbeddedPair) -> bool:
    # vLLM resets D's prefix cache only when no block is in use: none pinned
    for _ in range(50):
        if await pair._d.llm.reset_prefix_cache():
            return True
        await anyio.sleep(0.1)  # D frees a released pin on its next poll
    return False

async def leave_a_pin(pair: EmbeddedPair) -> bool:
    # KV that nobody releases: D still holds this pin when the process ends
    request = StepRequest(request_id="left-pinned", prompt_token_ids=[1] * 200, sampling=Sampling(max_tokens=2))
    async for _ in pair.step(request):
        pass
    return not await pair._d.llm.reset_prefix_cache()

if __name__ == "__main__":
    pair = EmbeddedPair(max_model_len=512, warmup=False).start()  # opened, never closed
    print("pids", *sorted(pair.pids), flush=True)
    with Session(engine=pair, system="You are terse.", max_tokens=4) as session:
        print("answer", session.run_sync("Say hi.").text, flush=True)
    print("released", pair.home.call(d_holds_no_block, pair), flush=True)  # the session released its pin at close
    print("pinned", pair.home.call(leave_a_pin, pair), flush=True)
    # the script ends on an exception (an agent framework's MaxTurnsExceeded, say): the exit handler stops
    # the pair that is still open, with D holding a pin
    raise RuntimeError("the agent gave up")
"""


def test_a_script_releases_its_pins_and_exits_cleanly_with_its_pair_still_open(tmp_path: Path) -> None:
    """Pins released when a session closes (``Engine.release``); a script that ends on an exception with its pair
    open and a pin on D exits cleanly (the exit handler stops the pair): defect 11 of issue 12 and issue 31's
    exception at exit; no force-killed engine core, no traceback but the script's own, no leaked shared memory,
    no process left.

    D's pins used to keep its engine core busy after SIGTERM until vLLM killed it (5 s), before
    it could unlink its shared memory and semaphores; the script leaves one pin on D at exit.
    (The nightly tier also ends a process holding a never-closed colocated engine, and SIGKILLs one:
    tests/test_lifecycle.py.)
    """
    script = tmp_path / "uses_a_pair.py"
    script.write_text(_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-4000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines.get("released") == "True" and lines.get("pinned") == "True", done.stdout
    assert done.stderr.count("Traceback") == 1, done.stderr[-4000:]  # the script's own, and nothing after it
    assert done.stderr.rstrip().endswith("RuntimeError: the agent gave up"), done.stderr[-4000:]
    for noise in ("leaked", "force killing", "EngineDeadError"):
        assert noise not in done.stderr, f"{noise!r} at exit:\n{done.stderr[-4000:]}"
    pids = {int(pid) for pid in lines["pids"].split()}
    deadline = time.monotonic() + 20
    while alive(pids) and time.monotonic() < deadline:  # the exit handler waited for them; reaping may lag
        time.sleep(0.2)
    assert pids and alive(pids) == set()
