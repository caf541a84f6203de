"""A tokenizer folder read without transformers: the test doubles' model (src/agentkv/_doubles/test_model/).

Importing transformers takes seconds (it imports torch), longer than a whole test of agent code on the doubles.
A folder that carries `MARKER` holds a ``tokenizer.json`` and a Jinja chat template that `LightTokenizer` reads
with the libraries under transformers' own fast tokenizer: ``tokenizers`` (the same Rust tokenizer) and ``jinja2``
(the same sandboxed environment, ``trim_blocks`` and ``lstrip_blocks``, as transformers renders templates in).
What agentkv's session and doubles call is here; anything else (vLLM's parsers read the vocabulary through
transformers' API) comes from transformers' tokenizer of the same folder, loaded the first time it is asked for.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = ["MARKER", "LightTokenizer", "is_light"]

MARKER = "agentkv-light-tokenizer.json"
"""The file that says a folder's tokenizer is read by `LightTokenizer`."""


def is_light(folder: str | Path) -> bool:
    """Whether ``folder``'s tokenizer is read by `LightTokenizer`."""
    return (Path(folder) / MARKER).is_file()


class LightTokenizer:
    """The subset of a Hugging Face fast tokenizer that sessions use, from ``tokenizers`` and ``jinja2`` alone."""

    def __init__(self, folder: str | Path) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        self._folder = Path(folder)
        self._tokenizer = Tokenizer.from_file(str(self._folder / "tokenizer.json"))
        self._lock = threading.Lock()
        """Guards ``encode_special_tokens``, the Rust tokenizer's switch that ``split_special_tokens`` sets."""
        config = json.loads((self._folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.eos_token: str = config["eos_token"]
        self.eos_token_id: int = self._id(self.eos_token)
        named = (config.get(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token"))
        self.all_special_tokens: list[str] = list(dict.fromkeys(token for token in named if token))
        """The tokens the folder's config names (as transformers lists them; other added tokens are not among them)."""
        self.all_special_ids: list[int] = [self._id(token) for token in self.all_special_tokens]
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        template = (self._folder / "chat_template.jinja").read_text(encoding="utf-8")
        self.chat_template: str = template
        """The chat template's source (as transformers' tokenizer has it)."""
        self._template = environment.from_string(template)

    def _id(self, token: str) -> int:
        found = self._tokenizer.token_to_id(token)
        if found is None:
            raise ValueError(f"{self._folder}: the tokenizer has no token {token!r}")
        return int(found)

    def encode(self, text: str, *, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (no BOS: the folder's tokenizer adds none); with ``split_special_tokens``, control
        token text is plain text."""
        with self._lock:
            self._tokenizer.encode_special_tokens = split_special_tokens
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def get_vocab(self) -> dict[str, int]:
        """The vocabulary, token text -> id, added tokens included (as transformers' ``get_vocab``)."""
        return dict(self._tokenizer.get_vocab(with_added_tokens=True))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token text, as the vocabulary writes it (as transformers' ``convert_ids_to_tokens``)."""
        return [str(self._tokenizer.id_to_token(int(token))) for token in token_ids]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **context: Any,
    ) -> str | list[int]:
        """The template's rendering of ``conversation`` (its token ids with ``tokenize``); a template that refuses
        the messages raises jinja2's ``TemplateError``, as transformers' ``apply_chat_template`` does."""
        text = self._template.render(
            messages=list(conversation), tools=tools, add_generation_prompt=add_generation_prompt, **context
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @cached_property
    def _full(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self._folder))

    def __getattr__(self, name: str) -> Any:
        """What this class does not implement, from transformers' tokenizer of the folder (loaded once)."""
        if name.startswith("__") or name in ("_full", "_tokenizer", "_template", "_folder", "_lock"):
            raise AttributeError(name)
        return getattr(self._full, name)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **options: Any) -> str:
    """transformers' ``tojson`` filter: JSON as it writes it in templates (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **options)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
