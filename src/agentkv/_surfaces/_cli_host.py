"""``agentkv engine``, ``agentkv smoke`` and ``agentkv models``: what runs on this host itself. One server of a P/D
pair in the foreground, the pair's check on this host (src/agentkv/_surfaces/_smoke.py), the bundled models."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import get_args

from .._engines._pair_config import Transfer
from .._engines._platforms import current_platform
from .._errors import UserError
from .._model import list_models, prepare_model
from ._cli_options import Commands, add_command, add_device_arguments, add_model_argument, add_vllm_command, cores
from ._cli_pairs import add_engine_choice

__all__ = ["add_host_commands"]


def add_host_commands(commands: Commands) -> None:
    """``engine``, ``smoke`` and ``models``."""
    engine = add_vllm_command(
        commands,
        "engine",
        _engine_server,
        options="--role {prefill,decode} --nixl-host NIXL_HOST [options]",
        epilog=". On a GPU host the server runs on the GPUs of --prefill-devices or --decode-devices (the one of its "
        "role), else on those CUDA_VISIBLE_DEVICES leaves it, its tensor-parallel size their number",
    )
    engine.add_argument("--role", choices=("prefill", "decode"), required=True)
    add_model_argument(engine)
    engine.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all)")
    engine.add_argument("--port", type=int, default=8100)
    engine.add_argument("--nixl-host", required=True, help="this host's address as the peer server reaches it")
    engine.add_argument("--nixl-port", type=int, default=5600, help="NIXL side-channel port")
    engine.add_argument(
        "--cores", type=cores, default=None, help="cores for the engine, e.g. 0-3,6 (default: all available; CPU)"
    )
    add_device_arguments(engine, one_server=True)
    engine.add_argument("--max-model-len", type=int, default=4096)
    engine.add_argument("--kv-cache-gib", type=float, default=4.0)
    engine.add_argument("--pin-ttl-s", type=float, default=480.0)
    engine.add_argument(
        "--no-push-back", action="store_true", help="standard disaggregated: D keeps no KV for P to pull back"
    )
    engine.add_argument(
        "--transfer", choices=get_args(Transfer), default="pull", help="the connector: pull (default) or push"
    )
    engine.add_argument("--no-prefix-cache", action="store_true", help="a prefill server without its own prefix cache")

    smoke = add_vllm_command(
        commands,
        "smoke",
        _smoke,
        epilog=" (for smoke: of both engines of the pair). Exit status 0 when every check passed, 1 when one "
        "failed (the report says which). docs/gpu.md",
    )
    add_model_argument(smoke)
    add_engine_choice(smoke)
    smoke.add_argument("--max-model-len", type=int, default=4096)
    smoke.add_argument("--turns", type=_smoke_turns, default=3, help="turns of the conversation, 2 or more (default 3)")
    smoke.add_argument(
        "--mode",
        choices=("bidirectional", "auto"),
        default="bidirectional",
        help="auto: the pair may place steps on D alone (they reuse D's cache instead of pulling)",
    )
    add_device_arguments(smoke)

    models = add_command(commands, "models", _models)
    models.add_argument("action", nargs="?", choices=("list", "prepare"), default="list")
    models.add_argument("name", nargs="?", default=None)


def _smoke_turns(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (pull-back starts at turn 2), not {value}")
    return value


def _smoke(args: argparse.Namespace) -> int:
    """open a pair on this host (CPU or GPUs) and check 3 turns with a tool: turns 2+ pull KV back from D"""
    from ._smoke import smoke_command

    return smoke_command(
        model=args.model,
        engine=args.engine,
        max_model_len=args.max_model_len,
        turns=args.turns,
        prefill_devices=args.prefill_devices,
        decode_devices=args.decode_devices,
        engine_args=args.engine_args,
        mode=args.mode,
    )


def _engine_server(args: argparse.Namespace) -> int:
    """run one server of a P/D pair in the foreground (for a pair across hosts: RemotePair)"""
    import socket
    import uuid

    from .._engines._engine_launch import pair_engine_launch
    from .._engines._pair_config import PairConfig
    from .._engines._platforms import PairDevices, resolve_devices
    from .._engines._server_process import ServerSpec, server_command, server_env

    config = PairConfig(
        push_back=not args.no_push_back,
        transfer=args.transfer,
        prefill_prefix_cache=not args.no_prefix_cache,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        pin_ttl_s=args.pin_ttl_s,
        engine_args=args.engine_args,
    )
    platform = current_platform()  # before the model: a host vLLM finds no platform on fails in seconds
    gpus: PairDevices | None = None
    given = {"prefill": args.prefill_devices, "decode": args.decode_devices}
    other = "decode" if args.role == "prefill" else "prefill"
    if given[other] is not None:
        raise UserError(f"--{other}-devices names the GPUs of the {other} server; this one runs --role {args.role}")
    if not platform.pins_cores:  # a GPU host: the devices given, else those its environment leaves it
        if args.cores is not None:
            raise UserError(
                "--cores binds the engine's threads on vLLM's CPU platform; on a GPU host choose "
                f"the server's GPUs with --{args.role}-devices (or CUDA_VISIBLE_DEVICES)"
            )
        mine = platform.visible_devices
        if given[args.role] is not None:
            mine = resolve_devices(platform, given[args.role], f"--{args.role}-devices")
        gpus = PairDevices(prefill=mine) if args.role == "prefill" else PairDevices(decode=mine)
    elif given[args.role] is not None:
        raise UserError(f"--{args.role}-devices chooses GPUs; this host runs vLLM's CPU platform (use --cores)")
    launch = pair_engine_launch(
        config,
        args.role,
        model_path=prepare_model(args.model, progress=print),
        cores=args.cores,
        engine_id=f"agentkv-{args.role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        side_channel_port=args.nixl_port,
        nixl_host=args.nixl_host,
        platform=platform,
        devices=gpus,
    )
    spec = ServerSpec(role=args.role, launch=launch, host=args.host, port=args.port)
    command = server_command(spec)
    print(
        f"agentkv engine: {args.role} server on http://{args.host}:{args.port}, NIXL at {args.nixl_host}:{args.nixl_port}"
    )
    sys.stdout.flush()
    os.execvpe(command[0], command, {**os.environ, **server_env(spec)})


def _models(args: argparse.Namespace) -> int:
    """list the bundled models, or prepare one"""
    if args.action == "prepare":
        print(prepare_model(args.name, progress=print))
        return 0
    print(json.dumps(list_models(), indent=2))
    return 0
