"""``split_batches`` on the model's side: gradients weighed by each rank's part, global BatchNorm.

Each rank computes its loss on its part of the global batch (``autoddp.in_rank.data.split``) and DDP
averages the ranks' gradients: that is the global batch's mean only when the parts are equal.
``weigh`` scales the gradient reaching the model's output by this rank's weight
``W * part / batch`` (0 for a rank whose part is empty), so the average is ``sum(part/batch *
grad)``, the mean over the global batch, for a loss that is a mean over the batch (the usual
reduction; a summed loss is not one process's either way). Only the model's output is scaled:
terms of the loss that do not go through it (a weight penalty) are the same on every rank and
stay as they are.

``convert_batchnorms`` gives torch's BatchNorm layers a class (same name) whose training forward
normalises with the global batch's statistics: one all-reduce of the per-channel sums, sums of
squares and counts in the forward, one of their gradients in the backward (as SyncBatchNorm
does; torch's SyncBatchNorm refuses CPU tensors, this runs on gloo and NCCL alike, and knows a
rank whose part is empty, which counts for nothing). The running statistics are updated from
the global statistics, as one process's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autoddp.core import _class_swap, _compat, _containers, _warn
from autoddp.core.state import CURRENT

#: torch's public BatchNorm classes (BatchNorm1d/2d/3d share one forward; SyncBatchNorm has its own).
BATCHNORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def weigh(output: Any, weight: float) -> None:
    """Scale the gradients a backward brings to ``output`` (tensors in lists, tuples, dicts,
    dataclasses) by ``weight``."""
    if weight == 1.0:
        return
    hook = _zero if weight == 0.0 else _Scale(weight)
    for item in _containers.leaves(output):
        if isinstance(item, torch.Tensor) and item.requires_grad:
            item.register_hook(hook)


class _Scale:
    __slots__ = ("weight",)

    def __init__(self, weight: float) -> None:
        self.weight = weight

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.weight


def _zero(grad: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(grad)  # (not grad * 0: a NaN would stay NaN)


def show_split_loss_whole(loss: Any) -> None:
    """After the backward of a split batch's loss: its value becomes the global batch's (the
    ranks' parts weighed, one all-reduce of a scalar), so ``loss.item()`` prints what one process
    would; its gradients were taken from this rank's part already. Every rank calls it."""
    weight, world = CURRENT.split_weight, CURRENT.world
    if weight is None or world is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return
    share = loss.detach().reshape(1).to(torch.float64 if loss.device.type == "cpu" else loss.dtype)
    share = share * (weight / world.world_size)  # (weight 0, an empty part's stand-in: nothing)
    dist.all_reduce(share)
    loss.data.copy_(share.reshape(loss.shape))  # (.data: no version bump for a graph kept alive)


def check_loss(loss: Any, split: bool = True) -> None:
    """Warn when ``loss`` is summed or a weighted mean over the batch: weighing the parts assumes a
    mean; without ``split``, DDP's average of the ranks' weighted means is not the batch's."""
    reduction = _compat.losses.loss_reduction(loss)
    if not split:
        if reduction == "weighted mean":
            _warn.warn(
                "this loss is a weighted mean over the batch (class weights, or ignore_index with "
                "ignored samples): each process divides by the weights of its own samples and DDP "
                "averages the processes' gradients, so they differ from one process's over the "
                "global batch unless every process's samples weigh the same. For one process's "
                "gradients, use reduction='sum' divided by the global batch's total weight "
                "(all-reduced) times the number of processes, or split_batches=True with that sum"
            )
        elif reduction == "sum":
            world = CURRENT.world
            _warn.warn(
                "this loss is summed over the batch (reduction='sum' or .sum()): DDP averages the "
                "processes' gradients, so they are 1/"
                f"{world.world_size if world else 'N'} of one process's over the global batch (Adam "
                "and its kin step nearly alike; SGD steps as with a learning rate that much smaller). "
                "For one process's gradients, multiply the loss by the number of processes "
                "(autoddp.world_size()), or use a mean over the batch"
            )
        return
    if reduction == "weighted mean":
        _warn.warn(
            "split_batches assumes a loss that is a plain mean over the batch, and this one is a weighted "
            "mean (class weights, or ignore_index with ignored samples): each process divides by its "
            "part's weights, not the whole batch's, so the gradients differ from one process's. Use "
            "reduction='sum' divided by the whole batch's weight, or leave split_batches off"
        )
    if reduction != "sum":
        return
    world = CURRENT.world
    _warn.warn(
        "split_batches assumes a loss that is a mean over the batch (the default reduction), and this "
        "one is summed (reduction='sum' or .sum()): each process sums its part only, so the gradients "
        f"are about 1/{world.world_size if world else 'N'} of one process's. Use a mean "
        "(reduction='mean', or divide by the batch size), or leave split_batches off"
    )


def split_note(model: torch.nn.Module) -> str:
    """The notice's words for the BatchNorm layers of ``model`` that use the global statistics."""
    count = sum(1 for sub in model.modules() if type(sub).__dict__.get("forward") is _forward)
    if not count:
        return ""
    layers = "layer" if count == 1 else "layers"
    return (
        f"; {count} BatchNorm {layers} with the global batch's statistics (split_batches: two "
        f"all-reduces per layer and step, one in the forward, one in the backward)"
    )


def convert_batchnorms(module: torch.nn.Module) -> int:
    """Give every BatchNorm layer of ``module`` the global-statistics class; returns how many."""
    count = 0
    for sub in module.modules():
        cls = type(sub)
        if not isinstance(sub, BATCHNORMS) or _class_swap.PLAIN_CLASS in cls.__dict__:
            continue
        if cls.forward is not torch.nn.BatchNorm1d.forward and not issubclass(cls, torch.nn.SyncBatchNorm):
            continue  # a forward of the user's own: left as it is
        if isinstance(sub, torch.nn.modules.lazy.LazyModuleMixin):
            continue
        extra = {"forward": _forward, "__reduce_ex__": _class_swap.plain_reduce, _class_swap.PLAIN_CLASS: cls}
        sub.__class__ = _class_swap.cached_subclass(cls, extra)
        count += 1
    return count


def restore_batchnorms(module: torch.nn.Module) -> None:
    """Give ``module``'s BatchNorm layers their own class back."""
    for sub in module.modules():
        plain = type(sub).__dict__.get(_class_swap.PLAIN_CLASS)
        if plain is not None and type(sub).__dict__.get("forward") is _forward:
            sub.__class__ = plain


class _AllReduceSum(torch.autograd.Function):
    """A sum over the ranks whose backward sums the gradients over the ranks too."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        dist.all_reduce(total)
        return total


def _forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    plain = getattr(type(self), _class_swap.PLAIN_CLASS)
    training = self.training or (self.running_mean is None and self.running_var is None)
    if (
        not training
        or not torch.is_grad_enabled()  # (the plain module runs then, on one rank maybe: no collective)
        or not dist.is_initialized()
        or dist.get_world_size() < 2
    ):
        return plain.forward(self, x)
    if x.dim() < 2:
        raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")
    dims = [0, *range(2, x.dim())]
    empty = CURRENT.split_weight == 0.0  # this rank's part is empty: its stand-in sample counts for nothing
    count = 0 if empty else x.numel() // x.shape[1]
    sums = x.sum(dims, dtype=torch.float64)
    squares = (x * x).sum(dims, dtype=torch.float64)
    if empty:
        sums, squares = sums * 0.0, squares * 0.0  # (still in the graph: every rank's backward reduces)
    counted = torch.full((1,), float(count), dtype=torch.float64, device=x.device)
    total = _AllReduceSum.apply(torch.cat([sums, squares, counted]))
    channels = x.shape[1]
    n = float(total[-1].item())
    if n <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {int(n)} in the global batch"
        )
    mean = total[:channels] / n
    var = (total[channels : 2 * channels] / n - mean * mean).clamp_min(0.0)
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            unbiased = (var * (n / (n - 1))).to(self.running_var.dtype)
            self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
    shape = [1, channels] + [1] * (x.dim() - 2)
    scale = torch.rsqrt(var + self.eps).to(x.dtype)
    y = (x - mean.to(x.dtype).view(shape)) * scale.view(shape)
    if self.affine:
        y = y * self.weight.view(shape) + self.bias.view(shape)
    return y
