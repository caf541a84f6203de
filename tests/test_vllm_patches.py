"""agentkv's patches of vLLM and NIXL internals (``src/_agentkv_vllm/_patches.py``): every feature probes every
target it replaces or relies on, a target that moved turns its feature off (one warning, nothing replaced, the rest
applied), an untested vLLM is warned of and not refused, and the environment switches the idle-loop patches on.

No engine starts here: the fresh interpreters import vLLM and call the plugin as an engine process would. That the
patched pair really sleeps is checked on the real pair (test_pair.py); what loading the plugin imports, in
tests/test_plugin_imports.py; what agentkv does with a feature that is off, in tests/test_vllm_features.py.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

import _agentkv_vllm
from _agentkv_vllm import _patches
from _agentkv_vllm._patches import (
    AUTO_PLACEMENT,
    CLEAN_SHUTDOWN,
    ELASTIC_CORES,
    ENGINE_ENV,
    FEATURES,
    IDLE_SLEEP,
    NIXL_DELAY_ENV,
    OWN_GROUP,
    PARKED_POLL_ENV,
    PUSH_BACK,
    TESTED_VLLM,
    WARNED_ENV,
    _BindingsWithDelay,
    engine_env,
    engine_features,
    untested_vllm,
)
from agentkv._engines._vllm import check_vllm_version


def test_an_untested_vllm_is_warned_of_once_not_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(WARNED_ENV, "")
    caplog.set_level(logging.WARNING, logger="agentkv")
    for version in (f"{TESTED_VLLM}.0", f"{TESTED_VLLM}.3", f"{TESTED_VLLM}.0+cpu"):
        check_vllm_version(version)
        assert untested_vllm(version) is None
    check_vllm_version()  # the installed one (0.32.0 here)
    assert not caplog.records
    for version in ("0.33.0", "0.34.1+cu130"):  # checked by the compatibility tier (scripts/compat.py)
        assert untested_vllm(version) is None
    for version in ("0.31.2", "0.35.0", "1.0.0", "0.3.2"):
        message = untested_vllm(version) or ""
        assert f"tested on vLLM {TESTED_VLLM}.x" in message and f"vLLM {version} is installed" in message
    check_vllm_version("0.35.0")  # no EngineStartError: a warning, and each feature is probed
    check_vllm_version("0.35.0")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "vLLM 0.35.0 is installed" in warned[0], warned
    assert "vllm version" in os.environ[WARNED_ENV].split("|")  # an engine started now would not say it again


def test_the_environment_marks_agentkvs_engines_and_names_both_intervals() -> None:
    exit_s = {_patches.WORKER_EXIT_ENV: "30"}
    assert engine_env(None) == {ENGINE_ENV: "1", **exit_s}
    assert engine_env(50) == {ENGINE_ENV: "1", **exit_s, NIXL_DELAY_ENV: "50000", PARKED_POLL_ENV: "50"}
    assert engine_features(engine_env(None)) == [CLEAN_SHUTDOWN, AUTO_PLACEMENT, OWN_GROUP]
    assert engine_features({**engine_env(50), _patches.CORE_TABLE_ENV: "/t:0"}) == [
        CLEAN_SHUTDOWN,
        AUTO_PLACEMENT,
        OWN_GROUP,
        IDLE_SLEEP,
        ELASTIC_CORES,
    ]
    assert engine_features({}) == []  # not an engine agentkv started: nothing


def test_agents_get_the_delay_and_everything_else_is_nixls() -> None:
    made: list[tuple[str, Any]] = []

    class Config:
        pthrDelay = 0

    class Bindings:
        OTHER = "untouched"

        @staticmethod
        def nixlAgent(name: str, config: Any) -> str:  # noqa: N802
            made.append((name, config.pthrDelay))
            return "agent"

    bindings = _BindingsWithDelay(Bindings(), 20_000)
    assert bindings.nixlAgent("a", Config()) == "agent"
    assert made == [("a", 20_000)] and bindings.OTHER == "untouched"


@pytest.mark.compat
def test_vllm_loads_the_plugin() -> None:
    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "_agentkv_vllm._patches:install" in names


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=300
    )


def _engine_process_env(**more: str) -> dict[str, str]:
    """The environment of an engine agentkv starts (`engine_env`, with elastic cores), and nothing said yet."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("AGENTKV_")}
    return {**env, **engine_env(50), _patches.CORE_TABLE_ENV: "/nonexistent-core-table:0", **more}


