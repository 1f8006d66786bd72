"""The FSDP strategy: PyTorch's FSDP2 (``fully_shard``) with the units chosen by autoddp.

Each rank holds only a share of every parameter, its gradients and optimizer state. Which
submodules get their own ``fully_shard`` (``units``): the classes named by ``fsdp_blocks``, else the
outermost classes that repeat (a transformer's blocks), else children holding a large share of
the parameters; then the root. FSDP2 swaps the module's class for ``FSDP<Class>`` (a subclass of
the user's: ``isinstance`` holds, keys stay plain); autoddp adds one more subclass on top whose
``load_state_dict`` also takes a full plain state dict (scattered to the shards). A meta-device
copy of the module made before sharding rebuilds the plain, unsharded model for the caller.
Values the user's code reads from the sharded weights are the full tensor's (``_reads``).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from autoddp.core import _class_swap, _compat, _warn
from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank.models import _deferral, _reads, _start

#: The strategy's name (``strategy="fsdp"``), kept on the class of each model it shards.
NAME = "fsdp"
_SKELETON = "_autoddp_skeleton"
#: A child holding at least this share of the parameters gets its own unit when nothing repeats.
_LARGE_CHILD = 0.2
_PRECISIONS = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}

#: Said when a model is sharded with mixed_precision="fp16".
_FP16_NOTE = (
    "mixed_precision='fp16' computes in float16, whose small gradients underflow to zero unless the "
    "loss is scaled: use torch.amp.GradScaler as on one GPU (scaler.scale(loss).backward(); "
    "scaler.step(opt); scaler.update(); it works on the sharded gradients, every rank skipping the "
    "same steps), or mixed_precision='bf16', which needs no scaling"
)


def fsdp_api(device_type: str | None = None) -> Any:
    """``torch.distributed.fsdp`` with FSDP2 (on ``device_type``: "cpu" needs a newer torch than
    GPUs), or a ConfigurationError naming the torch it needs."""
    needed = _compat.fsdp2_release(device_type)
    if needed is not None:
        on = " on CPU (gloo)" if needed == _compat.releases.FSDP2_ON_CPU else ""
        raise ConfigurationError(
            f"strategy='fsdp' needs FSDP2 (torch.distributed.fsdp.fully_shard){on}, which works from "
            f"torch {'.'.join(map(str, needed))}; this is torch {torch.__version__}. Upgrade torch "
            f"(pip install 'torch>={'.'.join(map(str, needed))}'), or use strategy='ddp'"
        )
    from torch.distributed import fsdp

    return fsdp


def precision(value: Any) -> torch.dtype | None:
    """The parameter dtype for ``mixed_precision=`` ("bf16", "fp16", a torch dtype, or None)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = _PRECISIONS.get(str(value).lower())
    if dtype is None:
        raise ConfigurationError(
            f"mixed_precision={value!r}: use 'bf16' or 'fp16' (compute in that dtype, reduce gradients "
            "in float32), or leave it unset"
        )
    return dtype


def units(module: torch.nn.Module, blocks: tuple[Any, ...] = ()) -> list[torch.nn.Module]:
    """The submodules that get their own ``fully_shard`` before the root (see the module docstring)."""
    inner = [m for m in module.modules() if m is not module]
    if blocks:
        named = [m for m in inner if _named(m, blocks)]
        if not named:
            present = sorted({type(m).__name__ for m in inner})
            raise ConfigurationError(
                f"fsdp_blocks={blocks!r} names no submodule of {type(module).__name__}; its module "
                f"classes are: {', '.join(present) or 'none'}"
            )
        return named
    holding = [m for m in inner if any(True for _ in m.parameters()) and not _is_container(m)]
    repeated = {cls for cls, n in Counter(type(m) for m in holding).items() if n >= 2}
    outermost = [m for m in holding if type(m) in repeated and not _inside(m, module, repeated)]
    blocks_ = {cls for cls, n in Counter(type(m) for m in outermost).items() if n >= 2}
    chosen = [m for m in outermost if type(m) in blocks_]
    if chosen:
        return chosen
    total = sum(p.numel() for p in module.parameters())
    return [
        child
        for child in module.children()
        if total and sum(p.numel() for p in child.parameters()) >= _LARGE_CHILD * total
    ]


def _named(module: torch.nn.Module, blocks: tuple[Any, ...]) -> bool:
    cls = type(module)
    names = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
    return any(
        module.__class__ is b or isinstance(module, b) if isinstance(b, type) else b in names for b in blocks
    )


def _is_container(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential))


