"""Every change agentkv makes to vLLM's and NIXL's internals, in one place: tested on vLLM 0.32.x, probed on any.

Each patch and its measured reason is described in ``docs/vllm-patches.md``. One module over 500 lines on
purpose: every place agentkv reaches into vLLM stays in one file, so that an upgrade of vLLM is checked
against one list. In short:

`install` runs in every process vLLM starts (the ``vllm.general_plugins`` entry point
``agentkv``) and acts only in engines agentkv started (their environment, `engine_env`, says so):

* **A prompt, clean shutdown**: an engine core told to stop does not wait for KV parked for
  a peer (D's pins, for minutes) before it tears down; waiting, it was killed after 5 s
  with its shared memory and semaphores left behind.
* **Idle engines sleep** (with ``idle_poll_ms``): NIXL agents get a progress-thread delay;
  an engine core whose only work is parked KV waits on its input queue, one that has waited
  20 ms for remote KV with nothing else to run steps every 5 ms; a worker spins 2 ms, not 1 s,
  before it sleeps.
* **Shutdown order** (`stop_output_handler`): an ``AsyncLLM``'s output handler is stopped
  before the engine, not after, so it never reads the "engine dead" that vLLM's own shutdown
  puts in its queue (a traceback at every exit).
* **Pins of steps on D alone** (auto placement): D's worker tracks them as it tracks a decode's pin.
* **Engines stopped by their owner only** (`run_engine_core_in_own_group`): an engine core (and the workers
  it starts) runs in a process group of its own, so a terminal's Ctrl-C or a signal to the owner's process
  group reaches the owner alone, which stops the engine in order; the engine stops itself when its owner dies.
* **Elastic cores** (with ``core_policy="elastic"``, in `_agentkv_vllm._elastic_worker`): a
  worker sets its thread count from the host's core table (`CoreTable`) before each forward pass,
  and before each layer of a long one: all the cores of its binding while no other busy engine
  owns any of them, its own otherwise.
* **Read-outs** (`keep_prefill_stats`): each request's local/external prefix-cache split,
  which vLLM computes but does not return.
* **The server's additions** (`add_server_readouts`): the read-outs for agentkv's API
  server, and the KV handle at the end of streamed completions.

**Patches degrade, they do not refuse.** The patched functions are internals that move between
releases. Each patch serves one agentkv feature (`FEATURES`: the feature's name, what in agentkv
asks for it, every target it replaces or relies on, what happens without it), and probes its
targets before it replaces anything (`probe`): the module attribute, class or method exists, with
the parameters the wrapper passes and the instance attributes it reads. Where a probe fails, that
feature is off, with one warning naming it and the missing target (`warn_once`), nothing is
replaced for it, and the rest works; `install` never raises inside vLLM's plugin loader. agentkv
asks the same probes in its own process (`available_features`, `agentkv._engines._vllm_features`)
and turns a feature off, or refuses a setting that asks for it explicitly, by name. vLLM 0.32.x is
the tested series (`TESTED_VLLM`); any other gets one warning (`untested_vllm`), and the probes decide.

This module is a part of agentkv's vLLM plugin (`_agentkv_vllm`): vLLM imports it in every process
it starts, so it imports only the standard library and its sibling `_agentkv_vllm._elastic_worker`
at import time, never agentkv.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping
from typing import Any, NamedTuple

from ._elastic_worker import follow_core_table

__all__ = [
    "AUTO_PLACEMENT",
    "CHECKED_VLLM",
    "CLEAN_SHUTDOWN",
    "ELASTIC_CORES",
    "FEATURES",
    "IDLE_SLEEP",
    "OWN_GROUP",
    "PREFILL_STATS",
    "PUSH_BACK",
    "SERVER_READOUTS",
    "STREAMED_HANDLE",
    "TESTED_VLLM",
    "Feature",
    "Target",
    "add_server_readouts",
    "available_features",
    "engine_env",
    "engine_features",
    "install",
    "installed_vllm",
    "keep_prefill_stats",
    "patched_features",
    "probe",
    "run_engine_core_in_own_group",
    "stop_output_handler",
    "untested_vllm",
    "warn_feature_off",
    "warn_once",
    "warn_if_untested",
]

TESTED_VLLM = "0.32"
"""The vLLM release series these patches are tested on with engines (any 0.32.x, vLLM's CPU build)."""
CHECKED_VLLM = ("0.33", "0.34")
"""Later series the compatibility tier checks without an engine (scripts/compat.py: the plugin, every probe, the
connector's tests on their CUDA wheels). Neither these nor `TESTED_VLLM` is warned of; on another, each feature is
probed all the same."""

ENGINE_ENV = "AGENTKV_ENGINE"
NIXL_DELAY_ENV = "AGENTKV_NIXL_PROGRESS_DELAY_US"
PARKED_POLL_ENV = "AGENTKV_PARKED_KV_POLL_MS"
WORKER_EXIT_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
WORKER_EXIT_S = 30
"""How long an engine core waits for its workers to exit before it kills them (vLLM's default: 5 s). A worker on
the bundled model took 4-5 s on 2 cores, most of it the interpreter's last collection of its heap (py-spy:
``gc_collect_main``); killed, it leaves the shared memory it made behind."""
CORE_TABLE_ENV = "AGENTKV_CORE_TABLE"
"""``<path>:<slot>``: the host's core table and the engine's slot in it (elastic cores)."""
WARNED_ENV = "AGENTKV_PLUGIN_WARNED"
"""What `warn_once` has said already in this process or its parent ("|"-separated keys): an engine's
processes inherit it, so a feature that is off is said once, not once per engine core and worker."""
PIN_ON_DECODE = "agentkv_pin_on_decode"
"""A ``kv_transfer_params`` key: a step run on D alone, whose blocks D pins like a decode's (see below)."""
WORKER_SPIN_S = 0.002
KV_WAIT_BUSY_S = 0.02
"""An engine core waiting only for remote KV steps in a busy loop this long (a pull's wait: picked up at once)."""
KV_WAIT_POLL_S = 0.005
"""... and then steps every this many seconds (a push D waiting for P's prefill: up to 5 ms later, not a core)."""
_PATCHED_MARK = "_agentkv_patched"

logger = logging.getLogger("agentkv")

# ----------------------------------------------------------------- features and their targets

CLEAN_SHUTDOWN = "clean shutdown"
IDLE_SLEEP = "idle sleep"
AUTO_PLACEMENT = "auto placement"
OWN_GROUP = "own process group"
ELASTIC_CORES = "elastic cores"
PREFILL_STATS = "prefill stats"
SERVER_READOUTS = "server read-outs"
STREAMED_HANDLE = "streamed handle"
PUSH_BACK = "push with push-back"


class Target(NamedTuple):
    """One thing a patch replaces or relies on, and the shape it relies on."""

    path: str
    """``"module:Qualified.name"`` (``"module:"`` alone: the module)."""
    params: tuple[str, ...] = ()
    """The callable's first parameters, in this order: the wrapper passes them positionally."""
    keywords: tuple[str, ...] = ()
    """Parameters the patch passes by name."""
    attrs: tuple[str, ...] = ()
    """Attributes of the class's instances (or the class) that the patch reads or writes."""
    source: str = ""
    """Text the target's source holds: how it calls what the patch replaces."""
    replaced: bool = False
    """The patch assigns this attribute (otherwise it only uses it)."""
    is_classmethod: bool = False
    optional: bool = False
    """The module may be absent (NIXL): then there is nothing for the patch to change."""

    @property
    def where(self) -> str:
        """The target in words: ``"EngineCoreProc._handle_shutdown (vllm.v1.engine.core)"``."""
        module, _, name = self.path.partition(":")
        return f"{name} ({module})" if name else module


class Feature(NamedTuple):
    """An agentkv feature that needs vLLM internals: what asks for it, its targets, and what happens without them."""

    name: str
    serves: str
    when_off: str
    targets: tuple[Target, ...]
    behaviour: str = ""
    """``"module:function"``: where the feature relies on what vLLM's code *does*, not only on its names, a check
    that runs that code without an engine and returns what is wrong (None: nothing); run once its targets pass."""


_CORE = "vllm.v1.engine.core"
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
_REQUEST = "vllm.v1.request"
_NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
_SERVING = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion"

# Signatures that several connector classes share (the NIXL push and pull schedulers and workers).
_CONNECTOR_INIT = ("self", "vllm_config", "engine_id", "kv_cache_config")
_AFTER_ALLOC = ("self", "request", "blocks", "num_external_tokens")
_FINISHED = ("self", "request", "block_ids")


def _methods(cls: str, **params: tuple[str, ...]) -> tuple[Target, ...]:
    """A target for each named method of ``cls`` (``"module:Class"``), with the parameters it relies on."""
    return tuple(Target(f"{cls}.{name}", params=names) for name, names in params.items())


FEATURES: dict[str, Feature] = {
    feature.name: feature
    for feature in (
        Feature(
            CLEAN_SHUTDOWN,
            serves="every engine agentkv starts: a stop does not wait for KV parked for a peer",
            when_off="an engine stopped while it holds KV parked for its peer waits for vLLM's shutdown timeout "
            "(agentkv gives it 30 s) and is then killed, which can leave shared memory and semaphores behind",
            targets=(
                Target(f"{_CORE}:EngineCoreProc._handle_shutdown", params=("self",), replaced=True),
                Target(f"{_CORE}:EngineShutdownState.SHUTTING_DOWN"),
                Target(
                    f"{_CORE}:EngineCoreProc", attrs=("shutdown_state", "engines_running", "batch_queue", "scheduler")
                ),
                Target(_SCHEDULER, attrs=("has_unfinished_requests", "finished_req_ids")),
            ),
        ),
        Feature(
            IDLE_SLEEP,
            serves="idle_poll_ms (default 50 ms; CPU engines): idle engines sleep instead of busy-looping",
            when_off="idle engines busy-loop as stock vLLM and NIXL do (about a core per engine while KV is parked)",
            targets=(
                Target("nixl._api:nixlBind", replaced=True, optional=True),
                Target("nixl._api:nixlBind.nixlAgent", optional=True),
                Target("nixl._api:nixlBind.nixlAgentConfig", attrs=("pthrDelay",), optional=True),
                Target(f"{_CORE}:EngineCoreProc._process_engine_step", params=("self",), replaced=True),
                Target(f"{_CORE}:EngineCoreProc._handle_client_request", params=("self", "request_type", "request")),
                Target(f"{_CORE}:EngineCoreProc", attrs=("input_queue", "engines_running", "batch_queue", "scheduler")),
                Target(
                    _SCHEDULER,
                    attrs=(
                        "has_unfinished_requests",
                        "running",
                        "requests",
                        "finished_req_ids",
                        "finished_recving_kv_req_ids",
                        "failed_recving_kv_req_ids",
                    ),
                ),
                Target(f"{_REQUEST}:Request", attrs=("status", "is_finished")),
                Target(f"{_REQUEST}:RequestStatus.WAITING_FOR_REMOTE_KVS"),
                Target(
                    "vllm.distributed.device_communicators.shm_broadcast:SpinCondition.__init__",
                    params=("self", "is_reader"),
                    replaced=True,
                ),
                Target(
                    "vllm.distributed.device_communicators.shm_broadcast:SpinCondition",
                    attrs=("is_reader", "busy_loop_s"),
                ),
            ),
        ),
        Feature(
            AUTO_PLACEMENT,
            serves='mode="auto" and placement="decode": steps prefilled on D alone, whose pins D must free',
            when_off='an embedded pair serves no mode "auto" (a session that asks for it is refused, naming this '
            'feature), places every step on P, and refuses placement="decode"',
            targets=(
                Target(
                    f"{_NIXL}.pull_scheduler:NixlPullConnectorScheduler.update_state_after_alloc",
                    params=("self", "request", "blocks", "num_external_tokens"),
                    replaced=True,
                ),
                Target(
                    f"{_NIXL}.pull_scheduler:NixlPullConnectorScheduler",
                    attrs=("_reqs_in_batch", "is_bidirectional_kv_xfer_enabled"),
                ),
                Target(f"{_REQUEST}:Request", attrs=("kv_transfer_params", "request_id")),
            ),
        ),
        Feature(
            OWN_GROUP,
            serves="every engine agentkv starts: its processes ignore signals sent to their owner's process group "
            "(a terminal's Ctrl-C), are stopped by their owner, and stop when it dies",
            when_off="a Ctrl-C or SIGTERM sent to the owner's process group reaches the engine processes too: they "
            "stop on their own before their owner stops them (the owner logs 'engine core exited unexpectedly' and "
            "an EngineDeadError), and an engine whose owner was killed keeps running until agentkv's watchdog stops it",
            targets=(
                Target(f"{_CORE}:EngineCoreProc.run_engine_core", replaced=True),
                Target(  # the target every engine-core process runs, read when the process is made
                    "vllm.v1.engine.utils:CoreEngineProcManager.__init__",
                    source="target=EngineCoreProc.run_engine_core",
                ),
            ),
        ),
        Feature(
            ELASTIC_CORES,
            serves='core_policy="elastic" (the default of a CPU pair): an engine borrows its idle peer\'s cores',
            when_off='the pair runs core_policy="split": each engine on its own half of the cores',
            targets=(
                Target(
                    "vllm.v1.worker.cpu_worker:CPUWorker.execute_model",
                    params=("self", "scheduler_output"),
                    replaced=True,
                ),
                Target("vllm.v1.worker.cpu_worker:CPUWorker", attrs=("vllm_config", "model_runner")),
                Target(
                    "vllm.v1.core.sched.output:SchedulerOutput",
                    attrs=("total_num_scheduled_tokens", "kv_connector_metadata"),
                ),
                Target("vllm._custom_ops:cpu_attn_get_scheduler_metadata", replaced=True),
                Target(
                    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build",
                    params=("self",),
                    source="ops.cpu_attn_get_scheduler_metadata(",
                    replaced=True,
                ),
                Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata", attrs=("scheduler_metadata",)),
                Target("vllm.forward_context:is_forward_context_available"),
                Target("vllm.forward_context:get_forward_context"),
                Target("vllm.forward_context:ForwardContext", attrs=("attn_metadata",)),
            ),
        ),
        Feature(
            PREFILL_STATS,
            serves="each step's local/pulled split of cached tokens (embedded engines and agentkv's server)",
            when_off="a step's cached tokens are all reported as local_hit_tokens (pulled_tokens 0)",
            targets=(
                Target(
                    "vllm.v1.engine.output_processor:OutputProcessor.process_outputs",
                    params=("self", "engine_core_outputs"),
                ),
                Target("vllm.v1.engine.async_llm:AsyncLLM", attrs=("output_processor",)),
                Target("vllm.v1.engine:EngineCoreOutput", attrs=("request_id", "prefill_stats")),
                Target(
                    "vllm.v1.metrics.stats:PrefillStats",
                    attrs=("num_local_cached_tokens", "num_external_cached_tokens", "num_computed_tokens"),
                ),
            ),
        ),
        Feature(
            SERVER_READOUTS,
            serves="agentkv's API server (agentkv engine, LaunchedPair): the agentkv object on every completion",
            when_off="the server answers as a stock vLLM server does: a client reports cached tokens as local and "
            "no NIXL bytes",
            targets=(
                Target(
                    "vllm.v1.engine.async_llm:AsyncLLM.from_vllm_config",
                    keywords=("stat_loggers",),
                    is_classmethod=True,
                    replaced=True,
                ),
                Target(
                    f"{_SERVING}.request_output_to_completion_response",
                    params=("self", "final_res_batch"),
                    replaced=True,
                ),
            ),
        ),
        Feature(
            STREAMED_HANDLE,
            serves="agentkv's API server: D's KV handle at the end of a streamed completion (streaming with push-back)",
            when_off="D's streamed completions carry no handle: a LaunchedPair takes each answer whole (push-back "
            "still works), and a RemotePair opened with decode_streaming=True is refused as for a stock server",
            targets=(
                Target(
                    f"{_SERVING}.completion_stream_generator",
                    params=("self", "request", "engine_inputs", "result_generator", "request_id"),
                    replaced=True,
                ),
                Target("vllm.outputs:RequestOutput", attrs=("finished", "kv_transfer_params")),
            ),
        ),
        Feature(
            PUSH_BACK,
            serves='transfer="push" with push-back (push_back=True): agentkv\'s AgentKVPushConnector '
            "(_agentkv_vllm._push_connector), a subclass of vLLM's NIXL push connector",
            when_off='refused by name before any engine starts; pull pairs (transfer="pull") and push without '
            "push-back (vLLM's own NixlPushConnector) run as usual",
            targets=(
                Target("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole.SCHEDULER"),
                Target("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorRole.WORKER"),
                Target(
                    f"{_NIXL}.connector:NixlBaseConnector.__init__",
                    params=("self", "vllm_config", "role", "kv_cache_config"),
                ),
                Target(
                    f"{_NIXL}.connector:NixlBaseConnector",
                    attrs=("engine_id", "connector_scheduler", "connector_worker"),
                ),
                Target(f"{_NIXL}.connector:NixlPushConnector"),
                *_methods(
                    f"{_NIXL}.push_scheduler:NixlPushConnectorScheduler",
                    __init__=_CONNECTOR_INIT,
                    update_state_after_alloc=_AFTER_ALLOC,
                    request_finished=_FINISHED,
                ),
                Target(f"{_NIXL}.push_scheduler:NixlPushConnectorScheduler", attrs=("_push_registration_deadlines",)),
                *_methods(
                    f"{_NIXL}.pull_scheduler:NixlPullConnectorScheduler",
                    get_num_new_matched_tokens=("self", "request", "num_computed_tokens"),
                    update_state_after_alloc=_AFTER_ALLOC,
                    request_finished=_FINISHED,
                ),
                Target(
                    f"{_NIXL}.pull_scheduler:NixlPullConnectorScheduler",
                    attrs=("_reqs_in_batch", "is_bidirectional_kv_xfer_enabled"),
                ),
                *_methods(
                    f"{_NIXL}.push_worker:NixlPushConnectorWorker",
                    __init__=_CONNECTOR_INIT,
                    start_load_kv=("self", "metadata"),
                    _get_new_notifs=("self",),
                ),
                Target(
                    f"{_NIXL}.push_worker:NixlPushConnectorWorker",
                    attrs=(
                        "_pending_completion_notifs",
                        "_reqs_to_send",
                        "_reqs_to_process",
                        "consumer_notification_counts_by_req",
                        "expected_consumer_notifications_by_req",
                    ),
                ),
                Target(f"{_NIXL}.pull_worker:NixlPullConnectorWorker.start_load_kv", params=("self", "metadata")),
                Target(f"{_NIXL}.metadata:NixlConnectorMetadata", attrs=("reqs_to_recv",)),
                Target(f"{_NIXL}.metadata:ReqMeta", attrs=("remote",)),
                Target(f"{_NIXL}.metadata:RemoteMeta", attrs=("block_ids",)),
                Target(f"{_REQUEST}:Request", attrs=("kv_transfer_params", "request_id")),
                Target("vllm.config:VllmConfig", attrs=("kv_transfer_config", "parallel_config")),
                Target("vllm.config:KVTransferConfig", attrs=("kv_connector_extra_config",)),
                Target("vllm.config:ParallelConfig", attrs=("decode_context_parallel_size",)),
                Target("_agentkv_vllm._push_connector:AgentKVPushConnector"),  # the subclass itself (its MRO) loads
            ),
            behaviour="_agentkv_vllm._push_connector:pin_release_problem",
        ),
    )
}
"""agentkv's features that need vLLM internals, by name (the table of docs/vllm-patches.md)."""


def probe(feature: str) -> str | None:
    """What the installed vLLM lacks for ``feature``: its first failing target, in words, or what its behaviour
    check found (`Feature.behaviour`); None when all is there.

    Imports the targets' modules (vLLM's: call it where vLLM may be imported); never raises for a missing target.
    """
    for target in FEATURES[feature].targets:
        try:
            problem = _probe_target(target)
        except Exception as exc:  # a target of a shape no probe foresaw: as missing
            problem = f"could not be probed ({exc!r})"
        if problem is not None:
            return f"{target.where}: {problem}"
    return _check_behaviour(FEATURES[feature].behaviour)


def _check_behaviour(path: str) -> str | None:
    """Run the behaviour check ``"module:function"`` (none: nothing to check); its problem, in words."""
    if not path:
        return None
    import importlib

    module_name, _, name = path.partition(":")
    try:
        problem = getattr(importlib.import_module(module_name), name)()
    except Exception as exc:
        problem = f"could not be run ({exc!r})"
    return None if problem is None else f"behaviour ({name}): {problem}"


def available_features(names: Iterable[str] | None = None) -> frozenset[str]:
    """The features (of ``names``; default: all of `FEATURES`) whose probes pass on the installed vLLM.

    The server features import vLLM's OpenAI server (seconds): agentkv's process asks for the ones it needs.
    """
    return frozenset(name for name in (FEATURES if names is None else names) if probe(name) is None)


def _probe_target(target: Target) -> str | None:
    import importlib
    import inspect

    module_name, _, qualname = target.path.partition(":")
    if module_name.split(".")[0] == "nixl":
        os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")  # as vLLM does before its first nixl import
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        return None if target.optional else f"cannot be imported ({exc})"
    except Exception as exc:  # a module that fails as it loads is as absent
        return f"failed to import ({exc!r})"
    owner: Any = None
    for part in qualname.split(".") if qualname else ():
        owner = found
        try:
            found = getattr(found, part)
        except Exception:
            return "missing"
    if target.is_classmethod and not isinstance(
        inspect.getattr_static(owner, qualname.rpartition(".")[2]), classmethod
    ):
        return "no longer a classmethod"
    if target.params or target.keywords:
        try:
            parameters = list(inspect.signature(found).parameters)
        except (TypeError, ValueError):
            return "has no signature to check its parameters against"
        if parameters[: len(target.params)] != list(target.params):
            return f"takes ({', '.join(parameters)}), not ({', '.join(target.params)}, ...)"
        missing = [name for name in target.keywords if name not in parameters]
        if missing:
            return f"takes no parameter {', '.join(missing)}"
    if target.attrs:
        if not isinstance(found, type):
            return "not a class"
        missing = [name for name in target.attrs if not _has_attribute(found, name)]
        if missing:
            return f"has no attribute {', '.join(missing)}"
    if target.source:
        try:
            text = inspect.getsource(found)
        except (OSError, TypeError):
            return f"its source (to find {target.source!r}) is not available"
        if target.source not in text:
            return f"no longer calls {target.source!r}"
    return None


def _has_attribute(cls: type, name: str) -> bool:
    """Whether ``cls`` or its instances have ``name``: defined or declared on a class of its MRO (methods, fields,
    annotations, msgspec struct fields), or assigned as ``self.<name>`` in the source of one of their modules."""
    import re

    fields = getattr(cls, "__struct_fields__", ())  # a msgspec struct's
    if isinstance(fields, tuple) and name in fields:
        return True
    for klass in cls.__mro__:
        own = vars(klass)
        annotations = own.get("__annotations__")
        if name in own or (isinstance(annotations, dict) and name in annotations):
            return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(?::|=(?!=))")
    return any(assigned.search(_module_source(klass.__module__)) for klass in cls.__mro__)


_SOURCES: dict[str, str] = {}


def _module_source(module_name: str) -> str:
    import sys

    if module_name not in _SOURCES:
        path = getattr(sys.modules.get(module_name), "__file__", None) or ""
        try:
            with open(path, encoding="utf-8") as file:
                _SOURCES[module_name] = file.read() if path.endswith(".py") else ""
        except OSError:
            _SOURCES[module_name] = ""
    return _SOURCES[module_name]


# ----------------------------------------------------------------- warnings, once


def warn_once(key: str, message: str) -> bool:
    """Log ``message`` as a warning unless ``key`` was warned of already in this process or the one that started it
    (`WARNED_ENV`); True if it was logged."""
    said = [part for part in os.environ.get(WARNED_ENV, "").split("|") if part]
    if key in said:
        return False
    os.environ[WARNED_ENV] = "|".join([*said, key])
    logger.warning("%s", message)
    return True


def warn_feature_off(feature: str, problem: str) -> bool:
    """The one warning that ``feature`` is off, naming the target it misses (``problem``, from `probe`)."""
    return warn_once(
        feature,
        f"agentkv: {feature} is off on vLLM {installed_vllm()}: {problem}. Without it, "
        f"{FEATURES[feature].when_off} (docs/vllm-patches.md)",
    )


def untested_vllm(version: str | None = None) -> str | None:
    """The warning for vLLM ``version`` (default: the installed one), or None for the tested and checked series
    (0.32.x; 0.33.x and 0.34.x)."""
    version = version or installed_vllm()
    if ".".join(version.split("+")[0].split(".")[:2]) in (TESTED_VLLM, *CHECKED_VLLM):
        return None
    checked = ", ".join(f"{series}.x" for series in CHECKED_VLLM)
    return (
        f"agentkv: tested on vLLM {TESTED_VLLM}.x (and checked without an engine on {checked}), and vLLM {version} "
        "is installed: each of agentkv's features "
        "that patch vLLM internals checks its targets first, and one whose targets moved is turned off with a "
        "warning (docs/vllm-patches.md)"
    )


def warn_if_untested(version: str | None = None) -> bool:
    """Warn once (`untested_vllm`) unless vLLM ``version`` (default: the installed one) is 0.32.x."""
    message = untested_vllm(version)
    return message is not None and warn_once("vllm version", message)


def installed_vllm() -> str:
    """The installed vLLM's version (``"(version unknown)"`` where it cannot be read)."""
    try:
        from vllm.version import __version__
    except Exception:
        return "(version unknown)"
    return str(__version__)


# ----------------------------------------------------------------- in the engines


def engine_env(idle_poll_ms: int | None) -> dict[str, str]:
    """The environment of an engine agentkv starts: it marks it as agentkv's, gives its workers `WORKER_EXIT_S`
    to exit, and makes it poll every ``idle_poll_ms`` when idle (None: vLLM's and NIXL's busy loops)."""
    env = {ENGINE_ENV: "1", WORKER_EXIT_ENV: str(WORKER_EXIT_S)}
    if idle_poll_ms is not None:
        env |= {NIXL_DELAY_ENV: str(idle_poll_ms * 1000), PARKED_POLL_ENV: str(idle_poll_ms)}
    return env


def engine_features(env: Mapping[str, str] | None = None) -> list[str]:
    """The features `install` applies in a process with environment ``env`` (default: this one's): none outside
    an engine agentkv started; clean shutdown, auto placement's pin fix and the engines' own process group in
    every one; idle sleep with ``idle_poll_ms``; elastic cores with a core table."""
    env = os.environ if env is None else env
    if not env.get(ENGINE_ENV):
        return []
    features = [CLEAN_SHUTDOWN, AUTO_PLACEMENT, OWN_GROUP]
    if env.get(NIXL_DELAY_ENV) or env.get(PARKED_POLL_ENV):
        features.append(IDLE_SLEEP)
    if env.get(CORE_TABLE_ENV):
        features.append(ELASTIC_CORES)
    return features


_PATCHED: dict[str, str | None] = {}


def patched_features() -> dict[str, str | None]:
    """The features this process has handled (`install`, `keep_prefill_stats`, `add_server_readouts`): None for
    one applied, why it is off for one that is not."""
    return dict(_PATCHED)


def install() -> None:
    """vLLM's plugin hook (every process vLLM starts): apply what agentkv's environment asks for, each feature
    whose probe passes. It never raises: vLLM's plugin loader does not catch, and an exception there kills the
    engine core as it starts."""
    features = engine_features()
    if not features:
        return  # not an engine agentkv started: change nothing
    try:
        warn_if_untested()
        patches: dict[str, Callable[[], None]] = {
            CLEAN_SHUTDOWN: _tear_down_without_waiting_for_parked_kv,
            AUTO_PLACEMENT: _track_pins_of_steps_on_decode,
            OWN_GROUP: _start_engine_cores_in_their_own_group,
            IDLE_SLEEP: _sleep_when_idle,
            ELASTIC_CORES: lambda: follow_core_table(os.environ[CORE_TABLE_ENV]),
        }
        for feature in features:
            _apply(feature, patches[feature])
    except Exception as exc:  # a bug of the plugin's own: vLLM runs on, unpatched where it stopped
        logger.warning("agentkv: the vLLM plugin stopped (%r); what it had not patched runs as stock vLLM", exc)


def _apply(feature: str, patch: Callable[[], None]) -> bool:
    """Probe ``feature``'s targets, then patch; a probe that fails leaves them as they are (one warning)."""
    problem = probe(feature)
    if problem is None:
        try:
            patch()
        except Exception as exc:
            problem = f"patching failed ({exc!r})"
    _PATCHED[feature] = problem
    if problem is not None:
        warn_feature_off(feature, problem)
    return problem is None


def _sleep_when_idle() -> None:
    delay_us = os.environ.get(NIXL_DELAY_ENV)
    poll_ms = os.environ.get(PARKED_POLL_ENV)
    if delay_us:
        _give_nixl_agents_a_delay(int(delay_us))
    if poll_ms:
        _wait_for_input_while_idle(int(poll_ms) / 1000)
        _shorten_worker_spin(WORKER_SPIN_S)


class _BindingsWithDelay:
    """nixl's binding module, except that agents are created with a progress-thread delay."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self.delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802 (nixl's name)
        config.pthrDelay = self.delay_us
        return self._bindings.nixlAgent(name, config)


def _give_nixl_agents_a_delay(delay_us: int) -> None:
    # vLLM sets this before its own first nixl import; importing nixl here comes first.
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        import nixl._api as nixl_api  # pyright: ignore[reportMissingImports]
    except ImportError:
        return
    bindings = nixl_api.nixlBind
    if isinstance(bindings, _BindingsWithDelay):
        bindings.delay_us = delay_us
    else:
        nixl_api.nixlBind = _BindingsWithDelay(bindings, delay_us)


def _wait_for_input_while_idle(poll_s: float) -> None:
    """An engine core with nothing to compute waits on its input queue instead of stepping in a busy loop:
    for ``poll_s`` while it only holds parked KV, for `KV_WAIT_POLL_S` once it has waited `KV_WAIT_BUSY_S`
    for remote KV with nothing else to run (a push D while P prefills: its loop took half of P's second
    core). Each wait ends early on a new request."""
    from vllm.v1.engine.core import EngineCoreProc

    if getattr(EngineCoreProc, _PATCHED_MARK, None) is not None:
        setattr(EngineCoreProc, _PATCHED_MARK, poll_s)
        return
    step = EngineCoreProc._process_engine_step

    def step_then_wait_if_idle(self: Any) -> bool:
        model_executed: bool = step(self)
        wait_s = None if model_executed else _idle_wait_s(self, parked_poll_s=getattr(EngineCoreProc, _PATCHED_MARK))
        if model_executed:
            self._agentkv_kv_wait_since = None
        if wait_s is not None:
            try:
                request = self.input_queue.get(timeout=wait_s)
            except queue.Empty:
                pass
            else:
                self._handle_client_request(*request)
        return model_executed

    step_then_wait_if_idle.__wrapped__ = step  # type: ignore[attr-defined]  # a later probe sees vLLM's parameters
    EngineCoreProc._process_engine_step = step_then_wait_if_idle  # type: ignore[method-assign]
    setattr(EngineCoreProc, _PATCHED_MARK, poll_s)


def _track_pins_of_steps_on_decode() -> None:
    """D's worker tracks the pin of a step run on D alone, as it tracks a decode's.

    vLLM's scheduler pins the blocks of any finished request with transfer parameters on a
    bidirectional D, but its worker tracks (serves reads of, frees on notification or
    expiry) only requests that pulled from P. A step on D alone pulls nothing: without this
    its pin was never freed and D's cache filled up (seen: 8 concurrent sessions stalled).
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    update = NixlPullConnectorScheduler.update_state_after_alloc
    if getattr(update, _PATCHED_MARK, False):
        return

    def update_tracking_pins_on_decode(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        update(self, request, blocks, num_external_tokens)
        params = request.kv_transfer_params
        if params and params.get(PIN_ON_DECODE) and self.is_bidirectional_kv_xfer_enabled:
            self._reqs_in_batch.add(request.request_id)

    setattr(update_tracking_pins_on_decode, _PATCHED_MARK, True)
    update_tracking_pins_on_decode.__wrapped__ = update  # type: ignore[attr-defined]
    NixlPullConnectorScheduler.update_state_after_alloc = update_tracking_pins_on_decode  # type: ignore[method-assign]


def _tear_down_without_waiting_for_parked_kv() -> None:
    from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState

    handle_shutdown = EngineCoreProc._handle_shutdown
    if getattr(handle_shutdown, _PATCHED_MARK, False):
        return

    def handle_shutdown_without_parked_kv(self: Any) -> bool:
        keep_running: bool = handle_shutdown(self)
        if keep_running and self.shutdown_state == EngineShutdownState.SHUTTING_DOWN and _only_parked_kv(self):
            return False  # the unfinished requests are aborted; the parked KV's readers will not come
        return keep_running

    setattr(handle_shutdown_without_parked_kv, _PATCHED_MARK, True)
    handle_shutdown_without_parked_kv.__wrapped__ = handle_shutdown  # type: ignore[attr-defined]
    EngineCoreProc._handle_shutdown = handle_shutdown_without_parked_kv  # type: ignore[method-assign]


def _only_parked_kv(core: Any) -> bool:
    """Nothing to run or receive: the scheduler only holds finished requests' blocks."""
    scheduler = core.scheduler
    return not (
        core.engines_running or core.batch_queue or scheduler.has_unfinished_requests() or scheduler.finished_req_ids
    )


OWNER_POLL_S = 1.0
"""How often an engine core checks that the process that started it (its owner) still lives."""
OWNERLESS_GRACE_S = 30.0
"""An engine core whose owner died, still running this long after its own SIGTERM, exits at once."""
_VLLM_RUN_ENGINE_CORE: list[Callable[..., Any]] = []
"""vLLM's ``EngineCoreProc.run_engine_core``, once `run_engine_core_in_own_group` replaced it in this process."""


def _start_engine_cores_in_their_own_group() -> None:
    """Every engine-core process made from now on runs `run_engine_core_in_own_group` (vLLM's process manager
    reads ``EngineCoreProc.run_engine_core`` as its target when it makes the process)."""
    from vllm.v1.engine.core import EngineCoreProc

    run = EngineCoreProc.run_engine_core
    if run is run_engine_core_in_own_group:
        return
    _VLLM_RUN_ENGINE_CORE[:] = [run]
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core_in_own_group)  # type: ignore[method-assign,assignment]


def run_engine_core_in_own_group(*args: Any, **kwargs: Any) -> Any:
    """vLLM's ``EngineCoreProc.run_engine_core`` (an engine core's whole life), in a process group of its own.

    A terminal's Ctrl-C goes to its foreground process group, and a supervisor's SIGTERM often to a
    whole group. An engine core in its owner's group got them too, and vLLM's handler stopped it at
    once, before its owner could stop it in order: the owner then logged "engine core exited
    unexpectedly" and an ``EngineDeadError``. In a group of its own (its workers, which it starts,
    inherit it), made before vLLM installs its handlers, an engine core gets only what its owner sends
    it (vLLM stops a core with SIGTERM to its pid). A group kill of the owner no longer reaches it
    either, so the core watches its owner and stops when it dies (`_stop_when_the_owner_dies`).

    Module-level: vLLM spawns a CPU engine's core (a GPU engine's too, once CUDA is initialised in
    the owner), which unpickles its target by name and so runs this first as well; a forked core
    inherits the replaced attribute.
    """
    if os.environ.get(ENGINE_ENV):  # an engine agentkv started (the replaced target stays in the owner's process)
        _leave_the_owners_group()
    if _VLLM_RUN_ENGINE_CORE:
        run = _VLLM_RUN_ENGINE_CORE[0]
    else:  # a spawned engine core: this process has not replaced vLLM's function
        from vllm.v1.engine.core import EngineCoreProc

        run = EngineCoreProc.run_engine_core
    return run(*args, **kwargs)


def _leave_the_owners_group() -> None:
    """Put this process (an engine core) in a process group of its own, and watch its owner. Never raises: vLLM's
    engine core runs on (in its owner's group) where this fails."""
    import multiprocessing
    import signal

    try:
        parent = multiprocessing.parent_process()
        owner = parent.pid if parent is not None and parent.pid else os.getppid()
        os.setpgid(0, 0)
        # A background group that writes to a terminal set to `stty tostop` is stopped by SIGTTOU, unless it
        # ignores it (then the write goes through): the engine's log lines still reach the owner's terminal.
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
        _drop_what_came_to_the_owners_group()
        threading.Thread(target=_stop_when_the_owner_dies, args=(owner,), name="agentkv-owner", daemon=True).start()
    except Exception as exc:
        logger.warning("agentkv: the engine core stays in its owner's process group (%r)", exc)


def _drop_what_came_to_the_owners_group() -> None:
    """agentkv's owner makes an engine core with SIGINT and SIGTERM blocked (``stop_signals_blocked`` in
    ``src/agentkv/_engines/_spawn.py``): one sent to the owner's group while this process started (importing
    Python, multiprocessing, this plugin) waits, pending. It was not for this process: drop it (an ignored signal
    is discarded), then take them again."""
    import signal

    stops = {signal.SIGINT, signal.SIGTERM} & signal.pthread_sigmask(signal.SIG_BLOCK, [])
    for pending in stops & signal.sigpending():
        handler = signal.signal(pending, signal.SIG_IGN)
        signal.signal(pending, handler)
    if stops:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


def _stop_when_the_owner_dies(owner: int) -> None:
    """Wait until ``owner`` (this process's parent) is gone, then stop this engine core as vLLM stops it: SIGTERM
    (its requests are aborted, its workers stopped; they also follow it through vLLM's death pipe). A core still
    running `OWNERLESS_GRACE_S` later (stuck in a start-up handshake with the dead owner) exits."""
    import signal

    while os.getppid() == owner:  # an orphan is re-parented (to init or a subreaper): the owner is gone
        time.sleep(OWNER_POLL_S)
    logger.warning("agentkv: the process that started this engine (pid %d) is gone; the engine stops", owner)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(OWNERLESS_GRACE_S)
    os._exit(1)


def _idle_wait_s(core: Any, *, parked_poll_s: float) -> float | None:
    """How long an engine core that ran no model may wait for input before its next step (None: step now)."""
    if _only_parked_kv(core):
        core._agentkv_kv_wait_since = None
        return parked_poll_s
    if not _only_waiting_for_kv(core):
        core._agentkv_kv_wait_since = None
        return None
    now = time.monotonic()
    since = getattr(core, "_agentkv_kv_wait_since", None)
    if since is None:
        core._agentkv_kv_wait_since = since = now
    return KV_WAIT_POLL_S if now - since > KV_WAIT_BUSY_S else None


def _only_waiting_for_kv(core: Any) -> bool:
    """Nothing to run: every unfinished request waits for KV from a peer."""
    from vllm.v1.request import RequestStatus

    scheduler = core.scheduler
    if core.engines_running or core.batch_queue or scheduler.running or scheduler.finished_req_ids:
        return False
    if scheduler.finished_recving_kv_req_ids or scheduler.failed_recving_kv_req_ids:
        return False  # a request's KV has just arrived (or failed): the next step schedules it
    unfinished = [r for r in scheduler.requests.values() if not r.is_finished()]
    return bool(unfinished) and all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in unfinished)


