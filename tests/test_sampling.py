"""Every sampling option, on the engines' side (no engine): vLLM's ``SamplingParams`` (`vllm_sampling`), the
``/v1/completions`` body (`completion_body`), when P's token may start the answer (`first_token_of_prefill`),
logprobs from vLLM and from the completions API, refusals as `UserError`, and the scripted doubles' refusals.
The real engines run the same options in test_pair_sampling.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.logprobs import Logprob
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from agentkv import UserError
from agentkv._engines._base import Sampling, SamplingOptions, StepRequest, TokenLogprob
from agentkv._engines._http_transport import completion_body, completion_logprobs
from agentkv._engines._vllm_sampling import (
    check_sampling,
    continued_sampling,
    first_token_of_prefill,
    prefill_sampling,
    refused,
    vllm_logprobs,
    vllm_sampling,
)
from agentkv.testing import HonestPairEngine, ScriptedEngine, UnconsumedScriptError

BLOCK = 128

_SAME_IN_VLLM: dict[str, Any] = {
    "top_p": 0.9,
    "top_k": 40,
    "min_p": 0.05,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "repetition_penalty": 1.1,
    "min_tokens": 2,
    "ignore_eos": True,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "logprobs": 3,
}
"""The `EVERY_OPTION` values that vLLM's ``SamplingParams`` takes as they are."""

EVERY_OPTION = SamplingOptions(
    **_SAME_IN_VLLM,
    logit_bias={"42": 5.0},  # OpenAI's string keys are accepted
    stop_token_ids=(7, 9),
    bad_words=("spam",),
    allowed_token_ids=(1, 2, 42),
    structured_outputs={"regex": "[a-z]+"},
)


def _sampling(**options: Any) -> Sampling:
    return Sampling(max_tokens=8, options=SamplingOptions(**options))


# ----------------------------------------------------------------- vLLM's SamplingParams


def test_vllm_sampling_maps_every_option() -> None:
    sampling = Sampling(max_tokens=8, temperature=0.7, seed=3, stop=("END",), options=EVERY_OPTION)
    params = vllm_sampling(sampling, kv_transfer_params={"do_remote_decode": True}, stream=True)
    by_hand = SamplingParams(
        max_tokens=8,
        temperature=0.7,
        seed=3,
        stop=["END"],
        **_SAME_IN_VLLM,
        logit_bias={42: 5.0},
        stop_token_ids=[7, 9],
        bad_words=["spam"],
        allowed_token_ids=[1, 2, 42],
        structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    assert params == by_hand


def test_vllm_sampling_with_no_options_is_vllms_defaults() -> None:
    params = vllm_sampling(Sampling(max_tokens=8), kv_transfer_params=None, stream=False)
    assert params == SamplingParams(max_tokens=8, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (Sampling(max_tokens=2, options=SamplingOptions(min_tokens=3)), "min_tokens"),
        (Sampling(max_tokens=0), "max_tokens"),
        (Sampling(temperature=3.0), "temperature"),
        (Sampling(stop=("",)), "stop"),
        (Sampling(options=SamplingOptions(bad_words=("",))), "bad_words"),
    ],
)
def test_values_vllm_refuses_are_user_errors_naming_the_field(sampling: Sampling, field: str) -> None:
    with pytest.raises(UserError, match=f"^{field}: "):
        vllm_sampling(sampling, kv_transfer_params=None, stream=True)


def test_a_vllm_refusal_is_named_by_its_parameter_or_its_message() -> None:
    from vllm.exceptions import VLLMValidationError

    assert str(refused(VLLMValidationError("out of vocab", parameter="logit_bias"))).startswith("logit_bias: ")
    assert str(refused(VLLMValidationError("allowed_token_ids is empty"))).startswith("allowed_token_ids: ")
    assert str(refused(ValueError("Invalid regex pattern"))).startswith("structured_outputs: ")


def test_check_sampling_refuses_before_any_engine_what_d_would() -> None:
    check_sampling(Sampling(max_tokens=2, options=SamplingOptions(min_tokens=2)))
    with pytest.raises(UserError, match="^min_tokens: "):
        check_sampling(Sampling(max_tokens=2, options=SamplingOptions(min_tokens=3)))


