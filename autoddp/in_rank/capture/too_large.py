"""``model.to("cuda")`` of a model too large for one GPU: it waits in host memory to be sharded.

While capture runs on a rank with a GPU of its own, in a run that may shard (``strategy="auto"``
or ``"fsdp"``, more than one process, FSDP2 in this torch), ``Module.to`` and ``Module.cuda`` to
the own GPU weigh the bytes they would move (parameters and buffers not there yet, in the dtype
asked for) against what the process may use (``models.device_left``). Over it, the module stays
where it is, marked to be moved later (``models._placed_later``: FSDP2 moves each unit as it shards
it), and the notice says so at the user's line. Anything else (a module that fits, another
device, a dtype alone, a module already wrapped) is torch's own ``to``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core import _patches
from autoddp.core.memory.sizes import format_bytes
from autoddp.core.state import CURRENT, RunOptions
from autoddp.in_rank import models
from autoddp.in_rank.capture._notice import Notice, where
from autoddp.in_rank.capture._registry import user_site
from autoddp.in_rank.capture.devices import Devices

#: The strategies under which a model may be sharded (so need not fit one GPU whole).
_SHARDING = ("auto", "fsdp")


class TooLarge:
    """The ``Module.to``/``Module.cuda`` hooks of one capture session (none where nothing can shard)."""

    def __init__(self, devices: Devices, options: RunOptions, notice: Callable[[], Notice | None]) -> None:
        """``devices``: the session's device rule (the own GPU, the world known so far)."""
        self.world, self.own, self._remap = devices.world, devices.own, devices.device
        self.options = options
        self._notice = notice
        self._patches = _patches.Patches()

    def install(self) -> None:
        world = self.world
        if (
            self.own is None
            or world is None
            or world.world_size < 2
            or self.options.strategy not in _SHARDING
            or not models.can_shard(world)
        ):
            return
        patches = [(torch.nn.Module, "to", self._module_to), (torch.nn.Module, "cuda", self._module_cuda)]
        self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)

    def uninstall(self) -> None:
        self._patches.restore()

    def _module_to(self, original: Any) -> Any:
        def to(module: torch.nn.Module, /, *args: Any, **kwargs: Any) -> Any:
            asked = _device_and_dtype(args, kwargs)
            if asked is not None and self._deferred(module, *asked, original, sys._getframe(1)):
                return module
            return original(module, *args, **kwargs)

        return to

    def _module_cuda(self, original: Any) -> Any:
        def cuda(module: torch.nn.Module, /, device: Any = None) -> Any:
            if self._deferred(module, "cuda" if device is None else device, None, original, sys._getframe(1)):
                return module
            return original(module, device)

        return cuda

    def _deferred(
        self, module: torch.nn.Module, target: Any, dtype: torch.dtype | None, original: Any, frame: Any
    ) -> bool:
        """True where ``module`` was left in place to wait (after taking ``dtype``, if any)."""
        target = _on_gpu(self._remap(target), self.own)
        if target is None or target.index != self.own:
            return False  # (another device: torch's own to, and Devices' rule on its tensors)
        waiting = models.placement_pending(module)
        if waiting is not None:
            return waiting == target and dtype is None  # (sent there again: it waits still)
        if _wrapped(module):
            return False
        size = _bytes_moved(module, target, dtype)
        if size == 0:
            return False
        assert self.world is not None
        left = models.device_left(self.world, self.options, target)
        if left is None or size <= left:
            return False
        if dtype is not None:
            original(module, dtype)  # (the dtype now, on the host; the device when it is sharded)
        models.defer_placement(module, target, lambda m: original(m, target))
        notice = self._notice()
        if notice is not None:
            site = user_site(frame)
            notice.say(
                ("too_large", site),
                f"{type(module).__name__} to {target} ({where(site)}): its {format_bytes(size)} are more "
                f"than this process may use ({format_bytes(left)}), so it waits in host memory: sharded "
                "across the GPUs when its optimizer is made (each holds its shards, never the whole "
                "model), or moved whole at a forward before that, as asked",
            )
        return True


def _device_and_dtype(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.device, torch.dtype | None] | None:
    """``Module.to``'s device and dtype for the forms that name a device (None for the others:
    a dtype or a tensor alone, a memory format)."""
    if "memory_format" in kwargs or "tensor" in kwargs:
        return None
    rest = dict(kwargs)
    rest.pop("non_blocking", None)
    positional = list(args)
    device = rest.pop("device", None)
    if device is None and positional and isinstance(positional[0], (str, int, torch.device)):
        device = positional.pop(0)
    dtype = rest.pop("dtype", None)
    if dtype is None and positional and isinstance(positional[0], torch.dtype):
        dtype = positional.pop(0)
    if device is None or rest or len(positional) > 1 or (positional and not isinstance(positional[0], bool)):
        return None
    return device, dtype


def _on_gpu(device: Any, own: int | None) -> torch.device | None:
    """``device`` (an index, a string, a torch.device: read by Devices' rule already) as the GPU it
    names (``"cuda"``: the current one, which is the own one), or None for any other."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    try:
        named = torch.device(device)
    except (RuntimeError, TypeError):
        return None
    if named.type != "cuda":
        return None
    return named if named.index is not None else torch.device("cuda", own)


def _wrapped(module: torch.nn.Module) -> bool:
    return models.distributed(module) or any(module is m for m in CURRENT.wrapped_models())


def _bytes_moved(module: torch.nn.Module, target: torch.device, dtype: torch.dtype | None) -> int:
    """The bytes of ``module``'s parameters and buffers not on ``target`` yet, in ``dtype`` where
    given (floating-point ones, as ``Module.to`` converts them)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in seen or tensor.device == target or tensor.is_meta:
            continue
        seen.add(id(tensor))
        size = dtype.itemsize if dtype is not None and tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * size
    return total