def _shorten_worker_spin(spin_s: float) -> None:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    if getattr(SpinCondition, _PATCHED_MARK, None) is not None:
        return
    init = SpinCondition.__init__

    def init_with_short_spin(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = min(self.busy_loop_s, spin_s)

    init_with_short_spin.__wrapped__ = init  # type: ignore[attr-defined]
    SpinCondition.__init__ = init_with_short_spin  # type: ignore[method-assign]
    setattr(SpinCondition, _PATCHED_MARK, spin_s)


# ----------------------------------------------------------------- in agentkv's process


def stop_output_handler(llm: Any, *, timeout_s: float = 2.0) -> None:
    """Cancel an ``AsyncLLM``'s output-handler task and wait for it (from a thread not running its loop).

    ``AsyncLLM.shutdown`` stops the engine core first, which cancels the task that reads the core's
    socket; that task then queues an ``EngineDeadError``, and the output handler, cancelled only
    afterwards, often reads it first and logs "AsyncLLM output_handler failed" with a traceback.
    Call this just before ``llm.shutdown()``.
    """
    handler = getattr(llm, "output_handler", None)
    if handler is None or handler.done():
        return
    loop = handler.get_loop()
    if loop.is_closed():
        return
    loop.call_soon_threadsafe(handler.cancel)
    if getattr(loop, "_thread_id", None) == threading.get_ident():
        return  # called on the loop's own thread: the cancellation runs when it next gets control
    deadline = time.monotonic() + timeout_s
    while not handler.done() and loop.is_running() and time.monotonic() < deadline:
        time.sleep(0.01)


# ----------------------------------------------------------------- read-outs


def keep_prefill_stats(llm: Any, store: dict[str, Any]) -> bool:
    """Keep each request's ``EngineCoreOutput.prefill_stats`` in ``store`` by request id (one ``AsyncLLM``).

    vLLM 0.32 computes the local/external prefix-cache split per request but does not return it. False (and
    one warning) where the installed vLLM lacks what this needs (feature `PREFILL_STATS`): ``store`` stays empty.
    """
    return _apply(PREFILL_STATS, lambda: _keep_prefill_stats(llm, store))


def _keep_prefill_stats(llm: Any, store: dict[str, Any]) -> None:
    processor = llm.output_processor
    original = processor.process_outputs

    def process_outputs(engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        for output in engine_core_outputs:
            if output.prefill_stats is not None:
                # the engine core knows the request as "<our id>-<8 hex>" (InputProcessor.assign_request_id)
                store[output.request_id.rsplit("-", 1)[0]] = output.prefill_stats
        return original(engine_core_outputs, *args, **kwargs)

    process_outputs.__wrapped__ = original  # type: ignore[attr-defined]  # a later probe sees vLLM's parameters
    processor.process_outputs = process_outputs


def add_server_readouts(
    *,
    extras_field: str,
    extras: Callable[[Any], dict[str, Any]],
    stat_logger: Callable[..., Any],
    prefill_stats: dict[str, Any],
) -> None:
    """agentkv's API server: the read-outs on its ``AsyncLLM``, and ``extras_field`` on completions.

    Every ``/v1/completions`` response gets ``extras(output)`` under ``extras_field`` (feature
    `SERVER_READOUTS`); a streamed one ends with one more chunk (no choices) carrying the
    ``kv_transfer_params``, which vLLM 0.32 sends only in non-streamed responses (upstream PR #40186
    adds them to streams), and the extras too (feature `STREAMED_HANDLE`). Each feature is probed
    first and left off, with one warning, where the installed vLLM lacks its targets.
    """
    warn_if_untested()

    def add_readouts() -> None:
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.v1.engine.async_llm import AsyncLLM

        construct = AsyncLLM.from_vllm_config.__func__  # type: ignore[attr-defined]
        response_original = OpenAIServingCompletion.request_output_to_completion_response

        def from_vllm_config(cls: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["stat_loggers"] = [*(kwargs.get("stat_loggers") or []), stat_logger]
            llm = construct(cls, *args, **kwargs)
            keep_prefill_stats(llm, prefill_stats)
            return llm

        def request_output_to_completion_response(
            self: Any, final_res_batch: list[Any], *args: Any, **kwargs: Any
        ) -> Any:
            response = response_original(self, final_res_batch, *args, **kwargs)
            if len(final_res_batch) == 1:
                setattr(response, extras_field, extras(final_res_batch[0]))
            return response

        from_vllm_config.__wrapped__ = construct  # type: ignore[attr-defined]
        request_output_to_completion_response.__wrapped__ = response_original  # type: ignore[attr-defined]
        AsyncLLM.from_vllm_config = classmethod(from_vllm_config)  # type: ignore[method-assign,assignment]
        OpenAIServingCompletion.request_output_to_completion_response = request_output_to_completion_response  # type: ignore[method-assign]

    readouts = _apply(SERVER_READOUTS, add_readouts)
    _apply(STREAMED_HANDLE, lambda: _end_streams_with_the_handle(extras_field, extras if readouts else None))


def _end_streams_with_the_handle(extras_field: str, extras: Callable[[Any], dict[str, Any]] | None) -> None:
    """A streamed completion ends with one more chunk: D's ``kv_transfer_params``, and ``extras`` unless None."""
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    stream_original = OpenAIServingCompletion.completion_stream_generator

    async def completion_stream_generator(
        self: Any,
        request: Any,
        engine_inputs: Any,
        result_generator: AsyncIterator[Any],
        request_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> AsyncGenerator[str, None]:
        last: list[Any] = []

        async def watched() -> AsyncIterator[Any]:
            async for prompt_index, output in result_generator:
                last[:] = [output]
                yield prompt_index, output

        async for chunk in stream_original(self, request, engine_inputs, watched(), request_id, *args, **kwargs):
            if chunk.startswith("data: [DONE]") and last and last[0].finished:
                trailer = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": 0,
                    "model": request.model or "",
                    "choices": [],
                    "kv_transfer_params": last[0].kv_transfer_params,
                }
                if extras is not None:
                    trailer[extras_field] = extras(last[0])
                yield f"data: {json.dumps(trailer)}\n\n"
            yield chunk

    completion_stream_generator.__wrapped__ = stream_original  # type: ignore[attr-defined]
    OpenAIServingCompletion.completion_stream_generator = completion_stream_generator  # type: ignore[method-assign,assignment]