def test_p_samples_with_the_steps_options_and_d_continues_with_one_token_less() -> None:
    sampling = Sampling(max_tokens=8, seed=1, stop=("x",), json_schema={"type": "object"}, options=EVERY_OPTION)
    prefill = prefill_sampling(sampling)
    assert (prefill.max_tokens, prefill.stop, prefill.structured) == (1, (), None)
    assert prefill.options == EVERY_OPTION.model_copy(update={"min_tokens": 1, "structured_outputs": None})
    assert prefill_sampling(Sampling(max_tokens=8)).options.min_tokens == 0
    vllm_sampling(prefill, kv_transfer_params=None, stream=False)  # vLLM takes it: min_tokens <= max_tokens
    continued = continued_sampling(sampling)
    assert (continued.max_tokens, continued.options.min_tokens, continued.seed) == (7, 1, 1)
    assert continued_sampling(Sampling(max_tokens=8)).options.min_tokens == 0


# ----------------------------------------------------------------- the completions body


def test_completion_body_carries_every_option_in_vllms_names() -> None:
    sampling = Sampling(max_tokens=8, temperature=0.7, seed=3, stop=("END",), options=EVERY_OPTION)
    body = completion_body(model="m", prompt_token_ids=[1, 2], max_tokens=8, sampling=sampling, kv_transfer_params={})
    extra = body.pop("extra_body")
    assert body == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "seed": 3,
        "logit_bias": {"42": 5.0},
        "logprobs": 3,
        "stop": ["END"],
    }
    assert extra == {
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "kv_transfer_params": {},
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [7, 9],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "bad_words": ["spam"],
        "allowed_token_ids": [1, 2, 42],
        "structured_outputs": {"regex": "[a-z]+"},
    }


def test_ps_completion_body_caps_min_tokens_and_leaves_out_the_stop_strings() -> None:
    sampling = Sampling(max_tokens=8, stop=("END",), options=SamplingOptions(min_tokens=4, logprobs=0))
    body = completion_body(model="m", prompt_token_ids=[1], max_tokens=1, sampling=sampling, kv_transfer_params={})
    assert body["extra_body"]["min_tokens"] == 1 and "stop" not in body
    assert body["logprobs"] == 0 and body["extra_body"]["return_tokens_as_token_ids"] is True
    plain = completion_body(model="m", prompt_token_ids=[1], max_tokens=8, sampling=Sampling(), kv_transfer_params={})
    assert not {"logprobs", "logit_bias"} & set(plain) and "return_tokens_as_token_ids" not in plain["extra_body"]
    forced = completion_body(
        model="m", prompt_token_ids=[1], max_tokens=1, sampling=Sampling(json_schema={}), kv_transfer_params={}
    )
    assert forced["extra_body"]["structured_outputs"] == {"json": {}}  # P checks the grammar before D is asked


def test_completions_logprobs_come_back_as_token_logprobs() -> None:
    logprobs = SimpleNamespace(
        tokens=["token_id:5", "token_id:9"],
        token_logprobs=[-0.1, -2.0],
        top_logprobs=[
            {"token_id:5": -0.1, "token_id:6": -2.5, "token_id:7": -3.0},
            {"token_id:9": -2.0, "token_id:1": -0.5, "token_id:2": -1.0},  # the chosen one is not in the top 2
        ],
        text_offset=[0, 1],
    )
    assert completion_logprobs(logprobs, 2) == [
        TokenLogprob(token_id=5, logprob=-0.1, top=((5, -0.1), (6, -2.5))),
        TokenLogprob(token_id=9, logprob=-2.0, top=((1, -0.5), (2, -1.0))),
    ]
    as_dict = {"tokens": ["token_id:5"], "token_logprobs": [None], "top_logprobs": [None]}
    assert completion_logprobs(as_dict, 0) == [TokenLogprob(token_id=5, logprob=-9999.0)]
    assert completion_logprobs(None, 2) == []


# ----------------------------------------------------------------- P's token as the answer's first


def _position(chosen: tuple[int, float, int], *top: tuple[int, float]) -> dict[int, Logprob]:
    """vLLM's dict for one token: the chosen one first (its own rank), then the ranked top."""
    entries = {chosen[0]: Logprob(logprob=chosen[1], rank=chosen[2])}
    for rank, (token_id, logprob) in enumerate(top, start=1):
        entries[token_id] = Logprob(logprob=logprob, rank=rank)
    return entries


def _p_out(token_ids: list[int], text: str = "Hi", finish_reason: str = "length", logprobs: Any = None) -> Any:
    completion = SimpleNamespace(token_ids=token_ids, text=text, finish_reason=finish_reason, logprobs=logprobs)
    return SimpleNamespace(outputs=[completion])


def _request(sampling: Sampling, prompt: int = 300) -> StepRequest:
    return StepRequest(request_id="r", prompt_token_ids=list(range(prompt)), sampling=sampling)