def _inside(module: torch.nn.Module, root: torch.nn.Module, classes: set[type]) -> bool:
    """True when ``module`` lies within another module of one of ``classes`` (below ``root``).

    The repeated classes whose instances lie in no other repeated one, twice or more, are the
    blocks (a transformer's layers, not the linear layers inside them).
    """
    return any(
        parent is not root
        and parent is not module
        and type(parent) in classes
        and any(m is module for m in parent.modules())
        for parent in root.modules()
    )


def _skeleton(module: torch.nn.Module) -> torch.nn.Module | None:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            torch.nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else meta
        )
    try:
        return copy.deepcopy(module, memo)
    except Exception:  # something in the module cannot be copied: the result stays sharded
        return None


def wrap(module: torch.nn.Module, world: World, options: RunOptions, *, move: bool = True) -> torch.nn.Module:
    """Shard ``module`` across ``world`` with FSDP2; with one process, only move it (and say so)."""
    with _start.outside_meta():
        return _wrap_model(module, world, options, move=move)


def _wrap_model(module: torch.nn.Module, world: World, options: RunOptions, *, move: bool) -> torch.nn.Module:
    fsdp = fsdp_api(torch.device(world.device).type)
    if _compat.compiled_parts(module) is not None and not isinstance(module, fsdp.FSDPModule):
        raise ConfigurationError(
            "strategy='fsdp' and a torch.compile result made before its optimizer: sharded inside "
            "its compiled wrapper, the model trains to other weights than one process (torch 2.13, "
            "from the second step). Make the optimizer first and compile after it (model = "
            "torch.compile(model) after opt = ..., nanoGPT's order), or use strategy='ddp'"
        )
    module = _class_swap.unwrap_compiled(module)
    if isinstance(module, fsdp.FSDPModule):
        return module
    meta = _start.is_meta(module)
    trainable = any(p.requires_grad for p in module.parameters())
    if world.world_size == 1 or not trainable:  # nothing to shard
        if meta:
            module = _start.initialise_on_cpu(module)  # one process's weights, in place
        if move or meta:
            module = module.to(world.device)
        if world.world_size == 1:
            _warn.warn(
                "strategy='fsdp' with one process: there is nothing to shard across, so the model runs "
                "unsharded (as with strategy='ddp')"
            )
        else:
            _warn.warn(
                f"{type(module).__name__} has no trainable parameters: strategy='fsdp' leaves it "
                "unsharded (nothing to train, no gradients to shard)"
            )
        return module
    # Not moved first: fully_shard moves each unit to this process's device as it shards it, so
    # the device holds the shards plus one unit, never the whole model (``move`` changes nothing).
    skeleton = _skeleton(module)
    if world.device == "cpu" and not options.cpu_offload:
        hardware.return_freed_memory_at_once()  # else the heap keeps every unit's freed buffers
    if options.sync_batchnorm:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    dtype = precision(options.mixed_precision)
    policy = fsdp.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
    offload = fsdp.CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if options.cpu_offload else None
    kwargs: dict[str, Any] = {}
    if policy is not None:
        kwargs["mp_policy"] = policy
    if offload is not None:
        kwargs["offload_policy"] = offload
    if dtype == torch.float16:
        _warn.warn(_FP16_NOTE)
    pieces = None  # rank 0's weights go to every rank: made a piece at a time where rank 0's is meta
    if _start.rank0_built_on_meta(module, world.device):
        pieces, state, loose = _start.MetaStart(module, world.rank), {}, {}
    else:
        state, loose = _start.rank0_state(module, world.rank)
    for unit in units(module, tuple(options.fsdp_blocks)):
        if options.checkpoint_blocks:
            _checkpoint(unit)
        fsdp.fully_shard(unit, **kwargs)
    fsdp.fully_shard(module, **kwargs)
    shards_on = "cpu" if options.cpu_offload else world.device
    if pieces is not None:
        pieces.start(module, shards_on, world.device)
    elif meta:  # (built on rank 0 alone: this rank's is meta)
        _start.start(module, state, loose, shards_on, world.device)
    else:
        _start.start(module, state, loose)
    del state, loose
    _class_swap.swap_class(module, _sharded_class(type(module)))
    object.__setattr__(module, _SKELETON, skeleton)
    _reads.install()  # w.norm().item() and the like: the full tensor's values, never a shard's
    CURRENT.track(module, release)
    return module


def _checkpoint(unit: torch.nn.Module) -> None:
    """Activation checkpointing of ``unit``: its forward keeps only its inputs, and runs again in
    the backward pass (torch's non-reentrant checkpoint: the same random numbers, the same
    gradients). Set on the instance, so the model's class and state dict stay as they are."""
    from torch.utils.checkpoint import checkpoint

    forward = unit.forward

    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    unit.forward = checkpointed


