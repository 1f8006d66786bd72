"""The peak of one training step's live bytes, tracked on fake tensors (no memory behind them).

A copy of the model whose parameters and buffers are fake (``activations.copy_with``), the batch
made fake, and a new optimizer of the same class and settings over the copy's parameters run the
loop a script writes, twice (the first step makes the optimizer's state, the second runs with it
held)::

    output = model(*args, **kwargs)
    loss = surrogate_loss(output)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

``output`` and ``loss`` live, as in such a loop, until the next forward returns. Every tensor an
operation returns is seen (``_compat.fake.new_tensors_watch``): a storage not seen before adds its
bytes to the live count, and a weak reference on it takes them off when it dies (torch keeps a
storage's Python object as long as the storage lives). The largest live count is the peak. The
parameters, buffers and gradients made before the steps count from the start; the batch's
storages never (they are the data's).

Gradients: with ``grads_held`` (DDP: its buckets hold the gradients between steps) they are made
before the steps and ``zero_grad`` keeps them, so each backward's fresh gradient is added into them
and freed, as into DDP's bucket views; without, ``zero_grad`` drops them (``set_to_none``).

The loss (``surrogate_loss``): the user's code computes it outside the model, so a usual one
stands in: for each floating tensor of the output, cross-entropy over its last dimension against
class 0 (a 0-dimensional output is taken as the loss itself). Cross-entropy keeps a log-softmax the
size of the output for its backward, as a classifier's or a language model's loss does; a loss
that keeps less or more (MSE keeps the difference: the same size) is off by about one output.

What this does not see: memory a kernel allocates and frees inside itself (oneDNN's scratchpads),
and workspaces a kernel sizes at run time that fake tensors show empty: oneDNN's RNN workspace on
CPU (``UNSIZED``: the result names the operations seen with it).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoddp.core._compat import fake
from autoddp.core.memory import activations as activations_
from autoddp.core.memory.optimizers import Group

#: Operations whose result fake tensors show without the memory the real kernel gives it.
UNSIZED = {"mkldnn_rnn": "oneDNN's RNN workspace (CPU LSTM and GRU)"}


@dataclass(frozen=True)
class Tracked:
    """One step's live bytes: ``peak``, ``activations`` (what the last forward and loss added, the
    output's included), ``held`` (the parameters, buffers and gradients counted from the start),
    ``stepped`` (whether the optimizer stepped on fake tensors), ``unsized`` (``UNSIZED`` seen)."""

    peak: int
    activations: int
    held: int
    stepped: bool
    unsized: tuple[str, ...] = ()


class LiveBytes:
    """The bytes of the storages seen and still alive, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._ignored: list[Any] = []  # kept alive, so that their ids are never reused meanwhile
        self._order: dict[int, int] = {}  # the order in which the living storages were seen
        self.seen_count = 0
        self.unsized: set[str] = set()

    def ignore(self, tensors: Sequence[torch.Tensor]) -> None:
        """Never count these tensors' storages (the batch: the data's)."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._ignored.append(storage)
            self._sizes[id(storage)] = 0

    def add(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage if new (or grown: a resize), until it dies."""
        storage = tensor.untyped_storage()
        key, size = id(storage), storage.nbytes()
        known = self._sizes.get(key)
        if known is not None and (key not in self._refs or self._refs[key]() is storage):
            if key in self._refs and size != known:  # resized in place
                self.live += size - known
                self._sizes[key] = size
                self.peak = max(self.peak, self.live)
            return
        self._sizes[key] = size
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._gone(key))
        self.seen_count += 1
        self._order[key] = self.seen_count
        self.live += size
        self.peak = max(self.peak, self.live)

    def _gone(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)
        self._order.pop(key, None)

    def since(self, count: int) -> int:
        """The bytes of the living storages seen after the ``seen_count`` was ``count``."""
        return sum(self._sizes[key] for key, order in self._order.items() if order > count)

    def seen(self, name: str, tensors: list[torch.Tensor]) -> None:
        """What ``_compat.fake.new_tensors_watch`` hands over for each operation."""
        for word, what in UNSIZED.items():
            if word in name:
                self.unsized.add(what)
        for tensor in tensors:
            self.add(tensor)


def surrogate_loss(output: Any) -> torch.Tensor:
    """The usual loss standing in for the user's (module docstring): a scalar tensor."""
    losses = []
    for tensor in activations_.tensors_in(output):
        if not (tensor.is_floating_point() and tensor.requires_grad):
            continue
        if tensor.dim() == 0:
            losses.append(tensor)
            continue
        logits = tensor.reshape(-1, tensor.shape[-1])
        target = torch.zeros(logits.shape[0], dtype=torch.long, device=tensor.device)
        losses.append(torch.nn.functional.cross_entropy(logits, target))
    if not losses:
        raise ValueError("the model's output holds no floating tensor that requires a gradient")
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def track(
    module: torch.nn.Module,
    batch: tuple[tuple, dict],
    optimizer: tuple[type | None, Sequence[Group]],
    *,
    grads_held: bool,
    steps: int = 2,
) -> Tracked:
    """The live bytes of ``steps`` steps of ``module`` on ``batch`` (args, kwargs) with the optimizer
    (class and groups; ``None``: none) on fake tensors (module docstring). Raises what the fake run
    raised (an operation without a fake kernel, a value read back with ``.item()``)."""
    mode = fake.fake_tensor_mode()
    copied = activations_.copy_with(module, mode.from_tensor)
    args, kwargs = activations_.mapped(batch, mode.from_tensor)
    counter = LiveBytes()
    counter.ignore(list(activations_.tensors_in((args, kwargs))))
    trainable = [p for p in copied.parameters() if p.requires_grad]
    with mode:
        for p in trainable if grads_held else ():
            p.grad = torch.zeros_like(p)
    for tensor in (*copied.parameters(), *copied.buffers(), *(p.grad for p in trainable if grads_held)):
        counter.add(tensor)
    held = counter.live
    with torch.random.fork_rng(devices=[]), torch.enable_grad(), mode, fake.new_tensors_watch(counter.seen):
        made = _optimizer_over(optimizer, module, copied)  # (some make their state here: Adagrad)
        stepped = made is not None
        output = loss = None
        for _ in range(steps):
            before = counter.seen_count
            output = copied(*args, **kwargs)
            loss = surrogate_loss(output)
            added = counter.since(before)
            loss.backward()
            stepped = stepped and _step(made)
            (made if stepped else copied).zero_grad(set_to_none=not grads_held)
    return Tracked(counter.peak, added, held, stepped, tuple(sorted(counter.unsized)))


def _optimizer_over(
    optimizer: tuple[type | None, Sequence[Group]], module: torch.nn.Module, copied: torch.nn.Module
) -> Any:
    """A new optimizer of the class and settings given over the copy's parameters; None for none,
    or for one that cannot be made so (its state then comes from the rule)."""
    cls, groups = optimizer
    if cls is None or not groups:
        return None
    # (a deep copy keeps the order of parameters(), and a tied parameter tied)
    twin = {id(p): c for p, c in zip(module.parameters(), copied.parameters(), strict=True)}
    made = [{**g.settings, "params": [twin[id(p)] for p in g.params if id(p) in twin]} for g in groups]
    try:
        return cls([group for group in made if group["params"]])
    except Exception:  # a constructor that takes more than parameter groups
        return None


def _step(made: Any) -> bool:
    """One ``step()``; False where it failed on fake tensors (a closure needed, a value read back)."""
    try:
        made.step()
    except Exception:
        return False
    return True
