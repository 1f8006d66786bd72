"""Single-GPU device habits on every rank: the GPU the user's code names becomes the own GPU.

A plain single-GPU script says ``torch.device("cuda:0")``, ``torch.cuda.set_device(0)``, wraps its
model in ``nn.DataParallel``, ``torch.load``s a checkpoint saved from cuda:0. Run N times, each of
those would put rank r's work on GPU 0. While capture runs, these few entry points read the index
the user names through ``world.placement.own_index`` (0 or the rank's ``LOCAL_RANK``: the own GPU;
another rank's: a clear error): ``torch.cuda.set_device``, ``torch.cuda.device``, ``Tensor.to`` and
``Tensor.cuda`` (``Module.to``/``.cuda`` go through them), ``torch.load``'s ``map_location`` (a
checkpoint's CUDA storages restore on the own GPU; the user's own ``map_location`` is respected,
its CUDA targets read the same way) and ``nn.DataParallel`` (on the own GPU only:
``device_ids=[own]``, ``.module`` kept). Nothing per operation: factory functions' ``device=`` is not
read (``device='cuda'``, which the pinned current device makes the own GPU, is the way there).

The mechanism keeps every GPU visible to every process (no per-process ``CUDA_VISIBLE_DEVICES``),
so NCCL keeps its peer-to-peer (NVLink, CUDA IPC) paths between the ranks' GPUs, and code that says
``set_device(int(os.environ["LOCAL_RANK"]))`` keeps working.
"""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Callable
from typing import Any

import torch

from autoddp.core import _compat, _patches
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import World
from autoddp.in_rank.capture._notice import Notice, where
from autoddp.in_rank.capture._registry import user_site
from autoddp.in_rank.world import placement


