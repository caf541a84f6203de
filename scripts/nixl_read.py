"""How long one NIXL read of a KV block takes between two processes on this host: the fixed cost under a pull.

    .venv/bin/python scripts/nixl_read.py                  # one 128-token block of the bundled model, float32
    .venv/bin/python scripts/nixl_read.py --block-size 32 --reads 400

A pull in vLLM's NIXL connector is one READ per step: from every layer's K and V cache, the
blocks the step lacks, with a notification that tells the peer its blocks were read. This
script times that shape alone, with no engine around it: a second process registers
``layers x 2`` buffers of ``--blocks`` blocks (the peer's KV cache), this one registers the
same, and reads one block from each buffer in one transfer, ``--reads`` times, a pause between
reads as between an agent's steps. The agents are made as vLLM's connector makes them (the UCX
backend, its worker threads, a progress thread); ``--no-progress-thread`` runs this side's
agent without one (``--peer-without-progress-thread`` the peer's). It prints the read's size and its time from the post to the status DONE
(the median, the 90th percentile and the fastest), as one JSON line.

The defaults are the bundled model's (SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 on a
CPU) at vLLM's CPU block of 128 tokens. Run it on an idle machine (not beside engines): on two
cores, a third busy thread is enough to put a scheduler slice into the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any

import numpy as np


def _agent(name: str, *, progress_thread: bool) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config  # pyright: ignore[reportMissingImports]

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, num_threads=4))


def _caches(layers: int, blocks: int, block_bytes: int) -> list[np.ndarray]:
    return [np.ones(blocks * block_bytes, dtype=np.uint8) for _ in range(2 * layers)]


def _peer(sent: Any, done: Any, layers: int, blocks: int, block_bytes: int, progress_thread: bool) -> None:
    """The peer (D): its caches registered, its agent's metadata sent, idle until told to stop."""
    agent = _agent("peer", progress_thread=progress_thread)
    caches = _caches(layers, blocks, block_bytes)
    agent.register_memory([(c.ctypes.data, c.nbytes, 0, "") for c in caches], "DRAM")
    sent.put((agent.get_agent_metadata(), [c.ctypes.data for c in caches]))
    done.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=128, help="tokens per block (default 128, vLLM's on a CPU)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype-bytes", type=int, default=4, help="bytes per value (4: float32, 2: bfloat16)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks per cache; the reads cycle through them")
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--pause-s", type=float, default=0.05, help="pause between reads")
    parser.add_argument("--no-progress-thread", action="store_true", help="this side's agent without one")
    parser.add_argument("--peer-without-progress-thread", action="store_true", help="the peer's agent without one")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="give up on a read after this long")
    args = parser.parse_args()
    block_bytes = args.block_size * args.kv_heads * args.head_dim * args.dtype_bytes

    context = multiprocessing.get_context("spawn")
    sent, done = context.Queue(), context.Queue()
    peer_threaded = not args.peer_without_progress_thread
    peer = context.Process(target=_peer, args=(sent, done, args.layers, args.blocks, block_bytes, peer_threaded))
    peer.start()
    try:
        agent = _agent("reader", progress_thread=not args.no_progress_thread)
        caches = _caches(args.layers, args.blocks, block_bytes)
        agent.register_memory([(c.ctypes.data, c.nbytes, 0, "") for c in caches], "DRAM")
        metadata, remote = sent.get(timeout=60)
        peer_name = agent.add_remote_agent(metadata)
        per_block = [
            [(start + b * block_bytes, block_bytes, 0) for start in starts for b in range(args.blocks)]
            for starts in ([c.ctypes.data for c in caches], remote)
        ]
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", per_block[0], "DRAM")
        far = agent.prep_xfer_dlist(peer_name, per_block[1], "DRAM")
        times = []
        for read in range(args.reads + 3):  # the first reads connect: left out
            indices = [cache * args.blocks + read % args.blocks for cache in range(len(caches))]
            started = time.perf_counter()
            handle = agent.make_prepped_xfer("READ", local, indices, far, indices, b"read")
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR") and time.perf_counter() - started < args.timeout_s:
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise SystemExit(
                    f"read {read + 1}: {'failed' if state == 'ERR' else f'not done after {args.timeout_s} s'}"
                )
            times.append(time.perf_counter() - started)
            agent.release_xfer_handle(handle)
            time.sleep(args.pause_s)
        times = sorted(times[3:])
        sys.stdout.write(
            json.dumps(
                {
                    "block_size": args.block_size,
                    "descriptors": len(caches),
                    "bytes": len(caches) * block_bytes,
                    "progress_thread": not args.no_progress_thread,
                    "peer_progress_thread": peer_threaded,
                    "reads": len(times),
                    "p50_ms": round(1e3 * statistics.median(times), 3),
                    "p90_ms": round(1e3 * times[int(0.9 * len(times))], 3),
                    "min_ms": round(1e3 * times[0], 3),
                }
            )
            + "\n"
        )
    finally:
        done.put(None)
        peer.join(timeout=30)


if __name__ == "__main__":
    main()