def _last_json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_feature_probes_every_target_its_patch_replaces() -> None:
    """On the installed vLLM 0.32 every probe passes; every target the table says is replaced is, and nothing the
    table leaves out is (a walk over vLLM's and NIXL's modules for the plugin's functions): a new patch cannot
    skip its probe. Patched targets still pass their probes (the wrappers keep vLLM's parameters)."""
    script = """
        import inspect, json, pickle, sys, types
        from _agentkv_vllm import _patches as patches
        from vllm.v1.engine.core import EngineCoreProc

        def resolve(path):
            module, _, name = path.partition(":")
            found = __import__(module, fromlist=["_"])
            *owners, last = name.split(".")
            for part in owners:
                found = getattr(found, part)
            return inspect.getattr_static(found, last)

        problems = {name: patches.probe(name) for name in patches.FEATURES}
        replaced = sorted({t.path for f in patches.FEATURES.values() for t in f.targets if t.replaced})
        instance_patched = "vllm.v1.engine.output_processor:OutputProcessor.process_outputs"  # one AsyncLLM's own
        before = {path: resolve(path) for path in replaced}
        patches.install()
        patches.install()  # twice is harmless
        patches.add_server_readouts(extras_field="x", extras=dict, stat_logger=object, prefill_stats={})
        processor = types.SimpleNamespace(process_outputs=lambda outputs, *args: outputs)
        kept = patches.keep_prefill_stats(types.SimpleNamespace(output_processor=processor), {})

        def made_here(value):
            try:
                value = getattr(value, "__func__", value)
                module = getattr(value, "__module__", None) or type(value).__module__
                return isinstance(module, str) and module.split(".")[0] == "_agentkv_vllm"
            except Exception:
                return False

        found = set()
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] not in ("vllm", "nixl") or not isinstance(module, types.ModuleType):
                continue
            for attr, value in list(vars(module).items()):
                if made_here(value):
                    found.add(f"{name}:{attr}")
                if isinstance(value, type) and value.__module__ == name:
                    found |= {f"{name}:{value.__qualname__}.{a}" for a, v in list(vars(value).items()) if made_here(v)}
        print(json.dumps({
            "problems": problems,
            "unchanged": [path for path in replaced if path != instance_patched and resolve(path) is before[path]],
            "patched_unlisted": sorted(found - set(replaced)),
            "instance_patched": made_here(processor.process_outputs) and kept,
            "after": {name: patches.probe(name) for name in patches.FEATURES},
            "patched": patches.patched_features(),
            "agentkv": [name for name in sys.modules if name.split(".")[0] == "agentkv"],
            # a spawned engine core gets its target by name: the replaced one must be found under it
            "by_name": pickle.loads(pickle.dumps(EngineCoreProc.run_engine_core)) is patches.run_engine_core_in_own_group,
        }))
    """
    found = _last_json(_run(script, _engine_process_env()))
    assert found["problems"] == dict.fromkeys(FEATURES), found["problems"]
    assert found["unchanged"] == [], "the table says these are replaced; install left them as they were"
    assert found["patched_unlisted"] == [], "patched without a Target(..., replaced=True) in FEATURES"
    assert found["instance_patched"]
    assert found["after"] == dict.fromkeys(FEATURES), "a patched target must still pass its probe"
    assert found["patched"] == dict.fromkeys(found["patched"]) and len(found["patched"]) == len(FEATURES) - 1
    assert found["agentkv"] == []  # the plugin never imports agentkv
    assert found["by_name"]