class Devices:
    """The device hooks of one capture session (none where this process has no GPU of its own)."""

    def __init__(self, world: World | None, notice: Callable[[], Notice | None]) -> None:
        self.world = world
        self.own = None if world is None else placement.own_gpu(world, torch.cuda.device_count())
        self._notice = notice
        self._patches = _patches.Patches()

    def install(self) -> None:
        if self.own is None or self._patches.installed:
            return
        patches: list[tuple[Any, str, Callable[[Any], Any]]] = [(torch.cuda, "set_device", self._set_device)]
        accelerator = _compat.accelerator()  # (None before torch 2.6)
        for name in ("set_device_index", "set_device_idx"):  # (imagenet/main.py's way)
            if accelerator is not None and hasattr(accelerator, name):
                patches.append((accelerator, name, self._set_device))
        for names, strict in ((_WORKING_ON, True), (_READING, False)):  # synchronize(0), memory_allocated(0)
            for name in names:
                if hasattr(torch.cuda, name):
                    patches.append((torch.cuda, name, functools.partial(self._device_first, strict=strict)))
        patches.append((torch.cuda.device, "__init__", self._device_context))
        # torch.set_default_device("cuda:0") and `with torch.device("cuda:0"):` both make one
        patches.append((_compat.device_context(), "__init__", self._device_context))
        patches.append((torch.Tensor, "to", self._tensor_to))  # inherited: deleted again at the end
        patches.append((torch.Tensor, "cuda", self._tensor_cuda))
        for storage in (torch.UntypedStorage, torch.TypedStorage):  # map_location=lambda s, l: s.cuda(0)
            patches.append((storage, "cuda", self._tensor_cuda))
        patches.append((torch.nn.Module, "to_empty", self._to_empty))  # a meta-built model's weights
        patches += [(owner, "load", self._load) for owner in (torch, torch.serialization)]
        patches.append((torch.nn.DataParallel, "__init__", self._data_parallel))
        self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)

    def uninstall(self) -> None:
        self._patches.restore()

    # --- the rule -----------------------------------------------------------------------------

    def device(self, device: Any) -> Any:
        """``device`` (an index, ``"cuda:k"``, a torch.device) with the GPU it means on this rank."""
        assert self.own is not None and self.world is not None
        if isinstance(device, numbers.Integral) and not isinstance(device, bool):  # NumPy's too
            # (-1: no device, as torch.cuda.device_of says for a CPU tensor)
            return device if device < 0 else placement.own_index(int(device), self.own, self.world)
        if type(device) is str:
            if not device.startswith("cuda:") or not device[5:].isdigit():
                return device  # "cuda", "cpu", or one torch refuses as it would
            index = placement.own_index(int(device[5:]), self.own, self.world)
            return device if index == int(device[5:]) else f"cuda:{index}"
        if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
            index = placement.own_index(device.index, self.own, self.world)
            return device if index == device.index else torch.device("cuda", index)
        return device

    def map_location(self, given: Any) -> Any:
        """torch.load's ``map_location``: CUDA storages on the own GPU, the user's choice read likewise."""
        assert self.own is not None
        own_gpu = placement.restore_cuda_on(self.own)
        if given is None:
            return own_gpu
        if isinstance(given, (str, torch.device)):
            return self.device(given)
        if isinstance(given, dict):
            chosen = {key: self.device(value) for key, value in given.items()}

            def restore(storage: Any, location: str) -> Any:
                if location in chosen:  # the user's target, read by the rule
                    return _at(storage, chosen[location])
                return own_gpu(storage, location)  # a checkpoint's own CUDA tag: the own GPU

            return restore
        if callable(given):
            own_location = f"cuda:{self.own}"

            def theirs(storage: Any, location: str) -> Any:
                result = given(storage, own_location if location.startswith("cuda") else location)
                return result if result is not None else own_gpu(storage, location)

            return theirs
        return given

    def _say(self, key: object, line: str) -> None:
        notice = self._notice()
        if notice is not None:
            notice.say(key, line)

    # --- the hooks ----------------------------------------------------------------------------

    def _set_device(self, original: Any) -> Any:
        def set_device(device: Any) -> None:
            original(self.device(device))

        return set_device

    def _device_first(self, original: Any, strict: bool) -> Any:
        def call(device: Any = None, *args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                device = kwargs.pop("device")
            if device is not None:
                try:
                    device = self.device(device)
                except ConfigurationError:
                    if strict:  # (work there would make a context on another process's GPU)
                        raise
                    # a question about another GPU (a monitor's loop over all of them) is answered
            return original(device, *args, **kwargs)

        return call

    def _to_empty(self, original: Any) -> Any:
        def to_empty(module: torch.nn.Module, /, *, device: Any, recurse: bool = True) -> Any:
            return original(module, device=self.device(device), recurse=recurse)

        return to_empty

    def _device_context(self, original: Any) -> Any:
        def __init__(context: Any, /, device: Any) -> None:
            original(context, self.device(device))

        return __init__

    def _tensor_to(self, original: Any) -> Any:
        remap = self.device

        def to(tensor: torch.Tensor, /, *args: Any, **kwargs: Any) -> Any:
            if args and type(args[0]) is not torch.dtype and not isinstance(args[0], torch.Tensor):
                args = (remap(args[0]), *args[1:])
            if "device" in kwargs:
                kwargs["device"] = remap(kwargs["device"])
            return original(tensor, *args, **kwargs)

        return to

    def _tensor_cuda(self, original: Any) -> Any:
        remap = self.device

        def cuda(tensor: torch.Tensor, /, *args: Any, **kwargs: Any) -> Any:
            if args:  # (Tensor.cuda is a builtin without a signature: its device comes first)
                args = (remap(args[0]), *args[1:])
            elif "device" in kwargs:
                kwargs["device"] = remap(kwargs["device"])
            return original(tensor, *args, **kwargs)

        return cuda

    def _load(self, original: Any) -> Any:
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if args:
                args = (self.map_location(args[0]), *args[1:])
            else:
                kwargs["map_location"] = self.map_location(kwargs.get("map_location"))
            return original(f, *args, **kwargs)

        return load

    def _data_parallel(self, original: Any) -> Any:
        def __init__(
            parallel: Any, /, module: Any, device_ids: Any = None, output_device: Any = None, dim: int = 0
        ) -> None:
            own = self.own
            site = user_site(sys._getframe(1), made=parallel)
            self._say(
                ("data_parallel", site),
                f"nn.DataParallel ({where(site)}): on this process's own GPU only (device_ids=[{own}]): "
                "every process has one GPU, and DDP averages the gradients across them",
            )
            original(parallel, module, device_ids=[own], output_device=own, dim=dim)

        return __init__


def _at(storage: Any, location: Any) -> Any:
    from torch.serialization import default_restore_location

    return default_restore_location(storage, str(location))


#: torch.cuda functions whose first argument names a GPU (``None``: the current one): those that
#: work on it (a context there), and those that only read about it.
_WORKING_ON = ("synchronize", "mem_get_info")
_READING = (
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
    "get_device_name",
    "get_device_properties",
    "get_device_capability",
)
