"""What this machine offers a run: visible GPUs, usable CPU cores, each rank's device and threads.

A leaf module: probes only, nothing here initialises CUDA (so fork stays usable) or writes the
environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import torch


def gpu_count() -> int:
    """Visible CUDA GPUs, counted without initialising CUDA (so fork stays usable)."""
    if not torch.backends.cuda.is_built():
        return 0
    return torch.cuda.device_count()


def cpu_count() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def default_device(local_rank: int) -> str:
    """``cuda:<local_rank>`` when that GPU is visible, else the CPU."""
    return f"cuda:{local_rank}" if gpu_count() > local_rank else "cpu"


def task_device(local_rank: int) -> str:
    """The GPU of a task a scheduler started: ``cuda:<local_rank % visible GPUs>``, else the CPU.

    With every GPU of the node visible this is ``cuda:<local_rank>``; with per-task binding
    (``--gpus-per-task``, ``--gpu-bind``) each task sees only its share, counted from 0.
    """
    gpus = gpu_count()
    return f"cuda:{local_rank % gpus}" if gpus else "cpu"


#: ``CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`` of CUDA's driver API.
_COMPUTE_MODE_ATTRIBUTE = 20


def cuda_contexts(library: str = "libcuda.so.1") -> dict[int, tuple[int, bool]]:
    """``{gpu: (compute mode, whether this process holds its primary context)}``; {} before CUDA starts.

    Asked of CUDA's driver only where torch has initialised CUDA in this process already: the
    driver is loaded then, and these queries create no context (``cuDeviceGetAttribute``,
    ``cuDevicePrimaryCtxGetState``). Before that, nothing is asked, so fork stays usable.
    """
    if not torch.cuda.is_initialized():
        return {}
    import ctypes

    try:
        driver = ctypes.CDLL(library)
    except OSError:
        return {}
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return {}
    states: dict[int, tuple[int, bool]] = {}
    for ordinal in range(count.value):
        device, mode = ctypes.c_int(0), ctypes.c_int(0)
        flags, active = ctypes.c_uint(0), ctypes.c_int(0)
        if (
            driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0
            and driver.cuDeviceGetAttribute(ctypes.byref(mode), _COMPUTE_MODE_ATTRIBUTE, device) == 0
            and driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
        ):
            states[ordinal] = (mode.value, bool(active.value))
    return states


def omp_threads(nproc: int, environ: Mapping[str, str] | None = None) -> str | None:
    """``OMP_NUM_THREADS`` for workers sharing this machine: cores // processes, or None if set.

    The user's own setting always wins (None then: nothing to set). Without it, N processes each
    running torch's default of one thread per core would oversubscribe the cores N times.
    """
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:
        return None
    return str(max(1, cpu_count() // max(nproc, 1)))


def return_freed_memory_at_once() -> bool:
    """Have glibc give large freed blocks back to the system (a fixed mmap threshold of 64 KiB).

    FSDP allocates and frees every unit's full parameters and gradients each step; on the CPU,
    glibc's adaptive threshold then keeps them in the heap and the process holds more than
    replicated training would (measured in ``benchmarks/memory.py``). Linux with glibc only;
    returns whether the setting took.
    """
    return _mallopt((_M_MMAP_THRESHOLD, 64 * 1024))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt`` for each (parameter, value), in order; whether all took (Linux, glibc)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return all(bool(libc.mallopt(parameter, value)) for parameter, value in settings)


#: glibc's own upper bounds for its adaptive thresholds on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, and
#: twice it for trimming): where ``keep_freed_memory`` fixes them.
KEPT_MMAP_THRESHOLD = 32 * 2**20
KEPT_TRIM_THRESHOLD = 2 * KEPT_MMAP_THRESHOLD


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Have glibc keep a CPU training step's freed activations in the heap for the next step.

    Left adaptive, glibc raises its mmap threshold only to the largest block freed so far (a few
    MiB for a small model) and trims the heap's top whenever more than twice that is free: a step
    that frees more (its activations and gradients) gives their pages back to the kernel and
    faults every one in again the next step, in some runs and not others (up to a quarter of the
    step's CPU time in ``benchmarks/epoch_time.py``, under torchrun as much as under autoddp).
    Fixed at glibc's own bounds (blocks under 32 MiB from the heap, trimmed beyond 64 MiB free),
    the heap holds at most 64 MiB more than it uses. Never over the user's own ``MALLOC_*`` or
    ``GLIBC_TUNABLES`` malloc settings; Linux with glibc only; returns whether the setting took.
    """
    environ = os.environ if environ is None else environ
    if any(name.startswith("MALLOC_") for name in environ) or "glibc.malloc" in environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return False
    # (the mmap threshold first: fixing either turns glibc's adaptation off)
    return _mallopt((_M_MMAP_THRESHOLD, KEPT_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, KEPT_TRIM_THRESHOLD))
