"""``gather``: every rank's per-sample results on every rank, in the single-process order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from autoddp.core.errors import ConfigurationError
from autoddp.in_rank.data.loaders import distributed_sampler
from autoddp.in_rank.world.process_group import comm_device


def gather(tensor: torch.Tensor, loader: DataLoader | None = None) -> torch.Tensor:
    """All ranks' rows of ``tensor`` on every rank, so metrics match a single-process run.

    Every rank must call it. Rows may differ in number between ranks. Without ``loader`` the rows
    are concatenated in rank order. With the sharded ``loader`` the tensor was built from (one row
    per sample, one full pass in order, ``drop_last=False``), the rows come back in the global
    sample order and the padding repeats are dropped: for an unshuffled loader the result equals
    the single-process one. Outside a process group the tensor is returned unchanged. The result
    lies on ``tensor``'s device and carries no gradient.
    """
    import torch.distributed as dist

    if not isinstance(tensor, torch.Tensor):
        raise ConfigurationError(f"gather() needs a torch.Tensor, got {type(tensor).__name__}")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tensor
    world_size = dist.get_world_size()

    shapes: list[Any] = [None] * world_size
    dist.all_gather_object(shapes, (tuple(tensor.shape), str(tensor.dtype)))
    if any(len(shape) == 0 for shape, _ in shapes):
        raise ConfigurationError(
            "gather() needs a tensor with a first (sample) dimension on every rank, but got a 0-d "
            "tensor; pass tensor.reshape(1), or use torch.distributed.all_reduce for a single number"
        )
    if len({(shape[1:], dtype) for shape, dtype in shapes}) > 1:
        described = ", ".join(f"rank {r}: {tuple(s)} {d}" for r, (s, d) in enumerate(shapes))
        raise ConfigurationError(
            "gather() needs tensors that differ only in their first dimension and share a dtype "
            f"on every rank; got {described}"
        )
    rows = [shape[0] for shape, _ in shapes]

    device = comm_device(tensor.device)
    local = tensor.detach().to(device).contiguous()
    longest = max(rows)
    if local.shape[0] < longest:
        filler = local.new_zeros((longest - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, filler])
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local)
    parts = [part[:count] for part, count in zip(parts, rows, strict=True)]

    if loader is None:
        return torch.cat(parts).to(tensor.device)
    per_rank, total = _layout(loader, world_size, rows)
    interleaved = torch.stack(parts, dim=1).reshape(per_rank * world_size, *local.shape[1:])
    return interleaved[:total].to(tensor.device)


def _layout(loader: DataLoader, world_size: int, rows: Sequence[int]) -> tuple[int, int]:
    """Samples per rank and samples in all for ``loader``, checked against the rows gathered."""
    sampler = distributed_sampler(loader)
    fix = "or call gather(tensor) without loader= to concatenate the rows in rank order"
    if sampler is None:
        raise ConfigurationError(
            "gather(loader=...) needs a loader sharded by autoddp.prepare, "
            f"and this one has no DistributedSampler; prepare it before iterating, {fix}"
        )
    if sampler is loader.batch_sampler:
        raise ConfigurationError(
            "gather(loader=...) cannot restore the sample order of a loader whose custom batch sampler "
            f"was sharded batch by batch; {fix}"
        )
    if sampler.num_replicas != world_size:
        raise ConfigurationError(
            f"gather(loader=...) got a loader sharded for {sampler.num_replicas} processes in a world "
            f"of {world_size}; shard it in this run with autoddp.prepare, {fix}"
        )
    total = len(sampler.dataset)
    if sampler.total_size < total:
        raise ConfigurationError(
            f"gather(loader=...) got a loader whose sampler drops samples (drop_last=True keeps "
            f"{sampler.total_size} of {total}); use drop_last=False for evaluation, {fix}"
        )
    if any(count != sampler.num_samples for count in rows):
        raise ConfigurationError(
            f"gather(loader=...) expects one row per sample of one full pass, {sampler.num_samples} "
            f"on every rank, but got {list(rows)} rows per rank. Iterate the loader once to the end "
            f"with drop_last=False (drop_last=True drops the last incomplete batch), {fix}"
        )
    return sampler.num_samples, total
