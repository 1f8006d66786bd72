"""A batch that reaches a model without a sharded DataLoader, split at the model's call (issue 41).

Scripts that draw batches by hand (``torch.randint`` offsets into one tensor, slicing, a whole
graph) hold the same whole batch on every rank. Each rank runs the model on its rows of it, and
what the call returns is made whole again, so that the lines after the call are one process's:

- a tensor output whose first dimension is this rank's rows: gathered from every rank (``_Gather``);
  its backward keeps this rank's rows of the incoming gradient (the same on every rank: every rank
  computes the same loss from the same whole output) times the world size, since DDP averages
  what the ranks' parts sum to;
- a 0-dim output (a loss the model returns): the ranks' values weighed by their rows, a mean over
  the batch (``_Parts``), by the targets a ``cross_entropy`` counts (``ignore_index``, class weights:
  the parts' means combine into the whole's exactly), or summed where its graph says it is a sum.

Before the first split of a model, ``refusal`` proves on this rank, without gradients and with
dropout off, that the combined parts equal the whole batch's outputs (no mixing of samples, a mean
where a mean is assumed); every rank decides alike (the same batch, the same weights). Where it
cannot, the model runs the whole batch on every rank, as before, and the reason is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from autoddp.core import _compat, _containers
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import CURRENT
from autoddp.in_rank.models._split import BATCHNORMS

#: torch's dropout layers: off for the check only (their masks differ between a batch and its parts).
_DROPOUTS = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


class Parts:
    """The rows each of ``world_size`` ranks takes of a batch of ``size`` rows."""

    __slots__ = ("device", "lo", "n", "rank", "sizes", "world_size")

    def __init__(self, size: int, rank: int, world_size: int, device: torch.device | None = None) -> None:
        self.device = device  # the batch's
        base, extra = divmod(size, world_size)
        self.sizes = [base + (1 if r < extra else 0) for r in range(world_size)]
        self.rank, self.world_size = rank, world_size
        self.lo, self.n = sum(self.sizes[:rank]), self.sizes[rank]

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def times(self, k: int) -> Parts:
        """The same parts with ``k`` rows per sample (an output shaped ``[B * T, ...]``)."""
        if k == 1:
            return self
        scaled = Parts(0, self.rank, self.world_size, self.device)
        scaled.sizes = [n * k for n in self.sizes]
        scaled.lo, scaled.n = self.lo * k, self.n * k
        return scaled

    def rows(self, tensor: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        r = self.rank if rank is None else rank
        lo = sum(self.sizes[:r])
        return tensor[lo : lo + self.sizes[r]]


def batch_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor whose first dimension is the batch's rows: the first tensor argument's."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value
    return None


def local_arguments(args: tuple, kwargs: dict, parts: Parts, rank: int | None = None) -> tuple[tuple, dict]:
    """The arguments with every tensor of the batch's rows cut to ``rank``'s rows (others whole);
    this rank's own (``rank`` None) counted in ``CURRENT.split_chains`` where they carry gradients."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == parts.size:
            if rank is None and value.requires_grad:
                CURRENT.split_chains += 1
            return parts.rows(value, rank)
        return value

    return tuple(cut(v) for v in args), {k: cut(v) for k, v in kwargs.items()}


def _leaves_ok(output: Any, rows: int) -> str | None:
    """Why ``output`` (of a forward on ``rows`` rows) cannot be made whole; None where it can."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or (output.shape[0] and output.shape[0] % rows == 0):
            return None  # (k rows per sample: ``logits.view(B * T, C)``)
        return f"an output of shape {tuple(output.shape)} whose first dimension is not the batch's"
    if output is None or isinstance(output, (int, float, bool, str)):
        return None
    if isinstance(output, (tuple, list)):
        return next((why for item in output if (why := _leaves_ok(item, rows)) is not None), None)
    if isinstance(output, dict):
        return next((why for item in output.values() if (why := _leaves_ok(item, rows)) is not None), None)
    return f"an output of type {type(output).__name__}"


def _map(output: Any, fn: Any) -> Any:
    """``output`` with ``fn`` applied to each tensor in it, its containers of their own types
    (``_containers.map_items``: a dict subclass copied, whatever its constructor takes)."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    return _containers.map_items(output, lambda item: _map(item, fn))


