"""Gradients averaged across ranks by autoddp itself, where DDP or FSDP2 did not (``_averaging``,
``_deferral``): flattened into DDP-sized buckets, one all-reduce each."""

from __future__ import annotations

import torch

#: The most bytes of gradients one all-reduce of ``average`` carries (DDP's default bucket size).
_BUCKET = 25 * 1024 * 1024


def average(params: list[torch.Tensor]) -> bool:
    """Average the gradients of ``params`` across ranks; False when none had one.

    Gradients of one device and dtype travel flattened together, up to ``_BUCKET`` bytes per
    all-reduce: a step the window guessed wrong costs one synchronisation, as DDP's would.
    """
    import torch.distributed as dist

    if not any(p.grad is not None for p in params):
        return False
    world = dist.get_world_size()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    buckets = _buckets([g for g in grads if not g.is_sparse])  # the same lists, in order, everywhere
    flats = [torch.cat([g.reshape(-1) for g in bucket]) for bucket in buckets]
    works = [dist.all_reduce(flat, async_op=True) for flat in flats]
    works += [dist.all_reduce(g, async_op=True) for g in grads if g.is_sparse]
    for work in works:
        work.wait()
    for bucket, flat in zip(buckets, flats, strict=True):
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(part.view_as(g))
    for p, g in zip(params, grads, strict=True):
        if p.grad is not None:
            p.grad.div_(world)
        elif torch.count_nonzero(g):
            p.grad = g.div_(world)
    return True


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` in runs of one device and dtype, each up to ``_BUCKET`` bytes (order kept)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        last = buckets[-1][-1] if buckets else None
        nbytes = g.numel() * g.element_size()
        if last is None or (last.device, last.dtype) != (g.device, g.dtype) or size + nbytes > _BUCKET:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    return buckets
