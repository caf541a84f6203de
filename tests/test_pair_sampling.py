"""Every sampling option on the real engines: a pair's step (pushing a pinned turn back) samples what one engine
samples, token for token (logprobs within 1e-3), and a value vLLM refuses is a `UserError` that leaves the engine
usable. The mapping itself, and the first-token rule, are unit-tested in test_sampling.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from agentkv import Colocated, EmbeddedPair, LaunchedPair, UserError
from agentkv._engines import Engine, StepDone, StepRequest, TokenDelta
from agentkv._engines._base import Sampling, SamplingOptions
from agentkv.engines import Pin

pytestmark = pytest.mark.pair

MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3


@dataclass
class Turns:
    """A conversation of two turns: the first (greedy, pinned on the pair's D), then the prompt of the second."""

    first: list[int]
    second: list[int]
    baseline: StepDone
    """One engine's greedy answer to the second prompt (what options below are chosen from)."""


async def _collect(engine: Engine, request: StepRequest) -> tuple[list[TokenDelta], StepDone]:
    deltas: list[TokenDelta] = []
    async for event in engine.step(request):
        if isinstance(event, StepDone):
            return deltas, event
        deltas.append(event)
    raise AssertionError("the step ended without a StepDone")


def step(engine: Engine, prompt: Sequence[int], sampling: Sampling, pin: Pin | None = None) -> StepDone:
    request = StepRequest(
        request_id=f"sampling-{uuid.uuid4().hex}", prompt_token_ids=list(prompt), sampling=sampling, pin=pin
    )
    assert engine.home is not None
    deltas, done = engine.home.call(_collect, engine, request)
    assert [t for delta in deltas for t in delta.token_ids] == list(done.token_ids)  # streamed as returned
    if done.logprobs is not None:
        assert [lp for delta in deltas for lp in delta.logprobs or ()] == list(done.logprobs)
    return done


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def turns(tokenizer: Any, colocated: Colocated) -> Turns:
    system = "You are a helpful assistant. " + " ".join(f"Item {i} is a {c}." for i, c in enumerate("ABCDEFGHIJ" * 3))
    first = _chat(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": "Name item 4."}])
    answer = step(colocated, first, Sampling(max_tokens=4)).token_ids
    follow = (
        "<|im_end|>\n<|im_start|>user\nNow tell me a short story about a red fox.<|im_end|>\n<|im_start|>assistant\n"
    )
    second = [*first, *answer, *tokenizer.encode(follow, add_special_tokens=False)]
    return Turns(first=first, second=second, baseline=step(colocated, second, Sampling(max_tokens=MAX_TOKENS)))


def pair_step(pair: Engine, turns: Turns, sampling: Sampling) -> StepDone:
    """The second turn on a pair, its first turn pinned on D and pushed back."""
    first = step(pair, turns.first, Sampling(max_tokens=4))
    assert first.pin is not None
    assert [*turns.first, *first.token_ids] == turns.second[: len(turns.first) + len(first.token_ids)]
    done = step(pair, turns.second, sampling, pin=first.pin)
    assert not done.timings.pin_declined, done.timings  # P took the pushed-back pin
    return done


def assert_same(done: StepDone, expected: StepDone, what: str) -> None:
    assert list(done.token_ids) == list(expected.token_ids), what
    assert (done.text, done.finish_reason) == (expected.text, expected.finish_reason), what
    if expected.logprobs is None:
        assert done.logprobs is None, what
        return
    assert done.logprobs is not None and len(done.logprobs) == len(done.token_ids), what
    for got, want in zip(done.logprobs, expected.logprobs, strict=True):
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) < LOGPROB_TOLERANCE, what
        assert [t for t, _ in got.top] == [t for t, _ in want.top], what
        assert all(abs(a - b) < LOGPROB_TOLERANCE for (_, a), (_, b) in zip(got.top, want.top, strict=True)), what


Case = Callable[[StepDone, Any], Sampling]


def _options(**options: Any) -> Case:
    return lambda baseline, tokenizer: Sampling(max_tokens=MAX_TOKENS, options=SamplingOptions(**options))


CASES: dict[str, Case] = {
    "greedy": _options(),
    "seeded top_k top_p min_p": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS, temperature=0.8, seed=7, options=SamplingOptions(top_k=20, top_p=0.9, min_p=0.05)
    ),
    "presence and frequency penalties": _options(presence_penalty=1.5, frequency_penalty=1.0),
    "repetition penalty": _options(repetition_penalty=1.6),
    "logit bias forcing a token": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS, options=SamplingOptions(logit_bias={tok.encode(" fox")[0]: 100.0})
    ),
    "min tokens": _options(min_tokens=MAX_TOKENS),
    "stop token id sampled by P": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS, options=SamplingOptions(stop_token_ids=(base.token_ids[0],))
    ),
    "stop token id sampled by D": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS, options=SamplingOptions(stop_token_ids=(base.token_ids[2],))
    ),
    "logprobs": _options(logprobs=3),
    "bad words": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS, options=SamplingOptions(bad_words=(tok.decode(base.token_ids[1]).strip() or "a",))
    ),
    "allowed token ids": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS, options=SamplingOptions(allowed_token_ids=tuple(base.token_ids[1:4]) + (28, 30))
    ),
    "regex": _options(structured_outputs={"regex": "[0-9]{2} (red|green) foxes"}),
    "choice": _options(structured_outputs={"choice": ["once upon a time", "never"]}),
    "json object": _options(structured_outputs={"json_object": True}, logprobs=1),
    "seeded with logprobs and stop ids": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=3,
        options=SamplingOptions(top_p=0.8, logprobs=2, stop_token_ids=(base.token_ids[3],), repetition_penalty=1.2),
    ),
    "bias, min tokens, special tokens and logprobs": lambda base, tok: Sampling(
        max_tokens=MAX_TOKENS,
        stop=("zebra",),
        options=SamplingOptions(
            logit_bias={tok.eos_token_id: 5.0},
            min_tokens=3,
            logprobs=2,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        ),
    ),
}