def test_vllm_logprobs_keep_the_ranked_top_likeliest_first() -> None:
    positions = [_position((42, -3.0, 5), (1, -0.5), (2, -1.0), (3, -1.5)), _position((1, -0.5, 1), (1, -0.5))]
    assert vllm_logprobs([42, 1], positions, 2) == [
        TokenLogprob(token_id=42, logprob=-3.0, top=((1, -0.5), (2, -1.0))),
        TokenLogprob(token_id=1, logprob=-0.5, top=((1, -0.5),)),
    ]
    assert vllm_logprobs([1], [_position((1, float("-inf"), 9))], 0) == [TokenLogprob(token_id=1, logprob=-9999.0)]


@pytest.mark.parametrize(
    ("sampling", "used"),
    [
        (Sampling(max_tokens=8), True),
        (Sampling(max_tokens=8, temperature=0.8), True),  # unseeded: P's draw is as good as D's
        (Sampling(max_tokens=8, temperature=0.0, seed=5), True),  # greedy: the seed draws nothing
        (Sampling(max_tokens=8, temperature=0.8, seed=5), False),  # one generator draws every token
        (_sampling(repetition_penalty=1.3, top_k=5, min_p=0.1, logit_bias={3: 2.0}), True),
        (_sampling(allowed_token_ids=(1, 2, 42), min_tokens=3, ignore_eos=True), True),
        (_sampling(presence_penalty=0.5), False),  # counts the output's tokens
        (_sampling(frequency_penalty=0.5), False),
        (_sampling(bad_words=("a b",)), False),
        (_sampling(structured_outputs={"regex": "a+"}), False),  # the grammar's state
        (Sampling(max_tokens=8, json_schema={"type": "object"}), False),
    ],
)
def test_continues_after_first_token(sampling: Sampling, used: bool) -> None:
    assert sampling.continues_after_first_token() is used
    assert (first_token_of_prefill(_request(sampling), _p_out([42]), BLOCK) is not None) is used


@pytest.mark.parametrize(
    ("sampling", "p_out", "why"),
    [
        (Sampling(max_tokens=1), _p_out([42]), "the answer is one token: D must still run"),
        (_sampling(stop_token_ids=(42,)), _p_out([42]), "a stop token id ends the answer"),
        (_sampling(stop_token_ids=(42,)), _p_out([42], finish_reason="stop"), "as vLLM says"),
        (_sampling(), _p_out([2], "", "stop"), "EOS ended the answer"),
        (_sampling(ignore_eos=True), _p_out([2], ""), "EOS that does not end it has no text to stream"),
        (Sampling(max_tokens=8, stop=("i",)), _p_out([42], "Hi"), "a stop string in its text"),
        (
            Sampling(max_tokens=8, stop=("i!",), options=SamplingOptions(include_stop_str_in_output=True)),
            _p_out([42], "Hi"),
            "a stop string begun in its text, kept or not",
        ),
    ],
)
def test_ps_token_is_not_used_when_it_ends_or_may_end_the_answer(sampling: Sampling, p_out: Any, why: str) -> None:
    assert first_token_of_prefill(_request(sampling), p_out, BLOCK) is None, why


def test_ps_token_after_eos_ignored_is_the_first_when_it_has_text() -> None:
    first = first_token_of_prefill(_request(_sampling(ignore_eos=True)), _p_out([2], "<|im_end|>"), BLOCK)
    assert first is not None and list(first.token_ids) == [2]


def test_ps_tokens_logprobs_come_with_it_when_asked() -> None:
    p_out = _p_out([42], logprobs=[_position((42, -0.2, 1), (42, -0.2), (7, -2.0))])
    first = first_token_of_prefill(_request(_sampling(logprobs=1)), p_out, BLOCK)
    assert first is not None and first.logprobs == [TokenLogprob(token_id=42, logprob=-0.2, top=((42, -0.2),))]
    unasked = first_token_of_prefill(_request(_sampling()), p_out, BLOCK)
    assert unasked is not None and unasked.logprobs is None


# ----------------------------------------------------------------- the pair's first token, on fake engines


