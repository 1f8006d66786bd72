"""The torch releases autoddp knows: where something it relies on changed, and its verdict on each.

``_compat`` reads these to choose, per release, the one way that works there (never a silent
fallback); ``autoddp env`` prints the verdict. ``tests/core/test_compat.py`` checks each line on the
side of it that the installed torch is.
"""

from __future__ import annotations

import torch

#: Releases that changed what autoddp relies on (tests/core/test_compat.py checks each line, both sides).
LIBUV_LISTEN_FD = (2, 8)  # the libuv TCPStore takes a listening socket (pytorch#150215)
GROUP_FREED_WITHOUT_GIL = (2, 8)  # a ProcessGroup dropped from Python lets go of the GIL (#154976)
STORE_ERRORS_TYPED = (2, 10)  # DistNetworkError (2.6: RuntimeError; 2.7-2.9 unchecked, its base)
ACCELERATOR = (2, 6)  # torch.accelerator
GLOO_LAZY_INIT = (2, 8)  # gloo reads TORCH_GLOO_LAZY_INIT (pytorch#150801)
WEIGHTS_ONLY_SETS = (2, 6)  # torch.load(weights_only=True) takes a set (every Module pickles one)
TORCHRUN_SIGNALS = (2, 9)  # torchrun gives TORCHELASTIC_SIGNALS_TO_HANDLE (pytorch#160690)
FSDP2 = (2, 6)  # torch.distributed.fsdp.fully_shard
FSDP2_ON_CPU = (2, 7)  # torch.cpu.Stream.record_event, which FSDP2 calls on every device


def torch_at_least(release: tuple[int, int]) -> bool:
    """Whether the installed torch is ``release`` (major, minor) or newer (a pre-release counts)."""
    major, minor = torch.__version__.split(".")[:2]
    return (int(major), int(minor)) >= release


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string ("2.10.0+cu128": (2, 10)); default: this torch's."""
    major, minor = (version or torch.__version__).split(".")[:2]
    return int(major), int(minor)


#: The torch releases autoddp supports: each range's first release and what it lacks (None:
#: nothing), lowest first; the first is setup.cfg's floor. ``autoddp env`` says the verdict.
SUPPORTED = (
    ((2, 4), "strategy='fsdp' (FSDP2 needs torch >= 2.6 on GPUs, >= 2.7 on CPU)"),
    ((2, 6), "strategy='fsdp' on CPU/gloo (FSDP2 there needs torch >= 2.7)"),
    ((2, 7), None),
)
#: The newest release the suite runs on: a newer one is supported, but untested.
NEWEST_TESTED = (2, 15)


def support_verdict(version: str | None = None) -> str:
    """One line: whether autoddp supports torch ``version`` (default: this one) and what it lacks."""
    here, (floor, _) = release(version), SUPPORTED[0]
    if here < floor:
        return f"unsupported: autoddp needs torch >= {floor[0]}.{floor[1]}; upgrade torch"
    lacks = next(what for start, what in reversed(SUPPORTED) if here >= start)
    verdict = f"supported, without {lacks}" if lacks else "supported, every feature"
    if here > NEWEST_TESTED:
        verdict += f"; newer than {NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}, the newest tested"
    return verdict
