"""The compatibility tier (``make compat``): agentkv against each newer vLLM's CUDA wheel, on a machine without a GPU.

For each vLLM version given (default: `VERSIONS`), this builds a scratch environment outside the checkout
(``$AGENTKV_COMPAT_DIR``, default ``/tmp/agentkv-compat``: ``venv-<version>``, kept and reused while it holds that
vLLM) with that vLLM, NIXL (``nixl>=1.5``), the torch the wheel pins, agentkv from this checkout (editable, no
dependencies) and pytest, then runs, against vLLM's real code and no engine:

* the plugin load (``tests/test_plugin_imports.py``, and the plugin loaded as an engine process loads it);
* every feature probe (the push connector's runs its behaviour: D's release of a pin P has read);
* the CUDA mapping tests (``tests/test_platforms.py``: a CUDA platform value, the GPUs of each engine, vLLM's own
  argument parser);
* the connector's unit tests (``tests/test_vllm_patches.py``, push release included);
* the KV handle as vLLM's scheduler makes it and vLLM's server streams it (``tests/test_vllm_compat.py``).

That is every test marked ``compat`` (``pytest -m compat`` over `TEST_FILES`). A feature of vLLM's CPU build
only (elastic cores) that is off on a CUDA wheel is reported, not failed. It prints the versions, each probe's result and the
test counts per vLLM, writes them to ``<dir>/compat-<version>.json``, and exits 1 when a test failed.

Downloads: vLLM's CUDA wheel pins a CUDA build of torch (several GB with its NVIDIA libraries); the wheels are kept
in ``<dir>/wheels`` and each is downloaded once. Machines whose pip is capped below that torch (these machines'
``/etc/xdg/pip`` caps it at 2.14.1) need the cap lifted first (``rm -r /etc/xdg/pip``): say so on CI and nightly
machines too. A pin the index does not carry (vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, which PyPI lacks) is
left out, and the report names it: such packages hold GPU kernels, which nothing here imports.

Usage: ``python scripts/compat.py [VERSION ...]`` (``--keep`` leaves nothing out of an existing environment;
``--fresh`` rebuilds it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("0.33.0", "0.34.0")
"""The vLLM releases after the tested CPU series (0.32) whose CUDA wheels the tier checks."""
EXTRAS = ("nixl>=1.5", "pytest>=8", "pytest-timeout>=2.3")
TEST_FILES = (
    "tests/test_plugin_imports.py",
    "tests/test_vllm_patches.py",
    "tests/test_platforms.py",
    "tests/test_handle.py",
    "tests/test_vllm_compat.py",
    "tests/test_http_versions.py",
)
"""The files that hold the tests marked ``compat`` (the others need packages the scratch environment lacks)."""
CPU_ONLY = ("elastic cores",)
"""Features of vLLM's CPU build only (a CPU pair's cores): off on a CUDA wheel is reported, not a failure."""
_UNAVAILABLE = re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+)==")


def _run(command: list[str], **options: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, text=True, **options)  # type: ignore[call-overload, no-any-return]


def _agentkv_requirements() -> list[str]:
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def _installed_vllm(python: Path) -> str | None:
    found = _run(
        [str(python), "-c", "from importlib.metadata import version; print(version('vllm'))"], capture_output=True
    )
    return found.stdout.strip() if found.returncode == 0 else None


def _wheel_requirements(wheels: Path, version: str) -> list[str]:
    """vLLM's own requirements (its wheel's ``Requires-Dist``, without the optional extras')."""
    [wheel] = wheels.glob(f"vllm-{version}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        lines = archive.read(name).decode().splitlines()
    return [line.split(": ", 1)[1] for line in lines if line.startswith("Requires-Dist: ") and "extra ==" not in line]


def build(version: str, folder: Path, *, fresh: bool) -> tuple[Path, list[str]]:
    """The scratch environment of vLLM ``version`` (made or reused), and the pins left out of it."""
    venv = folder / f"venv-{version}"
    python = venv / "bin" / "python"
    left_out_file = venv / "agentkv-left-out.json"
    if fresh and venv.exists():
        shutil.rmtree(venv)
    if python.exists() and _installed_vllm(python) == version:
        print(f"compat: reusing {venv} (vLLM {version})", flush=True)
    else:
        if venv.exists():
            shutil.rmtree(venv)
        _run([sys.executable, "-m", "venv", str(venv)], check=True)
        wheels = folder / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--find-links", str(wheels)]
        _run([str(python), "-m", "pip", "download", "--no-deps", "-d", str(wheels), f"vllm=={version}"], check=True)
        left_out: list[str] = []
        requirements = [f"vllm=={version}", *EXTRAS, *_agentkv_requirements()]
        while True:
            done = _run([*pip, *requirements], capture_output=True)
            sys.stdout.write(done.stdout[-2000:])
            if done.returncode == 0:
                break
            missing = _UNAVAILABLE.search(done.stderr)
            if missing is None or missing.group(1).lower() in [r.lower() for r in left_out]:
                sys.stderr.write(done.stderr[-4000:])
                raise SystemExit(f"compat: installing vLLM {version} failed")
            name = missing.group(1).lower()
            print(f"compat: the index has no {missing.group(0).split('for ')[1]}: left out", flush=True)
            left_out.append(name)
            if requirements[0] == f"vllm=={version}":  # vLLM itself without its requirements, then the rest
                _run([*pip, "--no-deps", f"vllm=={version}"], check=True)
                requirements = [*_wheel_requirements(wheels, version), *EXTRAS, *_agentkv_requirements()]
            requirements = [r for r in requirements if not r.lower().startswith(name)]
        _run([*pip, "--no-deps", "-e", str(ROOT)], check=True)
        left_out_file.write_text(json.dumps(left_out))
    return python, json.loads(left_out_file.read_text()) if left_out_file.exists() else []


_REPORT = """
import json
from importlib.metadata import version
from _agentkv_vllm._patches import FEATURES, probe
found = {"versions": {name: version(name) for name in ("vllm", "torch", "nixl", "transformers")}}
found["probes"] = {feature: probe(feature) for feature in FEATURES}
print("COMPAT " + json.dumps(found))
"""


def check(version: str, python: Path, left_out: list[str], folder: Path) -> bool:
    """Run the probes and the ``compat`` tests in ``python``'s environment; print and save what they found."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "VLLM_LOGGING_LEVEL": "ERROR"}
    started = time.monotonic()
    probed = _run([str(python), "-c", _REPORT], capture_output=True, env=env, cwd=ROOT)
    lines = [line for line in probed.stdout.splitlines() if line.startswith("COMPAT ")]
    found = json.loads(lines[-1].removeprefix("COMPAT ")) if lines else {"error": probed.stderr[-3000:]}
    tests = _run(
        [
            str(python),
            "-m",
            "pytest",
            "-m",
            "compat",
            "-q",
            "-rfEx",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            *TEST_FILES,
        ],
        capture_output=True,
        env=env,
        cwd=ROOT,
    )
    summary = [line for line in tests.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    found |= {
        "left_out": left_out,
        "tests": summary[-1].strip("= ") if summary else "no summary",
        "failed": [line for line in tests.stdout.splitlines() if line.startswith("FAILED")],
        "seconds": round(time.monotonic() - started),
    }
    (folder / f"compat-{version}.json").write_text(json.dumps(found, indent=2))
    print(f"\n== vLLM {version}: {json.dumps(found.get('versions'))}")
    for feature, problem in (found.get("probes") or {}).items():
        off = "off, a feature of vLLM's CPU build only" if feature in CPU_ONLY else "OFF"
        print(f"   probe {feature}: {f'{off}: {problem}' if problem else 'ok'}")
    if left_out:
        print(f"   left out (not on the index): {', '.join(left_out)}")
    print(f"   tests (-m compat): {found['tests']}")
    for line in found["failed"]:
        print(f"   {line}")
    probes = found.get("probes") or {}
    ok = tests.returncode == 0 and "error" not in found and not any(probes[f] for f in probes if f not in CPU_ONLY)
    if not ok:
        sys.stdout.write(tests.stdout[-6000:])
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=list(VERSIONS))
    parser.add_argument("--fresh", action="store_true", help="rebuild each environment from scratch")
    args = parser.parse_args()
    folder = Path(os.environ.get("AGENTKV_COMPAT_DIR", "/tmp/agentkv-compat"))
    folder.mkdir(parents=True, exist_ok=True)
    results = {}
    for version in args.versions:
        python, left_out = build(version, folder, fresh=args.fresh)
        results[version] = check(version, python, left_out, folder)
    print("\ncompat: " + ", ".join(f"vLLM {v} {'passed' if ok else 'FAILED'}" for v, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
