"""The bytes an optimizer keeps per process (its state) and the temporaries its ``step()`` makes.

The state of torch's common optimizers follows from their settings (``STATE_RULES``: copies of the
parameters they update); any other optimizer (a subclass included: it may keep more) is made over
a meta-device copy of the parameters, stepped once, and its state counted, which costs no memory.
Where that step fails (an optimizer that reads a value back, ``.item()``, or needs a closure), the
rule ``FALLBACK_COPIES`` is taken and the estimate says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: An optimizer whose state could not be counted keeps this many copies of its parameters (Adam's).
FALLBACK_COPIES = 2


def _sgd(group: Mapping[str, Any]) -> int:
    return 1 if group.get("momentum", 0) else 0


def _adam(group: Mapping[str, Any]) -> int:
    return 3 if group.get("amsgrad", False) else 2


def _rmsprop(group: Mapping[str, Any]) -> int:
    return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))


#: Copies of the parameters each optimizer keeps, from its group's settings (only these exact classes).
STATE_RULES: dict[type, Callable[[Mapping[str, Any]], int]] = {
    torch.optim.SGD: _sgd,
    torch.optim.Adam: _adam,
    torch.optim.AdamW: _adam,
    torch.optim.Adagrad: lambda group: 1,
    torch.optim.RMSprop: _rmsprop,
    # its history (two flat copies per remembered step) once history_size iterations ran, its
    # direction and the last flat gradient (read from torch/optim/lbfgs.py; 12.1 copies counted
    # with history_size=5 after 24 iterations)
    torch.optim.LBFGS: lambda group: 2 * group.get("history_size", 100) + 2,
}


@dataclass(frozen=True)
class Group:
    """One parameter group: its parameters (deduplicated) and its settings."""

    params: tuple[torch.Tensor, ...]
    settings: Mapping[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params if p.requires_grad)

    @property
    def largest(self) -> int:
        return max((p.numel() * p.element_size() for p in self.params if p.requires_grad), default=0)


def groups_of(
    optimizer: torch.optim.Optimizer | type | None,
    params: Sequence[torch.Tensor],
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[type | None, list[Group]]:
    """The optimizer's class and its groups: an instance's own, or one group of ``params`` with
    ``kwargs`` over the class's defaults for a class (``None``: no optimizer, no state)."""
    if optimizer is None:
        return None, []
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = []
        for group in optimizer.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            groups.append(Group(tuple(_unique(group["params"])), settings))
        return type(optimizer), groups
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(f"optimizer={optimizer!r}: give a torch.optim.Optimizer, its class, or None")
    return optimizer, [Group(tuple(_unique(params)), dict(kwargs or {}))]


def groups_made(params: Any, defaults: Mapping[str, Any]) -> list[Group]:
    """The groups an optimizer made over ``params`` with ``defaults`` will hold, before it is made
    (what every optimizer passes ``torch.optim.Optimizer.__init__``): each group's own settings
    over the defaults. ``params``: tensors, (name, tensor) pairs, or dicts of groups."""
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    groups = [dict(item) for item in items if isinstance(item, dict)]
    loose = [item[1] if isinstance(item, tuple) else item for item in items if not isinstance(item, dict)]
    found = [Group(tuple(_unique(loose)), dict(defaults))] if loose else []
    for group in groups:
        own = group.pop("params")
        own = [own] if isinstance(own, torch.Tensor) else own
        tensors = [p[1] if isinstance(p, tuple) else p for p in own]
        found.append(Group(tuple(_unique(tensors)), {**defaults, **group}))
    return found


def _unique(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def state_bytes(cls: type | None, groups: Sequence[Group]) -> tuple[int, str | None]:
    """The optimizer's state in bytes, and a note where the fallback rule gave it."""
    if cls is None or not groups:
        return 0, None
    rule = STATE_RULES.get(cls)
    if rule is not None:
        return sum(rule(group.settings) * group.nbytes for group in groups), None
    counted = _stepped_on_meta(cls, groups)
    if counted is not None:
        return counted, None
    total = FALLBACK_COPIES * sum(group.nbytes for group in groups)
    return total, (
        f"{cls.__name__}'s state could not be counted on the meta device (its step() failed there): "
        f"taken as {FALLBACK_COPIES} copies of the parameters it updates"
    )


def _stepped_on_meta(cls: type, groups: Sequence[Group]) -> int | None:
    """The bytes of the state ``cls`` keeps after one step over meta copies of the groups (None: failed)."""
    meta_groups = []
    for group in groups:
        copies = []
        for p in group.params:
            copy = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            if p.requires_grad:
                copy.grad = torch.zeros_like(copy)
            copies.append(copy)
        meta_groups.append({**group.settings, "params": copies})
    try:
        with torch.random.fork_rng(devices=[]):
            made = cls(meta_groups)
            made.step()
    except Exception:  # an optimizer that reads values back (.item()) or needs a closure
        return None
    storages: dict[int, int] = {}
    keep = []
    for state in made.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                storage = value.untyped_storage()
                keep.append(storage)
                storages[id(storage)] = value.numel() * value.element_size()
    return sum(storages.values())


#: Temporaries of one ``step()``, in copies of the largest parameter (one tensor at a time) or of the
#: group (torch's foreach implementation, the default on GPUs, works on the whole group at once):
#: Adam's ``exp_avg_sq.sqrt() / c`` makes two (one for foreach, which divides in place), Adagrad's and
#: RMSprop's square root one; a weight decay that is not decoupled (``grad.add(param)``) one more;
#: SGD's update works in place. Read from torch's ``torch/optim`` sources; other optimizers: none.
_TEMPORARIES = {
    torch.optim.Adam: (2, 1),
    torch.optim.AdamW: (2, 1),
    torch.optim.Adagrad: (1, 1),
    torch.optim.RMSprop: (1, 1),
}


def step_temporaries(cls: type | None, groups: Sequence[Group], device_type: str) -> int:
    """The largest bytes one ``step()`` allocates beyond the state, for parameters on ``device_type``."""
    if cls is None:
        return 0
    largest = 0
    for group in groups:
        if group.settings.get("fused"):
            continue
        foreach = group.settings.get("foreach")
        if foreach is None:  # torch's default: foreach where the kernels exist (CUDA), else one at a time
            foreach = device_type == "cuda" and not group.settings.get("differentiable", False)
        single, whole = _TEMPORARIES.get(cls, (0, 0))
        decay = 1 if group.settings.get("weight_decay", 0) and cls is not torch.optim.AdamW else 0
        size = group.nbytes if foreach else group.largest
        largest = max(largest, ((whole if foreach else single) + decay) * size)
    return largest
