"""What gloo's connection set-up costs at N ranks, with and without ``TORCH_GLOO_LAZY_INIT``.

``python benchmarks/gloo_lazy_init.py 32 64`` forks N processes on this machine (from a parent
that imported torch, so they share its memory), each making a real gloo group over one TCPStore,
and prints per world size and mode: the slowest rank's init time, the TCP sockets a rank holds
after init, after an all-reduce of a CPU tensor and after an object all-gather, and the time of
those first collectives. Issue 20 item 8: the gloo group beside NCCL connects all-to-all (N-1
sockets per rank, N^2/2 in all) at init unless gloo is lazy.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def _sockets() -> int:
    """TCP/Unix sockets this process holds (its open file descriptors that are sockets)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def _rank(rank: int, size: int, port: int, lazy: bool, out: multiprocessing.Queue) -> None:
    if lazy:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    else:
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timeout)
    before = _sockets()
    start = time.perf_counter()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    init = time.perf_counter() - start
    after_init = _sockets() - before
    start = time.perf_counter()
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    reduce_s = time.perf_counter() - start
    after_reduce = _sockets() - before
    start = time.perf_counter()
    gathered: list = [None] * size
    dist.all_gather_object(gathered, rank)
    gather_s = time.perf_counter() - start
    after_gather = _sockets() - before
    assert tensor.item() == size and gathered == list(range(size))
    dist.barrier()
    dist.destroy_process_group()
    out.put((init, after_init, reduce_s, after_reduce, gather_s, after_gather))


def measure(size: int, lazy: bool) -> dict:
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=_rank, args=(r, size, port, lazy, out)) for r in range(size)]
    for proc in procs:
        proc.start()
    rows = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join()
    init, sockets, reduce_s, after_reduce, gather_s, after_gather = zip(*rows, strict=True)
    return {
        "ranks": size,
        "lazy": lazy,
        "init_s_max": round(max(init), 3),
        "sockets_after_init_max": max(sockets),
        "first_all_reduce_s_max": round(max(reduce_s), 3),
        "sockets_after_all_reduce_max": max(after_reduce),
        "first_object_gather_s_max": round(max(gather_s), 3),
        "sockets_after_object_gather_max": max(after_gather),
    }


def main(sizes: list[int]) -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU(s)")
    for size in sizes:
        for lazy in (False, True):
            print(json.dumps(measure(size, lazy)), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8, 32, 64])
