"""Issue 20, item 10: the check before every forward costs the same whatever the model's size.

The DDP behind a wrapped model must be rebuilt when its parameters change after wrapping; the
change is now seen through events (``CURRENT.parameter_events``), not a walk over every parameter
at every step. One 2-process gloo run makes each kind of change and checks that the next
step's gradients are averaged (equal on both ranks, with different data on each), and times the
check on models of 30 and 3000 parameter tensors.
"""

from __future__ import annotations

import timeit

import torch
from torch import nn

import autoddp


def _layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))


def _averaged(model: nn.Module, dtype: torch.dtype) -> str:
    """Two steps on this rank's own data; 'averaged' when every gradient is equal on both ranks."""
    import torch.distributed as dist

    try:
        for step in range(2):
            generator = torch.Generator().manual_seed(10 * autoddp.rank() + step)
            x = torch.randn(8, 4, generator=generator).to(dtype)
            for p in model.parameters():
                p.grad = None
            model(x).square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        if any(g is None for g in grads):
            return "a trainable parameter got no gradient"
        flat = torch.cat([g.detach().double().flatten() for g in grads])
        copies = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(copies, flat)
        return "averaged" if torch.equal(copies[0], copies[1]) else "NOT averaged"
    except Exception as error:  # reported to the test, which names the change
        return f"{type(error).__name__}: {str(error)[:120]}"


class _Many(nn.Module):
    def __init__(self, tensors: int) -> None:
        super().__init__()
        self.values = nn.ParameterList(nn.Parameter(torch.zeros(1)) for _ in range(tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cat(list(self.values)).sum()


def _check_cost(tensors: int) -> float:
    """Best microseconds of the check before a forward with gradients (``Replica.for_call``)."""
    from autoddp.in_rank.models import _routing

    model = autoddp.prepare(_Many(tensors))
    replica = model.__dict__[_routing.REPLICA_ATTR]
    replica.for_call(model)  # (the first one broadcasts rank 0's weights)
    return min(timeit.repeat(lambda: replica.for_call(model), number=200, repeat=5)) / 200 * 1e6


def _watchers() -> dict:
    """Which submodules count calls made beside the DDP: only those of a model an optimizer's guard reads."""
    from autoddp.core import _compat
    from autoddp.in_rank.models import _averaging

    prepared = autoddp.prepare(_layers())
    _averaged(prepared, torch.float32)
    guarded = autoddp.prepare(_layers())
    _averaging.guard(torch.optim.SGD(guarded.parameters(), lr=0.1), [guarded])  # what capture does
    guarded[1] = nn.Linear(4, 4)  # (a rebuilt DDP keeps them)
    _averaged(guarded, torch.float32)
    return {
        "prepared": [_compat.routed_call(layer) is not None for layer in prepared],
        "guarded": [_compat.routed_call(layer) is not None for layer in guarded],
    }


def _changes_and_cost() -> dict:
    results = {}

    def change(name, edit, dtype=torch.float32):
        torch.manual_seed(0)
        model = autoddp.prepare(_layers())
        _averaged(model, torch.float32)  # DDP built and used before the change
        edit(model)
        results[name] = _averaged(model, dtype)

    def set_data(model):
        for p in model.parameters():
            p.data = p.data.double()

    def freeze(model):
        model[0].weight.requires_grad = False

    def unfreeze(model):
        model.requires_grad_(False)  # (a DDP over nothing: none is built)
        _averaged(model, torch.float32)
        for p in model[1].parameters():
            p.requires_grad_(True)

    def replace(model):
        model[1] = nn.Linear(4, 4)

    def detach(model):
        model[2].bias.detach_()

    def drop_bias(model):
        model[2].bias = None

    def drop_layer(model):
        del model[1]

    def convert_to_new_parameters(model):
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            model.double()
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)

    change("model.double()", lambda m: m.double(), torch.float64)
    change("a submodule's .double()", lambda m: [layer.double() for layer in m], torch.float64)
    change("p.data = p.data.double()", set_data, torch.float64)
    change("p.requires_grad = False", freeze)
    change("p.requires_grad_(True) after model.requires_grad_(False)", unfreeze)
    change("a replaced layer", replace)
    change("p.detach_()", detach)
    change("a parameter set to None", drop_bias)
    change("a layer deleted", drop_layer)
    change("double() making new Parameters", convert_to_new_parameters, torch.float64)
    results["compat"] = _compat_counts()
    results["watchers"] = _watchers()
    results["check_us"] = {tensors: _check_cost(tensors) for tensors in (30, 3000)}
    return results


def test_every_change_is_seen_and_the_check_does_not_grow_with_the_parameters():
    results = autoddp.distributed(nproc=2, backend="gloo", capture=False)(_changes_and_cost)()
    costs = results.pop("check_us")
    compat = results.pop("compat")
    # a submodule's call costs the plain call unless the optimizer's guard reads its counts
    assert results.pop("watchers") == {"prepared": [False] * 3, "guarded": [True] * 3}
    assert compat.pop("plain tensor") == 0 and compat.pop("watched") == [True, False], compat
    assert all(compat.values()), compat  # every hooked internal still reports its change
    assert results == dict.fromkeys(results, "averaged"), results
    # A walk over every parameter makes the 3000-tensor check ~100x the 30-tensor one.
    assert costs[3000] < 3 * costs[30] + 1.0, costs


def _compat_counts() -> dict:
    """How many events each change the DDP must see adds (``_compat.watch_parameter_changes``)."""
    from autoddp.core import _compat
    from autoddp.core.state import CURRENT
    from autoddp.in_rank.models import ddp

    base = torch._C.TensorBase
    assert type(base.__dict__["data"]).__name__ == "getset_descriptor", "TensorBase.data moved"
    assert type(base.__dict__["requires_grad"]).__name__ == "getset_descriptor", "requires_grad moved"
    ddp._watch_parameter_changes()
    ddp._watch_parameter_changes()  # once per process
    layer = nn.Linear(2, 2)
    one, two = nn.Parameter(torch.ones(1)), nn.Parameter(torch.zeros(1))
    plain = torch.ones(2, requires_grad=True)
    edits = {
        "data": lambda: setattr(layer.weight, "data", layer.weight.data.double()),
        "requires_grad": lambda: setattr(layer.weight, "requires_grad", False),
        "requires_grad_": lambda: layer.weight.requires_grad_(True),
        "detach_": lambda: layer.bias.detach_(),
        "_apply": lambda: layer.float(),
        "register_parameter None": lambda: setattr(layer, "bias", None),
        "__delattr__": lambda: delattr(layer, "weight"),
        "swap_tensors": lambda: torch.utils.swap_tensors(one, two),
        "plain tensor": lambda: plain.requires_grad_(False),
    }
    counts = {}
    for name, edit in edits.items():
        before = CURRENT.parameter_events
        edit()
        counts[name] = CURRENT.parameter_events - before
    p = nn.Parameter(torch.ones(2))
    counts["reads are torch's"] = p.requires_grad and p.data.dtype == torch.float32
    counts["watched"] = [_compat.parameter_changes_watched(t) for t in (p, torch.ones(1))]
    return counts