async def _fake_pair_step(sampling: Sampling, p_logprobs: Any, d_logprobs: Any) -> tuple[Any, Any, Any]:
    from test_embedded_pair_logic import FakePair, _output, p_reply, request, run_step

    async def prefill(prompt: list[int], params: Any, request_id: str) -> Any:
        out = _output(token_ids=[5], finished=True, params=p_reply(remote_num_tokens=len(prompt)))
        out.outputs[0].logprobs = p_logprobs
        yield out

    async def decode(prompt: list[int], params: Any, request_id: str) -> Any:
        out = _output(token_ids=[11, 12], finished=True, params=None)
        out.outputs[0].logprobs = d_logprobs
        yield out

    pair = FakePair(prefill, decode)
    async with pair:
        done = await run_step(pair, dataclasses.replace(request(), sampling=sampling))
    return done, pair.p_llm.requests[0][1], pair.d_llm.requests[0]


@pytest.mark.anyio
async def test_the_pair_streams_ps_token_with_its_logprobs_first_and_d_continues_without_the_seed_hack() -> None:
    sampling = Sampling(max_tokens=3, seed=9, options=SamplingOptions(min_tokens=2, logprobs=0, repetition_penalty=1.2))
    done, p_params, (d_prompt, d_params, _) = await _fake_pair_step(
        sampling, [_position((5, -0.1, 1))], [_position((11, -0.3, 1)), _position((12, -0.4, 2))]
    )
    assert list(done.token_ids) == [5, 11, 12] and d_prompt[-1] == 5
    assert [lp.token_id for lp in done.logprobs] == [5, 11, 12]
    assert (p_params.max_tokens, p_params.min_tokens, p_params.repetition_penalty, p_params.logprobs) == (1, 1, 1.2, 0)
    assert (d_params.max_tokens, d_params.min_tokens, d_params.seed) == (2, 1, 9)


@pytest.mark.anyio
async def test_a_seeded_random_step_is_all_ds() -> None:
    sampling = Sampling(max_tokens=3, temperature=0.8, seed=9, options=SamplingOptions(logprobs=0))
    done, _, (d_prompt, d_params, _) = await _fake_pair_step(
        sampling, [_position((5, -0.1, 1))], [_position((11, -0.3, 1)), _position((12, -0.4, 2))]
    )
    assert list(done.token_ids) == [11, 12] and d_prompt[-1] != 5
    assert [lp.token_id for lp in done.logprobs] == [11, 12]
    assert (d_params.max_tokens, d_params.seed) == (3, 9)


# ----------------------------------------------------------------- the scripted doubles


@pytest.mark.parametrize(
    "options",
    [
        {"logprobs": 2},
        {"logit_bias": {1: 1.0}},
        {"allowed_token_ids": (1,)},
        {"bad_words": ("x",)},
        {"min_tokens": 1},
        {"ignore_eos": True},
        {"stop_token_ids": (1,)},
        {"skip_special_tokens": False},
    ],
)
@pytest.mark.anyio
async def test_the_doubles_refuse_options_they_cannot_honour(options: dict[str, Any]) -> None:
    (name,) = options
    request = _request(Sampling(max_tokens=8, options=SamplingOptions(**options)), prompt=10)
    scripted, honest = ScriptedEngine(["Paris."]), HonestPairEngine()
    for engine in (scripted, honest):
        async with engine:
            with pytest.raises(UserError, match=f"^{name}: "):
                async for _ in engine.step(request):
                    pass
    assert scripted.requests == [] and honest.steps == []  # refused before the script or the pin checks
    with pytest.raises(UnconsumedScriptError, match="never used"):  # its output waits for the next step
        scripted.assert_complete()


@pytest.mark.anyio
async def test_the_doubles_take_what_shapes_the_distribution_and_keep_a_stop_string_when_asked() -> None:
    options = SamplingOptions(top_p=0.5, top_k=3, min_p=0.1, repetition_penalty=1.2, include_stop_str_in_output=True)
    request = _request(Sampling(max_tokens=16, stop=("two",), options=options), prompt=10)
    async with ScriptedEngine(["One, two, three."]) as engine:
        texts = [event.text async for event in engine.step(request)]
    assert texts[-1] == "One, two"


@pytest.mark.anyio
async def test_a_step_a_double_refuses_never_reaches_it_and_the_next_one_does() -> None:
    refused_request = _request(Sampling(max_tokens=8, options=SamplingOptions(logprobs=1)), prompt=10)
    async with HonestPairEngine() as pair:
        pair.inject("decline")
        with pytest.raises(UserError, match="^logprobs: "):
            async for _ in pair.step(refused_request):
                pass
        assert pair.steps == []
        events = [event async for event in pair.step(_request(Sampling(max_tokens=8), prompt=10))]
    assert events and pair.steps[0].faults == ["decline"] and pair.steps[0].outcome == "done"
