"""Refuse, before any engine starts, a workload whose last turn cannot fit the context.

A turn's prompt is the whole conversation so far: the system prompt, every user message up to
it, and every earlier answer. Its size is known before the run but for the answers, each at
most the workload's ``max_tokens``. A run whose last turn overflows the context would start
its engines (minutes with compiled models), play the turns that fit, and stop with a
`ContextLengthError` at the first that does not; `check_fits` says so at once, with the turns
that fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._conversation._conversation import ChatRenderer, Message
from .._errors import UserError
from ._workloads import Workload

__all__ = ["check_fits", "prompt_bounds"]


def prompt_bounds(workload: Workload, tokenizer: Any) -> list[int]:
    """The most prompt tokens each turn of ``workload`` can send: its conversation rendered with empty answers,
    plus ``max_tokens`` for each earlier answer (the model may stop sooner, never later)."""
    system = Message(role="system", content=workload.system)
    renderer = ChatRenderer(tokenizer, system=system)
    bounds = []
    messages = [system]
    for index, text in enumerate(workload.turns):
        messages.append(Message(role="user", content=text))
        bounds.append(len(renderer.initial(messages)) + index * workload.max_tokens)
        messages.append(Message(role="assistant", content=""))
    return bounds


def check_fits(workload: Workload, tokenizer: Any, *, max_model_len: int) -> None:
    """Raise `UserError` when the last turn of ``workload`` may send ``max_model_len`` prompt tokens or more
    (`prompt_bounds`), the prompts a session refuses with `ContextLengthError` (it shortens an answer to the room
    left), naming the turns that do fit."""
    bounds = prompt_bounds(workload, tokenizer)
    if bounds[-1] < max_model_len:
        return
    fitting = _turns_that_fit(bounds, max_model_len)
    raise UserError(
        f"the {workload.name} workload's turn {len(bounds)} may send {bounds[-1]} prompt tokens (its conversation "
        f"and {len(bounds) - 1} answers of up to {workload.max_tokens}); the context is {max_model_len}: "
        f"run {fitting} turns or fewer, or a longer context (--max-model-len)"
    )


def _turns_that_fit(bounds: Sequence[int], max_model_len: int) -> int:
    return sum(1 for bound in bounds if bound < max_model_len)
