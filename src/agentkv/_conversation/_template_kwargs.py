"""A request's ``chat_template_kwargs``: extra arguments of the model's chat template (``enable_thinking`` switches a
hybrid reasoning model's thinking), honoured as vLLM's server honours them (vllm/renderers/hf.py,
``resolve_chat_template_kwargs``):

* ``chat_template`` and ``tokenize`` are refused (vLLM: "Found unexpected chat template kwargs from request");
* the template gets only the arguments it reads (the variables its source leaves undeclared, found with jinja2's
  ``meta.find_undeclared_variables``, as vLLM finds them); the others have no effect;
* what agentkv's rendering sets itself (the messages, ``tools``, ``add_generation_prompt``,
  ``continue_final_message``) is not taken from them, as vLLM's request fields win over them.

They are part of what a conversation's rendering depends on (`TranscriptKey.template_kwargs`): other arguments
re-render the conversation, and the rendered tokens alone decide whether D's pinned KV is still its prefix
(DESIGN.md section 6), so arguments that change nothing the template writes keep the pin.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from .._errors import UserError

__all__ = ["OWN_ARGUMENTS", "template_arguments", "template_kwargs_key"]

_REFUSED = frozenset({"chat_template", "tokenize"})
OWN_ARGUMENTS = frozenset(
    {"messages", "conversation", "tools", "add_generation_prompt", "continue_final_message", "documents"}
)
"""What agentkv's rendering passes the template itself: never taken from a request's arguments."""


def template_kwargs_key(kwargs: Mapping[str, Any] | None) -> str | None:
    """``kwargs`` checked and written canonically (sorted keys): the rendering's key; None or empty: None."""
    if not kwargs:
        return None
    if not isinstance(kwargs, Mapping) or not all(isinstance(name, str) for name in kwargs):
        raise UserError("chat_template_kwargs: an object of the chat template's extra arguments")
    refused = sorted(_REFUSED & kwargs.keys())
    if refused:
        raise UserError(f"chat_template_kwargs: Found unexpected chat template kwargs from request: {set(refused)}")
    kept = {name: value for name, value in kwargs.items() if name not in OWN_ARGUMENTS}
    if not kept:
        return None
    try:
        return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        raise UserError("chat_template_kwargs: JSON values only") from None


def template_arguments(tokenizer: Any, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Of ``kwargs``, those the tokenizer's chat template reads (agentkv's own excepted)."""
    if not kwargs:
        return {}
    read = _template_variables(str(getattr(tokenizer, "chat_template", None) or ""))
    own = OWN_ARGUMENTS | _REFUSED
    return {name: value for name, value in kwargs.items() if ("*" in read or name in read) and name not in own}


@functools.lru_cache(maxsize=8)
def _template_variables(source: str) -> frozenset[str]:
    """The variables a chat template's source reads and does not set itself."""
    from jinja2 import meta
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    try:
        return frozenset(meta.find_undeclared_variables(environment.parse(source)))
    except Exception:  # a template jinja2 cannot parse here (a tag of its own): every argument goes to it
        return frozenset({"*"})