def _weight(value: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A 0-dim output's weight among the parts' (None: a sum, the parts add up): what a mean from
    ``cross_entropy``/``nll_loss`` divides by (the targets it counts: ``ignore_index`` and class
    weights make the whole batch's mean the parts' weighed by it), else the part's rows."""
    if _compat.losses.loss_reduction(value) == "sum":
        return None
    counted = _compat.losses.weight_of_mean(value)
    return torch.tensor(float(rows), dtype=torch.float64) if counted is None else counted.to(torch.float64)


def combine_locally(outputs: list[Any], parts: Parts, template: Any) -> Any:
    """What the ranks' outputs (``outputs[r]``, made here one after another) combine to."""

    def at(path_values: list[torch.Tensor]) -> torch.Tensor:
        first = path_values[0]
        if first.dim() == 0:
            weights = [_weight(v, n) for v, n in zip(path_values, parts.sizes, strict=True)]
            if any(w is None for w in weights):
                return sum(path_values)
            total = sum(weights)
            return sum(v * (w / total).to(v.dtype) for v, w in zip(path_values, weights, strict=True))
        return torch.cat(path_values)

    flat = [_flatten(o) for o in outputs]
    combined = iter([at([f[i] for f in flat]) for i in range(len(flat[0]))])
    return _map(template, lambda _: next(combined))


def _flatten(output: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map(output, lambda t: found.append(t) or t)
    return found


def whole(output: Any, parts: Parts, group: Any = None) -> Any:
    """This rank's ``output`` made the whole batch's, differentiably (see the module docstring)."""

    def one(value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0:
            return _Parts.apply(value, _weight(value, parts.n), parts.world_size, group)
        return _Gather.apply(value, parts.times(value.shape[0] // parts.n), group)

    return _map(output, one)


class _Gather(torch.autograd.Function):
    """Every rank's rows, in rank order; backward: W times this rank's rows of the gradient, as
    DDP's average wants, where what follows the call is the same on every rank. Where a call split
    after it took rows with gradients (``b(a(x))``: ``CURRENT.split_chains``), each rank's gradient
    holds only what its own rows of that call gave (times W): it is summed over the ranks first (one
    all-reduce), which is the whole gradient times W again (its rows times W counted that call's
    part W times over). Every rank takes the same branch: the same calls, in the same order."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, parts: Parts, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.parts, ctx.group, ctx.chains = parts, group, CURRENT.split_chains
        biggest = max(parts.sizes)
        padded = local.contiguous()
        if parts.n < biggest:
            padded = torch.cat([padded, padded.new_zeros((biggest - parts.n, *local.shape[1:]))])
        gathered = [torch.empty_like(padded) for _ in range(parts.world_size)]
        dist.all_gather(gathered, padded, group=group)
        return torch.cat([g[:n] for g, n in zip(gathered, parts.sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        parts = ctx.parts
        if CURRENT.split_chains == ctx.chains:  # (nothing split after it: the same on every rank)
            return parts.rows(grad) * parts.world_size, None, None
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return parts.rows(total), None, None


class _Parts(torch.autograd.Function):
    """The whole batch's value of a 0-dim output: the ranks' values weighed by their ``weight``
    (a mean), or added (``weight`` None: a sum), in one all-reduce; backward: each rank's share
    of the whole (its weight over all of them, or 1) times W, since DDP averages."""

    @staticmethod
    def forward(
        ctx: Any, value: torch.Tensor, weight: torch.Tensor | None, world_size: int, group: Any
    ) -> torch.Tensor:  # type: ignore[override]
        if weight is None:
            ctx.scale = world_size
            total = value.detach().clone()
            dist.all_reduce(total, group=group)
            return total
        weight = weight.to(value.device)
        both = torch.stack([value.detach().to(torch.float64) * weight, weight])
        dist.all_reduce(both, group=group)
        ctx.scale = (weight / both[1] * world_size).to(value.dtype)
        return (both[0] / both[1]).to(value.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad * ctx.scale, None, None, None


@contextlib.contextmanager
def _trial(module: torch.nn.Module) -> Iterator[None]:
    """A ``with`` block where ``module`` computes as in training but without dropout (torch's
    dropout layers in eval()), and leaves nothing behind: its buffers (running statistics, a
    step count) come back as they were, and so does each dropout layer's mode."""
    dropouts = [(m, m.training) for m in module.modules() if isinstance(m, _DROPOUTS)]
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    for m, _ in dropouts:
        m.training = False
    try:
        yield
    finally:
        for m, training in dropouts:
            m.training = training
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def refusal(module: torch.nn.Module, args: tuple, kwargs: dict, parts: Parts) -> str | None:
    """Why the batch of this call cannot be split at ``module``'s call (None: it can): proven by
    running the whole batch and each rank's rows on this rank, without gradients, in training
    mode but with torch's dropout layers off (a layer that mixes the samples of a batch in
    training only, a hand-written batch norm, differs there; randomness of its own too)."""
    norms = [
        type(m).__name__ for m in module.modules() if isinstance(m, BATCHNORMS) and m.training
    ]  # (in training: over the batch)
    if norms:
        return f"{norms[0]} normalises over the batch"
    with torch.no_grad(), torch.random.fork_rng(devices=[]), _trial(module):
        whole_output = module(*args, **kwargs)
        why = _leaves_ok(whole_output, parts.size)
        if why is not None:
            return why
        outputs = []
        for rank in range(parts.world_size):
            local_args, local_kwargs = local_arguments(args, kwargs, parts, rank)
            try:
                outputs.append(module(*local_args, **local_kwargs))
            except Exception as error:  # (a graph's adjacency cut with its nodes, say)
                return f"its forward fails on part of a batch ({_named(error)})"
            why = _leaves_ok(outputs[-1], parts.sizes[rank])
            if why is not None:
                return why
        try:  # (an output type rebuilt otherwise than its constructor takes: ``_map``)
            pairs = list(
                zip(
                    _flatten(combine_locally(outputs, parts, whole_output)),
                    _flatten(whole_output),
                    strict=True,
                )
            )
        except Exception as error:
            kind = type(whole_output).__name__
            return f"its output of type {kind} cannot be rebuilt from parts ({_named(error)})"
    for mine, theirs in pairs:
        if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5):
            return (
                "its outputs for parts of a batch differ from the whole batch's (the samples of a batch mix, "
                "or the arguments' first dimension is not the batch: [seq, batch] inputs)"
            )
    return None


def _named(error: BaseException) -> str:
    """``"TypeError: its first line"`` (at most 200 characters of it)."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def parts(replica: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> Parts | None:
    """This rank's rows of a batch drawn by hand, where it is split at this call (None: whole).

    Only under capture, while no loader has handed out data by rank (``CURRENT.sharded_data``).
    The first call of a model decides for it (``replica.at_call``): every rank must hold the same
    batch (a script seeded alike on every rank), and ``refusal`` must find nothing. Each later
    call's batch is checked the same way one call later (``Splitting``: no wait in the step).
    """
    if CURRENT.sharded_data or CURRENT.split_weight is not None or CURRENT.capture is None or CURRENT.alone:
        return None  # (in a rank0() body rank 0 runs alone: nothing to split with)
    state = replica.at_call
    world = CURRENT.world
    if isinstance(state, str) or world is None or world.world_size < 2:
        return None
    batch = batch_of(args, kwargs)
    if batch is None or batch.shape[0] < world.world_size:
        return None
    split = Parts(batch.shape[0], world.rank, world.world_size, batch.device)
    if state is None:
        why = (
            DRAWN_APART
            if not _same(_fingerprints(args, kwargs, split))
            else refusal(module, args, kwargs, split)
        )
        replica.at_call = Splitting() if why is None else why
        return split if why is None else None
    state.calls += 1
    if state.calls & (state.calls - 1) == 0 or state.calls % _CHECK_EVERY == 0:
        state.check(_fingerprints(args, kwargs, split))
    return split


#: Why a batch is not split where the ranks draw different ones (the notice says it in words).
DRAWN_APART = "drawn apart"


#: After the first calls (1, 2, 4, 8, ...), the batch is checked at every this many calls of a model.
_CHECK_EVERY = 64


class Splitting:
    """A model whose batches are split at its call: the batch is checked to be the same on every
    rank at its calls 1, 2, 4, 8, ... and every ``_CHECK_EVERY``-th (one more small all-gather each;
    ranks that drift apart stay apart, their streams offset), the gathered fingerprints compared
    at the next check (a GPU is not waited for)."""

    __slots__ = ("calls", "pending")

    def __init__(self) -> None:
        self.calls = 0  # the calls split since the first (every rank counts alike)
        self.pending: list[torch.Tensor] | None = None

    def check(self, everyone: list[torch.Tensor]) -> None:
        earlier, self.pending = self.pending, everyone
        if earlier is not None and not _same(earlier):
            raise ConfigurationError(
                "the processes held different batches at a recent call of this model, where they held "
                "the same one before: autoddp splits a batch drawn without a DataLoader between "
                "them, so every process must draw the same one. Something draws random numbers on some "
                "processes only (code under `if autoddp.rank() == 0:`?): draw them on every process, or "
                "seed each draw alike"
            )


def _fingerprints(args: tuple, kwargs: dict, parts: Parts) -> list[torch.Tensor]:
    """Every rank's few sums of its batch's tensors (one all-gather), in rank order."""
    sums = []
    device = None
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == parts.size:
            flat = value.detach().reshape(-1).to(torch.float64)
            sums += [flat.sum(), (flat * flat).sum(), flat[:: max(1, flat.numel() // 7)].sum()]
            device = value.device
    mine = torch.stack(sums).to(device)
    everyone = [torch.empty_like(mine) for _ in range(parts.world_size)]
    dist.all_gather(everyone, mine)
    return everyone


def _same(everyone: list[torch.Tensor]) -> bool:
    return all(torch.equal(everyone[0], theirs) for theirs in everyone[1:])


@contextlib.contextmanager
def own_noise(parts: Parts, calls: int) -> Iterator[None]:
    """The split forward draws its random numbers (dropout) from a stream of its own, for its rows
    (``calls``: the model's forwards so far, ``parts.rank``); the caller's streams stay as they
    were, alike on every rank, so that the next batch drawn is the same everywhere."""
    device = parts.device
    cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        seed = (torch.initial_seed() * 1_000_003 + calls * 1_009 + parts.rank) % 2**63
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield
