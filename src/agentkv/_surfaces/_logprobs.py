"""A step's `TokenLogprob`s written as OpenAI's ``logprobs.content`` entries, token strings as vLLM's server writes them.

vLLM's chat server writes each token as its ``Logprob.decoded_token``, which vLLM's output processor makes with
``convert_ids_list_to_tokens`` (the token's own decoding, SentencePiece's leading space restored) and then
corrects, for a byte-fallback token that ends in half a character, from the sampled tokens before it
(``LogprobsProcessor._verify_tokens``). `LogprobWriter` calls those same functions of the installed vLLM on the
pool's tokenizer. An entry lists the sampled token first, then the likeliest, as vLLM's ``top_logprobs`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from .._engines._sampling import TokenLogprob
from .._session._pool import SessionPool
from .._session._results import StepReply, TextPiece
from .._session._session import load_tokenizer

__all__ = ["LogprobWriter", "logprob_writer"]

_CONTEXT = 4
"""Sampled tokens before a position that vLLM reads to correct a token's text (enough for any UTF-8 character)."""

_FLOOR = -9999.0
"""vLLM's floor for a reported log probability (JSON has no -inf)."""


class LogprobWriter:
    """Writes one step's log probabilities in order (a stream's pieces, then the rest), ``top`` alternatives each."""

    def __init__(self, tokenizer: Any, top: int, *, as_token_ids: bool = False) -> None:
        from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
        from vllm.v1.engine.logprobs import LogprobsProcessor

        self._decode = convert_ids_list_to_tokens
        self._processor = LogprobsProcessor(
            tokenizer=tokenizer,
            logprobs=[],
            prompt_logprobs=None,
            cumulative_logprob=None,
            num_logprobs=top,
            num_prompt_logprobs=None,
        )
        self._tokenizer = tokenizer
        self._top = top
        self._as_token_ids = as_token_ids
        self._sampled: list[int] = []
        """The step's tokens written so far."""

    def content(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """The next tokens' entries: ``{"token", "logprob", "bytes", "top_logprobs": [...]}`` each."""
        return [self._entry(position) for position in logprobs]

    def piece(self, item: str) -> list[dict[str, Any]] | None:
        """The entries of a streamed text piece's tokens (None for a piece that carries none)."""
        return self.content(item.logprobs) if isinstance(item, TextPiece) else None

    def rest(self, reply: StepReply) -> list[dict[str, Any]]:
        """The entries of the reply's tokens not written yet (all of them when nothing was streamed)."""
        return self.content((reply.step.logprobs or [])[len(self._sampled) :])

    def _entry(self, position: TokenLogprob) -> dict[str, Any]:
        ranked = {position.token_id: position.logprob}  # the sampled token first, then the likeliest, as vLLM
        for token_id, logprob in position.top:
            ranked.setdefault(token_id, logprob)
        ids = list(ranked)
        decoded = self._processor._verify_tokens(
            self._decode(self._tokenizer, ids), ids, context_token_ids=self._sampled[-_CONTEXT:]
        )
        self._sampled.append(position.token_id)
        tokens = [f"token_id:{i}" for i in ids] if self._as_token_ids else decoded
        top = [
            {"token": token, "logprob": max(logprob, _FLOOR), "bytes": _bytes(token)}
            for token, logprob in zip(tokens[: self._top], list(ranked.values())[: self._top], strict=True)
        ]
        return {
            "token": tokens[0],
            "logprob": max(position.logprob, _FLOOR),
            "bytes": _bytes(decoded[0]),  # vLLM: the decoded token's bytes, token ids or not
            "top_logprobs": top,
        }


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


async def logprob_writer(pool: SessionPool, top: int | None, *, as_token_ids: bool | None) -> LogprobWriter | None:
    """A writer for a request that asks for ``top`` alternatives (None: it asks for no logprobs), on the pool's
    tokenizer (loaded, and vLLM's functions imported, off the event loop)."""
    if top is None:
        return None
    model_path = str(pool.engine.info.model_path)

    def make() -> LogprobWriter:
        return LogprobWriter(load_tokenizer(model_path), top, as_token_ids=bool(as_token_ids))

    return await anyio.to_thread.run_sync(make)
