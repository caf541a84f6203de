"""A step's rendering and tokenizing, bounded before it starts and kept off the event loop when it is large.

A session renders its new messages with the chat template and tokenizes them before each step: microseconds for
a turn's few messages, seconds for a prompt of megabytes (one of 3.9 MB stalled every conversation of a door's
pool for 8 s, refused in the end as too long). So, before any of it:

* **a prompt that cannot fit is refused by its size** (`check_fits`): no token is longer than the tokenizer's
  longest (`longest_token`, in characters), so messages of ``C`` characters make at least ``C / longest``
  tokens; when that, with the tokens the conversation holds already, reaches the context, the step is a
  `ContextLengthError` at once, nothing tokenized;
* **large work leaves the event loop** (`off_loop`): rendering ``OFF_LOOP_CHARS`` characters or more runs in a
  worker thread (vLLM tokenizes off its loop too); smaller work stays on the loop, where a thread's round trip
  would cost more than the work.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .._conversation._conversation import Message
from .._errors import ContextLengthError

__all__ = ["OFF_LOOP_CHARS", "check_fits", "longest_token", "off_loop"]

OFF_LOOP_CHARS = 32 * 1024
"""Rendering and tokenizing messages of this many characters or more runs in a worker thread."""


def text_chars(messages: Sequence[Message]) -> int:
    """The characters of the messages' contents (a lower bound of what the template renders of them)."""
    return sum(len(message.content) for message in messages)


@functools.lru_cache(maxsize=8)
def longest_token(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer``'s vocabulary stands for (at least 1): its longest entry,
    measured in UTF-8 bytes, which is at least its characters (a byte-level vocabulary writes a byte as one
    character of two bytes)."""
    vocabulary = tokenizer.get_vocab()
    return max((len(str(token).encode()) for token in vocabulary), default=1) or 1


def check_fits(tokenizer: Any, *, held_tokens: int, messages: Sequence[Message], max_model_len: int) -> None:
    """Refuse (`ContextLengthError`) messages that make the prompt reach ``max_model_len`` tokens whatever they
    tokenize to: ``held_tokens`` already, and at least a token per `longest_token` characters of theirs."""
    chars = text_chars(messages)
    at_least = held_tokens + chars // longest_token(tokenizer)
    if at_least >= max_model_len:
        raise ContextLengthError(
            f"the prompt has at least {at_least} tokens (its messages hold {chars} characters, at most "
            f"{longest_token(tokenizer)} per token); the model's context is {max_model_len}",
            prompt_tokens=at_least,
            max_model_len=max_model_len,
        )


def off_loop(messages: Sequence[Message]) -> bool:
    """Whether rendering ``messages`` is large enough to run in a worker thread."""
    return text_chars(messages) >= OFF_LOOP_CHARS