@pytest.mark.nightly  # the CI tier's tests/test_differential.py holds the pair to vllm serve on each option
def test_every_option_samples_on_the_pair_as_on_one_engine(
    pair: EmbeddedPair, colocated: Colocated, turns: Turns, tokenizer: Any
) -> None:
    assert turns.baseline.finish_reason == "length"  # the options below change a full answer
    for name, case in CASES.items():
        sampling = case(turns.baseline, tokenizer)
        expected = step(colocated, turns.second, sampling)
        assert_same(pair_step(pair, turns, sampling), expected, name)
        if name == "logit bias forcing a token":
            assert set(expected.token_ids) == {tokenizer.encode(" fox")[0]}
        if name.startswith("stop token id"):
            assert expected.finish_reason == "stop" and expected.token_ids[-1] in sampling.options.stop_token_ids
        if name == "min tokens":
            assert len(expected.token_ids) == MAX_TOKENS
        if name in ("logprobs", "json object"):
            assert expected.logprobs is not None and all(
                len(lp.top) == sampling.options.logprobs for lp in expected.logprobs
            )


REFUSED: dict[str, SamplingOptions] = {
    "logit_bias": SamplingOptions(logit_bias={10**7: 1.0}),
    "allowed_token_ids": SamplingOptions(allowed_token_ids=(10**7,)),
    "stop_token_ids": SamplingOptions(stop_token_ids=(10**7,)),
    "structured_outputs": SamplingOptions(structured_outputs={"choice": []}),
}


@pytest.mark.parametrize("field", list(REFUSED))
def test_a_value_vllm_refuses_is_a_user_error_and_the_pair_goes_on(
    field: str, pair: EmbeddedPair, colocated: Colocated, turns: Turns
) -> None:
    sampling = Sampling(max_tokens=MAX_TOKENS, options=REFUSED[field])
    with pytest.raises(UserError, match=field):
        step(colocated, turns.second, sampling)
    first = step(pair, turns.first, Sampling(max_tokens=4))
    with pytest.raises(UserError, match=field):
        step(pair, turns.second, sampling, pin=first.pin)
    done = step(pair, turns.second, Sampling(max_tokens=MAX_TOKENS), pin=first.pin)  # the pin is unspent
    assert not done.timings.pin_declined
    assert_same(done, turns.baseline, "after a refusal")


def test_the_launched_pair_sends_the_options_and_reads_logprobs_back(
    launched: LaunchedPair, colocated: Colocated, turns: Turns, tokenizer: Any
) -> None:
    for name in ("seeded with logprobs and stop ids", "bias, min tokens, special tokens and logprobs", "choice"):
        sampling = CASES[name](turns.baseline, tokenizer)
        assert_same(pair_step(launched, turns, sampling), step(colocated, turns.second, sampling), name)
    with pytest.raises(UserError, match="logit_bias"):
        step(launched, turns.second, Sampling(max_tokens=MAX_TOKENS, options=REFUSED["logit_bias"]))
    assert_same(pair_step(launched, turns, Sampling(max_tokens=MAX_TOKENS)), turns.baseline, "after a refusal")
