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
        self._placed = 0  # bytes this process's code moved to its GPU whole so far
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
        patches = [
            (torch.nn.Module, "to", self._module_to),
            (torch.nn.Module, "cuda", self._module_cuda),
            (torch.nn.Module, "cpu", self._module_cpu),
        ]
        self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)

    def uninstall(self) -> None:
        self._patches.restore()

    def _module_to(self, original: Any) -> Any:
        def to(module: torch.nn.Module, /, *args: Any, **kwargs: Any) -> Any:
            asked = _parse_to(args, kwargs)
            if asked is not None:
                if self._deferred(module, *asked, original, sys._getframe(1)):
                    return module
                if _on_gpu(self._remap(asked[0]), self.own) is None:  # (to the host: nothing of it waits)
                    models.placement_cancelled(module)
            return original(module, *args, **kwargs)

        return to

    def _module_cuda(self, original: Any) -> Any:
        def cuda(module: torch.nn.Module, /, device: Any = None) -> Any:
            if self._deferred(module, "cuda" if device is None else device, {}, original, sys._getframe(1)):
                return module
            return original(module, device)

        return cuda

    def _module_cpu(self, original: Any) -> Any:
        def cpu(module: torch.nn.Module, /) -> Any:
            models.placement_cancelled(module)
            return original(module)

        return cpu

    def _deferred(
        self, module: torch.nn.Module, device: Any, host: dict[str, Any], original: Any, frame: Any
    ) -> bool:
        """True where ``module`` was left in place to wait (after taking ``host``'s dtype or memory
        format, if any, on the host)."""
        target = _on_gpu(self._remap(device), self.own)
        if target is None or target.index != self.own:
            return False  # (another device: torch's own to, and Devices' rule on its tensors)
        waiting = models.placement_pending(module)
        if waiting is not None:  # sent there again: it waits still
            if host:
                original(module, **host)
            return True
        if _wrapped(module):
            return False
        size = _bytes_moved(module, target, host.get("dtype"))
        if size == 0:
            return False
        assert self.world is not None
        left = models.device_left(self.world, self.options, target, placed=self._placed)
        if left is None:
            return False
        if size <= left:
            self._placed += size
            return False
        if host:
            original(module, **host)  # (now, on the host; the device when it is sharded)
        models.defer_placement(module, target, lambda m: original(m, target))
        notice = self._notice()
        if notice is not None:
            site = user_site(frame)
            notice.say(
                ("too_large", site),
                f"{type(module).__name__} to {target} ({where(site)}): its {format_bytes(size)} are more "
                f"than this process may still use ({format_bytes(left)}), so it waits in host memory: "
                "sharded across the GPUs when its "
                "optimizer is made (each holds its shards, never the whole model), or moved whole at a "
                "forward before that, as asked. Its parameters show the host meanwhile: place the data "
                "with device='cuda' (or autoddp.device()), not with the parameters' device",
            )
        return True


def _parse_to(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]] | None:
    """``Module.to``'s device and what it also asks of the host (``dtype``, ``memory_format``), for
    the forms that name a device or a tensor (None for the others: a dtype alone)."""
    rest = dict(kwargs)
    for name in ("non_blocking", "copy"):
        rest.pop(name, None)
    positional = list(args)
    device, dtype = rest.pop("device", None), rest.pop("dtype", None)
    memory_format, tensor = rest.pop("memory_format", None), rest.pop("tensor", None)
    if positional and isinstance(positional[0], torch.Tensor):
        tensor = positional.pop(0)
    if tensor is not None:
        device, dtype = tensor.device, tensor.dtype
    elif device is None and positional and _names_device(positional[0]):
        device = positional.pop(0)
    if dtype is None and positional and (positional[0] is None or isinstance(positional[0], torch.dtype)):
        dtype = positional.pop(0)
    if positional and isinstance(positional[0], bool):
        positional.pop(0)  # (non_blocking)
    if device is None or rest or positional:
        return None
    host = {"dtype": dtype, "memory_format": memory_format}
    return device, {name: value for name, value in host.items() if value is not None}


def _names_device(value: Any) -> bool:
    return isinstance(value, (str, int, torch.device)) and not isinstance(value, bool)


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