def load_full_state_dict(model: torch.nn.Module, state: Mapping[str, Any], strict: bool = True) -> Any:
    """Load a full, plain state dict (every rank passes one) into the model's shards: rank 0's values.

    Rank 0 broadcasts one tensor at a time and each rank keeps its slice, so the other ranks never
    read theirs (``autoddp.load`` maps a file's tensors: only rank 0 reads it) and no device holds
    more than its shards plus one full tensor, as DDP starts from rank 0's weights.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if strict:  # checked on every rank alike (rank 0's dict alone would fail there only)
        expected = set(model.state_dict())  # (FSDP2's is local: no collective)
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(model).__name__}: missing keys {missing}, "
                f"unexpected keys {unexpected}; pass strict=False to load the matching keys only"
            )
    own = dict(state) if dist.get_rank() == 0 else {}
    return set_model_state_dict(
        model, own, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    )


def _load_state_dict(
    self: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    """``load_state_dict`` that also takes the full plain state autoddp saves (or a sharded checkpoint)."""
    loader = getattr(state_dict, "load_into_model", None)
    if loader is not None:
        return loader(self)  # a part of a sharded checkpoint (autoddp.load of a folder)
    if _is_plain(state_dict):
        return load_full_state_dict(self, state_dict, strict)
    plain = getattr(type(self), _class_swap.PLAIN_CLASS)
    return plain.load_state_dict(self, state_dict, strict=strict, assign=assign)


def _is_plain(state: Mapping[str, Any]) -> bool:
    from torch.distributed.tensor import DTensor

    values = [v for v in state.values() if isinstance(v, torch.Tensor)]
    return bool(values) and not any(isinstance(v, DTensor) for v in values)


def _deepcopy(self: torch.nn.Module, memo: dict) -> Any:
    """A plain, whole copy of the model on every rank, as ``copy.deepcopy`` gives one process (an EMA
    copy): gathered from the shards, so every rank makes the copy at the same point."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    skeleton = self.__dict__.get(_SKELETON)
    if skeleton is None:
        raise ConfigurationError(
            f"copy.deepcopy of {type(self).__name__}, sharded with strategy='fsdp': autoddp could not "
            "keep a plain copy of its structure to rebuild it from. Make the copy before the model is "
            "sharded (before its optimizer is made, or autoddp.prepare), or use strategy='ddp'"
        )
    full = get_model_state_dict(self, options=StateDictOptions(full_state_dict=True))  # every rank
    copied = copy.deepcopy(skeleton, memo)
    copied.load_state_dict(full, assign=True)
    return copied


def _zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
    """``model.zero_grad()``: also the gradients a deferred backward left unsharded (``_deferral``)."""
    deferral = _deferral.of(self)
    if deferral is not None:
        deferral.drop()
    getattr(type(self), _class_swap.PLAIN_CLASS).zero_grad(self, set_to_none)


def _no_sync(self: torch.nn.Module) -> contextlib.AbstractContextManager:
    """DDP's ``model.no_sync()``, for code written for DDP: nothing to do (gradient accumulation's
    reduce-scatters are deferred for it: ``_deferral``; a step averages whatever is left)."""
    return contextlib.nullcontext()


def _sharded_class(cls: type) -> type:
    return _class_swap.cached_subclass(
        cls,
        {
            "load_state_dict": _load_state_dict,
            "__deepcopy__": _deepcopy,
            "zero_grad": _zero_grad,
            "no_sync": _no_sync,
            "_autoddp_strategy": NAME,
            _class_swap.PLAIN_CLASS: cls,
        },
    )


def sharded_by_hand(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2, though not by autoddp (the user's own ``fully_shard``)."""
    if distributed(model) or not hasattr(model, "reshard"):  # (FSDP2's modules have it)
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def distributed(model: torch.nn.Module) -> bool:
    """True when autoddp already shards ``model`` in the current world."""
    return _SKELETON in model.__dict__


def release(model: torch.nn.Module) -> None:
    """Sharding stays (FSDP2 cannot be undone); autoddp's own subclass, hooks and reads go."""
    model.__dict__.pop(_SKELETON, None)
    _deferral.detach(model)
    _reads.uninstall()
    plain = type(model).__dict__.get(_class_swap.PLAIN_CLASS)
    if plain is not None:
        model.__class__ = plain


def state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The full, plain state dict (CPU tensors; only rank 0 gets it, others an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def portable(model: torch.nn.Module, keep: bool = True) -> torch.nn.Module:
    """Rank 0: the plain, unsharded model on the CPU (gathered; every rank takes part).

    torch gathers one tensor at a time on the device and copies it to the host on rank 0
    only, so the other ranks (``keep=False``) hold nothing of it afterwards.
    """
    full = state_dict(model)
    skeleton = model.__dict__.get(_SKELETON)
    if not keep or skeleton is None or CURRENT.world is None or CURRENT.world.rank != 0:
        return model
    skeleton.load_state_dict(full, assign=True)
    return skeleton
