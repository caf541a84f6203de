"""A step's `Sampling` as vLLM takes it, P's first token as the answer's, and vLLM's logprobs as `TokenLogprob`s.

`vllm_sampling` maps every field of `Sampling` (and its `SamplingOptions`) to vLLM ``SamplingParams``;
a value vLLM refuses becomes a `UserError` that names the field (`refused`). A pair's P samples its one
token with the step's options (`prefill_sampling`) so that, when that token is the answer's first
(`first_token_of_prefill`), it is the token one engine would sample; D then samples the rest
(`continued_sampling`). vLLM is imported only inside the functions that build its objects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import UserError
from ._base import StepRequest, TokenDelta
from ._sampling import Sampling, SamplingOptions, TokenLogprob

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams

__all__ = [
    "LOGPROB_FLOOR",
    "check_sampling",
    "continued_sampling",
    "could_stop",
    "first_token_of_prefill",
    "prefill_sampling",
    "refused",
    "top_alternatives",
    "vllm_logprobs",
    "vllm_sampling",
]

LOGPROB_FLOOR = -9999.0
"""The least log probability reported (vLLM's OpenAI server reports ``-inf`` as this)."""

_FIELDS = ("max_tokens", "temperature", "seed", "stop", *SamplingOptions.model_fields)
_STRUCTURED_WORDS = ("structured", "grammar", "json", "regex", "choice", "schema")


def refused(exc: BaseException) -> UserError:
    """A `UserError` for a value vLLM refused (``VLLMValidationError`` and kin), led by the field's name."""
    message = str(exc.args[0]) if exc.args else str(exc)
    field = getattr(exc, "parameter", None)
    if field is None:  # the field the message names first ("min_tokens must be at most max_tokens=...")
        named = [(at, name) for name in _FIELDS if (at := message.find(name)) >= 0]
        field = min(named)[1] if named else None
    if field is None and any(word in message.lower() for word in _STRUCTURED_WORDS):
        field = "structured_outputs"
    return UserError(f"{field or 'sampling'}: {message}")


def check_sampling(sampling: Sampling) -> None:
    """Refuse what vLLM refuses of a step's sampling without its model (`UserError` naming the field), for
    engines that send it where a refusal would come after some engine work (an HTTP pair's D)."""
    if sampling.max_tokens < 1:
        raise UserError(f"max_tokens: must be at least 1, got {sampling.max_tokens}")
    if sampling.options.min_tokens > sampling.max_tokens:
        raise UserError(
            f"min_tokens: must be at most max_tokens={sampling.max_tokens}, got {sampling.options.min_tokens}"
        )
    if not 0.0 <= sampling.temperature <= 2.0:
        raise UserError(f"temperature: must be in [0, 2], got {sampling.temperature}")
    if any(not stop for stop in sampling.stop):
        raise UserError("stop: cannot contain an empty string")


_AS_GIVEN = (
    *("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"),
    *("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"),
    "logprobs",
)
"""The `SamplingOptions` fields that vLLM's ``SamplingParams`` takes as they are."""


def vllm_sampling(sampling: Sampling, *, kv_transfer_params: dict[str, Any] | None, stream: bool) -> SamplingParams:
    """vLLM ``SamplingParams`` for a step: every field of ``sampling`` and its options (``max_tokens`` as given:
    P is given `prefill_sampling`). A value vLLM's own checks refuse raises `UserError` (`refused`)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMError
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    options = sampling.options
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    try:
        structured = StructuredOutputsParams(**sampling.structured) if sampling.structured is not None else None
    except (TypeError, ValueError, VLLMError) as exc:
        raise UserError(f"structured_outputs: {exc}") from exc
    try:
        return SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            **{name: getattr(options, name) for name in _AS_GIVEN},
            logit_bias=dict(options.logit_bias) if options.logit_bias is not None else None,
            stop_token_ids=list(options.stop_token_ids) or None,
            bad_words=list(options.bad_words) or None,
            allowed_token_ids=list(options.allowed_token_ids) if options.allowed_token_ids is not None else None,
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            extra_args=extra,
        )
    except (ValueError, VLLMError) as exc:
        raise refused(exc) from exc


def prefill_sampling(sampling: Sampling) -> Sampling:
    """P's one token: the step's options, ``min_tokens`` capped at 1 (vLLM wants it at most ``max_tokens``),
    without stop strings (`could_stop`) and without the output's constraint (P's token is then never the
    answer's first: `Sampling.continues_after_first_token`)."""
    options = sampling.options.model_copy(
        update={"min_tokens": min(1, sampling.options.min_tokens), "structured_outputs": None}
    )
    return dataclasses.replace(sampling, max_tokens=1, json_schema=None, stop=(), options=options)


def continued_sampling(sampling: Sampling) -> Sampling:
    """D's sampling after P's token, the answer's first: one token fewer, and one fewer it must make."""
    options = sampling.options.model_copy(update={"min_tokens": max(0, sampling.options.min_tokens - 1)})
    return dataclasses.replace(sampling, max_tokens=sampling.max_tokens - 1, options=options)


def top_alternatives(candidates: Iterable[tuple[int, float]], count: int) -> tuple[tuple[int, float], ...]:
    """The ``count`` likeliest of (token id, log probability) pairs, likeliest first (ties in given order)."""
    ranked = sorted(candidates, key=lambda candidate: -candidate[1])
    return tuple((token_id, max(logprob, LOGPROB_FLOOR)) for token_id, logprob in ranked[:count])


def vllm_logprobs(token_ids: Sequence[int], positions: Any, count: int) -> list[TokenLogprob]:
    """`TokenLogprob`s of vLLM's sample logprobs (one dict per token: token id -> ``Logprob``, the chosen token
    among them), with the ``count`` alternatives vLLM ranked first, as its OpenAI server reports them."""
    found: list[TokenLogprob] = []
    for token_id, position in zip(token_ids, positions or (), strict=False):
        ranked = sorted(
            (entry for entry in position.items() if entry[1].rank is not None and entry[1].rank <= count),
            key=lambda entry: entry[1].rank,
        )
        found.append(
            TokenLogprob(
                token_id=int(token_id),
                logprob=max(float(position[token_id].logprob), LOGPROB_FLOOR),
                top=top_alternatives(((int(t), float(lp.logprob)) for t, lp in ranked), count),
            )
        )
    return found


def first_token_of_prefill(request: StepRequest, p_out: RequestOutput, block_size: int) -> TokenDelta | None:
    """P's sampled token as the answer's first token, when it can serve as one.

    P samples one token with the step's options (`prefill_sampling`); vLLM would discard it and D
    sample the first token again, after its pull and a forward pass. Streamed at once, it takes D's
    pull and first forward pass off the time to first token; D then starts from the prompt plus that
    token (`continued_sampling`). Used only when D, so started, samples the rest as one engine would
    (`Sampling.continues_after_first_token`: no grammar, no penalty on earlier output, no seeded draws).
    Not when the token ended the answer (EOS unless ``ignore_eos``, a stop token id: D must still run to
    pin the KV), nor when its text is incomplete (a partial UTF-8 character that only the next tokens
    complete) or empty. Nor when a stop string could end within or start in its text (P runs without the
    stop strings, and D looks for them in its own output only, whether or not it keeps them in the text:
    `could_stop`). Nor when the prompt fills its last block: D pulls P's blocks and recomputes the last
    token of its prompt, which must then lie in a block P sent (vLLM 0.32 fails a pull that P's blocks
    do not cover).
    """
    sampling = request.sampling
    completion = p_out.outputs[0]
    text = completion.text
    if not sampling.continues_after_first_token() or sampling.max_tokens < 2:
        return None
    if len(request.prompt_token_ids) % block_size == 0:
        return None
    if len(completion.token_ids) != 1 or completion.finish_reason != "length" or not text or "\ufffd" in text:
        return None
    if completion.token_ids[0] in sampling.options.stop_token_ids or could_stop(text, sampling.stop):
        return None
    count = sampling.options.logprobs
    logprobs = vllm_logprobs(completion.token_ids, completion.logprobs, count) if count is not None else None
    return TokenDelta(token_ids=list(completion.token_ids), text=text, logprobs=logprobs)


def could_stop(text: str, stop: Sequence[str]) -> bool:
    """Whether a stop string occurs in ``text`` or could begin in it and end in text that follows.

    D, continuing after P's token, searches only its own output for the stop strings: P's token is
    the answer's first only when no stop string can involve its text.
    """
    return any(s in text or any(s.startswith(text[i:]) for i in range(len(text))) for s in stop)
