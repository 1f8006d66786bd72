"""The gloo group beside NCCL on GPUs connects only to the ranks it exchanges with, when it first does.

``"cpu:gloo,cuda:nccl"`` gives every GPU run a gloo group for CPU tensors (autoddp's object
collectives, the user's CPU metrics). Made eagerly, gloo connects every rank to every other at
init: N-1 sockets per rank, N^2/2 connections in all, each through ``GLOO_SOCKET_IFNAME``'s
interface, before the first step, even when nothing uses it. ``TORCH_GLOO_LAZY_INIT=1`` (torch
2.13) makes a pair's connection on its first use instead (``benchmarks/gloo_lazy_init.py``
measures both). The launcher sets it in its GPU workers' environment unless the user set it.
"""

from __future__ import annotations

from collections.abc import Mapping

LAZY = "TORCH_GLOO_LAZY_INIT"


def side_gloo_variables(environ: Mapping[str, str], gpus: int) -> dict[str, str]:
    """``TORCH_GLOO_LAZY_INIT=1`` for the workers of a GPU run, unless the user chose; else nothing."""
    if gpus <= 0 or LAZY in environ:
        return {}
    return {LAZY: "1"}
