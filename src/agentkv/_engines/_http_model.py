"""The model an HTTP pair's servers serve, and the model folder the pair tokenizes with.

A pair of servers tokenizes nothing: the session sends token ids, so it must tokenize with the model the servers
run, or every step sends the wrong ids and gets wrong answers, silently. Each server says what it serves in
``GET /v1/models``: the name requests must use (``id``: vLLM's ``--served-model-name``, default its ``--model``)
and what it loaded (``root``: its ``--model``, an HF id or a folder on the server's host). What a server *claims*
to serve (`ServedModel.claim`) is its served name when that names a model (a bundled name, an HF id ``org/name``,
a folder path), else what it loaded (agentkv's own servers serve under the name ``agentkv``).

At open (`resolve_served_model`): P and D must claim the same model; a model the caller named must be that model
(compared by `agentkv._model.model_identity`: an HF id without its revision, case-insensitive; a hub snapshot
folder as its id; a bundled model's prepared folder as its name; a local folder also by its own name); without a
named model the pair uses the servers', prepared as ``--model`` is (`agentkv._model.prepare_model`: a bundled
name, an HF id from the HF cache, or the folder itself when this host has it). Anything else is refused by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import ModelPreparationError, UserError
from .._model import is_model_reference, model_identity, prepare_model_off_loop
from ._platforms import Role

__all__ = ["ServedModel", "resolve_served_model"]


@dataclass(frozen=True)
class ServedModel:
    """What one server says it serves (``GET /v1/models``' first model)."""

    name: str
    """The id requests name (``--served-model-name``)."""
    root: str | None = None
    """What vLLM loaded (its ``--model``): an HF id, or a folder on the server's host."""

    @classmethod
    def of(cls, card: Any) -> ServedModel:
        """From the ``openai`` client's model object."""
        root = (getattr(card, "model_extra", None) or {}).get("root")
        return cls(name=str(card.id), root=root if isinstance(root, str) and root else None)

    @property
    def claim(self) -> str:
        """The model the server says it serves: its served name when that names a model, else what it loaded."""
        if is_model_reference(self.name) or self.root is None:
            return self.name
        return self.root

    def words(self) -> str:
        """``'Qwen/Qwen3-0.6B' (loaded from /models/q)``, ``'/models/q' (served as 'agentkv')``, or the name alone."""
        if self.root is None or self.root == self.name:
            return repr(self.name)
        if self.claim == self.name:
            return f"{self.name!r} (loaded from {self.root})"
        return f"{self.root!r} (served as {self.name!r})"


async def resolve_served_model(
    served: dict[Role, ServedModel], named: str | os.PathLike[str] | None, urls: tuple[str, str]
) -> Path:
    """The folder a pair on servers that serve ``served`` tokenizes with (``named``: the model the caller named,
    or None for the servers' own). `UserError` names the disagreement: P and D, or the caller and the servers."""
    p, d = served["prefill"], served["decode"]
    if model_identity(p.claim) != model_identity(d.claim):
        raise UserError(
            f"the prefill server at {urls[0]} serves {p.words()} and the decode server at {urls[1]} serves "
            f"{d.words()}: a pair's servers must serve one model"
        )
    if p.name != d.name:
        raise UserError(
            f"the prefill server at {urls[0]} serves its model as {p.name!r} and the decode server at {urls[1]} as "
            f"{d.name!r}: a pair's requests name one model, so start both with the same --served-model-name"
        )
    if named is not None:
        if not _agree(named, d):
            raise UserError(
                f"the model named, {str(named)!r}, is not the one the servers serve: {d.words()} (the decode server "
                f"at {urls[1]}). The session tokenizes with the named model, and the servers would get another "
                "model's token ids: name the servers' model (or leave it out to use theirs)"
            )
        return await prepare_model_off_loop(named)
    return await _prepare_claim(d, urls[1])


def _agree(named: str | os.PathLike[str], served: ServedModel) -> bool:
    """Whether the model the caller named is the one ``served`` claims: the same identity, or a local folder named
    as the served model is (``/data/Qwen3-0.6B`` for ``Qwen/Qwen3-0.6B``)."""
    identity = model_identity(named)
    if identity == model_identity(served.claim):
        return True
    folder = Path(named).expanduser()
    return folder.is_dir() and folder.name.lower() == served.claim.rstrip("/").rpartition("/")[2].lower()


def _preparable(served: ServedModel, url: str) -> str:
    """What `prepare_model` takes for the servers' model: their claim, or for a folder this host lacks, the id or
    bundled name it is a folder of (a hub snapshot's, a bundled model's); any other such folder is refused."""
    claim = served.claim
    folder = Path(claim).expanduser()
    if not folder.is_absolute() or (folder / "config.json").is_file():
        return claim
    identity = model_identity(claim)
    if identity == model_identity(str(folder)):
        raise UserError(
            f"the servers serve {served.words()}, a folder this host does not have: name the model the pair "
            f"tokenizes with (model= / --model: the same folder here, or its HF id); the decode server is {url}"
        )
    return identity


async def _prepare_claim(served: ServedModel, url: str) -> Path:
    """The servers' model prepared as ``--model`` prepares one (`_preparable`)."""
    claim = _preparable(served, url)
    try:
        return await prepare_model_off_loop(claim)
    except ModelPreparationError as exc:
        raise ModelPreparationError(
            f"the servers serve {served.words()} (the decode server at {url}), which the pair must tokenize with: {exc}"
        ) from exc