@pytest.mark.compat
def test_the_push_connector_touches_only_what_its_feature_probes() -> None:
    """Every vLLM name `AgentKVPushConnector` imports, every attribute it reads of one, and every attribute of
    ``self`` it does not define itself (NIXL's private ``_reqs_in_batch``, ``_push_registration_deadlines``, ...)
    is a target of the feature it serves (push with push-back)."""
    module = Path(_agentkv_vllm.__file__).parent / "_push_connector.py"
    tree = ast.parse(module.read_text())
    targets = FEATURES[PUSH_BACK].targets
    paths = {t.path for t in targets}
    attrs = {(t.path, name) for t in targets for name in t.attrs}
    probed_attrs = {name for _, name in attrs}
    imported: dict[str, str] = {}  # name -> module, run-time imports only (not under TYPE_CHECKING)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            imported |= {alias.asname or alias.name: node.module or "" for alias in node.names}
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    missing: set[str] = set()
    for name, where in imported.items():
        if not any(path.startswith(f"{where}:{name}") for path in paths):
            missing.add(f"{where}:{name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.value, ast.Name):
            continue
        owner, attr = node.value.id, node.attr
        if owner == "self" and attr not in own and attr not in probed_attrs:
            missing.add(f"self.{attr}")
        elif owner in imported:
            path = f"{imported[owner]}:{owner}"
            if f"{path}.{attr}" not in paths and (path, attr) not in attrs:
                missing.add(f"{path}.{attr}")
    assert not missing, f"add these to the targets of {PUSH_BACK!r} in FEATURES: {sorted(missing)}"
    assert {"_reqs_in_batch", "_push_registration_deadlines"} <= probed_attrs


@pytest.mark.parametrize(
    ("feature", "removal", "target"),
    [
        (
            CLEAN_SHUTDOWN,
            "from vllm.v1.engine.core import EngineCoreProc\ndel EngineCoreProc._handle_shutdown",
            "EngineCoreProc._handle_shutdown",
        ),
        (
            AUTO_PLACEMENT,
            "from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import "
            "NixlPullConnectorScheduler as S\n"
            "S.update_state_after_alloc = lambda self, request, blocks, num_tokens, extra=None: None\n"
            "import vllm.version; vllm.version.__version__ = '0.32.9'",  # a patch release that moved a target
            "NixlPullConnectorScheduler.update_state_after_alloc",
        ),
    ],
    ids=["a-deleted-method", "a-renamed-parameter"],
)
def test_a_moved_target_turns_its_feature_off_with_one_warning(feature: str, removal: str, target: str) -> None:
    """A fresh interpreter imports vLLM, moves one patched target, and loads the plugin as vLLM does in an engine
    process agentkv started: no exception, one warning naming the feature and the target, the feature reported
    off, its other targets left as they were, and every other feature applied."""
    script = f"""
        import json, sys
        from importlib.metadata import entry_points
        {removal.replace(chr(10), chr(10) + " " * 8)}
        from vllm.v1.engine.core import EngineCoreProc
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        from vllm.v1.worker.cpu_worker import CPUWorker
        step = EngineCoreProc._process_engine_step
        [plugin] = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "agentkv"]
        plugin.load()()  # vLLM's load_general_plugins: an exception here kills the engine core
        from _agentkv_vllm import _patches as patches
        patches.install()  # again (vLLM loads plugins once per process; twice must not warn twice)
        print(json.dumps({{
            "patched": patches.patched_features(),
            "available": sorted(patches.available_features(patches.engine_features())),
            "others": [
                EngineCoreProc._process_engine_step is not step,
                SpinCondition.__init__.__name__ == "init_with_short_spin",
                CPUWorker.execute_model.__name__ == "execute_within_budget",
            ],
            "shutdown": getattr(getattr(EngineCoreProc, "_handle_shutdown", None), "__name__", None),
        }}))
    """
    done = _run(script, _engine_process_env())
    found = _last_json(done)
    warnings = [line for line in done.stderr.splitlines() if line.startswith("agentkv: ")]
    assert len(warnings) == 1, done.stderr[-3000:]
    assert f"agentkv: {feature} is off" in warnings[0] and target in warnings[0], warnings
    assert found["patched"][feature] is not None and target in found["patched"][feature]
    others = [n for n in (CLEAN_SHUTDOWN, AUTO_PLACEMENT, OWN_GROUP, IDLE_SLEEP, ELASTIC_CORES) if n != feature]
    assert {name: why for name, why in found["patched"].items() if name != feature} == dict.fromkeys(others)
    assert feature not in found["available"] and len(found["available"]) == len(others)
    assert found["others"] == [True, True, True]  # idle sleep (core and worker) and elastic cores applied
    if feature == AUTO_PLACEMENT:  # a patch release: no version warning, and clean shutdown is applied
        assert found["shutdown"] == "handle_shutdown_without_parked_kv"
    else:
        assert found["shutdown"] is None  # nothing was put in the deleted method's place


@pytest.mark.compat
def test_install_without_the_environment_changes_nothing() -> None:
    script = """
        import nixl._api as a
        from vllm.v1.engine.core import EngineCoreProc
        b, handle_shutdown = a.nixlBind, EngineCoreProc._handle_shutdown
        from _agentkv_vllm import _patches
        _patches.install()
        assert a.nixlBind is b and EngineCoreProc._handle_shutdown is handle_shutdown
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTKV_")}
    done = _run(script, env)
    assert done.returncode == 0, done.stderr[-3000:]


def _core(*statuses: str, running: bool = False) -> Any:
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    requests = {
        str(i): SimpleNamespace(status=RequestStatus[name], is_finished=lambda name=name: name.startswith("FINISHED"))
        for i, name in enumerate(statuses)
    }
    scheduler = SimpleNamespace(
        requests=requests,
        running=[object()] if running else [],
        finished_req_ids=set(),
        finished_recving_kv_req_ids=set(),
        failed_recving_kv_req_ids=set(),
        has_unfinished_requests=lambda: any(not r.is_finished() for r in requests.values()),
    )
    return SimpleNamespace(scheduler=scheduler, engines_running=False, batch_queue=None)


def test_an_engine_waiting_only_for_remote_kv_steps_at_once_then_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pull's short wait is picked up at once; a push D waiting for P's prefill stops busy-looping."""
    clock = [100.0]
    monkeypatch.setattr(_patches.time, "monotonic", lambda: clock[0])
    core = _core("WAITING_FOR_REMOTE_KVS", "FINISHED_LENGTH_CAPPED")
    assert _patches._idle_wait_s(core, parked_poll_s=0.05) is None
    clock[0] += _patches.KV_WAIT_BUSY_S / 2
    assert _patches._idle_wait_s(core, parked_poll_s=0.05) is None
    clock[0] += _patches.KV_WAIT_BUSY_S
    assert _patches._idle_wait_s(core, parked_poll_s=0.05) == _patches.KV_WAIT_POLL_S
    core.scheduler.finished_recving_kv_req_ids.add("0")  # its KV is in: the next step schedules it, at once
    assert _patches._idle_wait_s(core, parked_poll_s=0.05) is None
    core.scheduler.finished_recving_kv_req_ids.clear()
    assert _patches._idle_wait_s(core, parked_poll_s=0.05) is None  # a new wait: busy again at first
    busy = _core("WAITING_FOR_REMOTE_KVS", "RUNNING", running=True)  # something else to run: never wait
    assert _patches._idle_wait_s(busy, parked_poll_s=0.05) is None
    assert _patches._idle_wait_s(_core("FINISHED_STOPPED"), parked_poll_s=0.05) == 0.05  # only parked KV
    assert _patches._idle_wait_s(_core("WAITING"), parked_poll_s=0.05) is None  # a request to schedule


_OWNER = """
    import multiprocessing, os, signal, sys, time
    from _agentkv_vllm import _patches

    def engine_core(report):  # stands for vLLM's run_engine_core: its handlers stop it on SIGINT or SIGTERM
        def noted(signum, frame):
            with open(report, "a") as file:
                file.write(f"{signal.Signals(signum).name}\\n")
            os._exit(0)
        signal.signal(signal.SIGTERM, noted)
        signal.signal(signal.SIGINT, noted)
        with open(report, "a") as file:
            file.write(f"group {os.getpgid(0) == os.getpid()} {signal.getsignal(signal.SIGTTOU) is signal.SIG_IGN}\\n")
        time.sleep(60)

    if __name__ == "__main__":
        _patches._VLLM_RUN_ENGINE_CORE[:] = [engine_core]
        core = multiprocessing.get_context("fork").Process(target=_patches.run_engine_core_in_own_group, args=(sys.argv[1],))
        core.start()
        print(core.pid, flush=True)
        time.sleep(1.0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        os.killpg(0, signal.SIGINT)  # a terminal's Ctrl-C: the owner's whole group
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("agentkvs", [True, False], ids=["agentkv-engine", "other-engine"])
def test_an_engine_core_ignores_its_owners_group_and_stops_when_its_owner_dies(tmp_path: Path, agentkvs: bool) -> None:
    """The replaced ``run_engine_core`` of an engine agentkv started puts the core in a process group of its own
    (SIGTTOU ignored), so the owner group's SIGINT does not reach it, and SIGTERMs it (vLLM's own stop) within
    `OWNER_POLL_S` of its owner's SIGKILL. In another vLLM's engine core (no ``AGENTKV_ENGINE``) it changes nothing."""
    script, report = tmp_path / "owner.py", tmp_path / "report"
    script.write_text(textwrap.dedent(_OWNER))
    env = _engine_process_env() if agentkvs else {k: v for k, v in os.environ.items() if not k.startswith("AGENTKV_")}
    done = subprocess.run(
        [sys.executable, str(script), str(report)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,  # the owner's group is its own: its SIGINT spares this test
    )
    assert done.returncode == -9, done.stderr[-3000:]
    core = int(done.stdout.split()[0])
    deadline = time.monotonic() + _patches.OWNER_POLL_S + 5
    while agentkvs and os.path.exists(f"/proc/{core}") and time.monotonic() < deadline:
        time.sleep(0.05)
    noted = report.read_text().splitlines()
    if agentkvs:
        assert noted == ["group True True", "SIGTERM"]
        assert not os.path.exists(f"/proc/{core}") or "Z" in Path(f"/proc/{core}/stat").read_text().split(")")[1][:3]
    else:
        assert noted == ["group False False", "SIGINT"]  # as vLLM runs it: in its owner's group, stopped by Ctrl-C


_STARTING = """
    import multiprocessing, os, signal, sys, threading, time
    from _agentkv_vllm import _patches

    def engine_core(report, block):  # a spawned core: seconds of imports, in its owner's group, then the plugin
        time.sleep(2.0)
        if block:
            _patches._leave_the_owners_group()
        def noted(signum, frame):
            with open(report, "a") as file:
                file.write(f"{signal.Signals(signum).name}\\n")
        signal.signal(signal.SIGINT, noted)  # vLLM's handlers, installed once the core runs
        signal.signal(signal.SIGTERM, noted)
        time.sleep(1.0)
        with open(report, "a") as file:
            file.write("ran\\n")

    def start(report, block, started):  # agentkv's owner makes the core from a worker thread
        from agentkv._engines._spawn import stop_signals_blocked

        with stop_signals_blocked() if block else open(os.devnull):
            core = multiprocessing.get_context("spawn").Process(target=engine_core, args=(report, block))
            core.start()
        started.set()
        core.join()

    if __name__ == "__main__":
        signal.signal(signal.SIGINT, lambda signum, frame: None)  # the owner's own stop (a handler, not inherited)
        started = threading.Event()
        starter = threading.Thread(target=start, args=(sys.argv[1], sys.argv[2] == "block", started))
        starter.start()
        started.wait()
        time.sleep(1.0)
        os.killpg(0, signal.SIGINT)  # a Ctrl-C while the core starts
        starter.join()
"""


@pytest.mark.parametrize("block", [True, False], ids=["agentkv-owner", "unblocked"])
def test_a_ctrl_c_while_an_engine_core_starts_stays_with_its_owner(tmp_path: Path, block: bool) -> None:
    """A spawned core (vLLM's way on CPU) spends seconds importing in its owner's group before it can leave it.
    Made by agentkv (SIGINT and SIGTERM blocked in the starting thread), a Ctrl-C to the group in that time is
    dropped once the core has its own group; made without, it interrupts the core's start."""
    script, report = tmp_path / "starting.py", tmp_path / "report"
    script.write_text(textwrap.dedent(_STARTING))
    done = subprocess.run(
        [sys.executable, str(script), str(report), "block" if block else "plain"],
        env=_engine_process_env(),
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    noted = report.read_text().splitlines() if report.exists() else []
    if block:
        assert noted == ["ran"], done.stderr[-3000:]
    else:
        assert noted == [] and "KeyboardInterrupt" in done.stderr
