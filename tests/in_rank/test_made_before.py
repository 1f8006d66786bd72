"""Models and optimizers made before the call (issue 38, items 1, 2 and 15).

Real 2-process gloo runs; each checks what a user checks: the weights equal to one process with
the global batch, on every rank. A trainer object that makes its model and optimizer in
``__init__`` (a decorated method, or the object passed to a decorated function), a model reached
only through a default argument, an FSDP model prepared after its optimizer was made, and
``model.no_sync()`` at one process.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from helpers import fork_or_skip
from torch import nn

import autoddp
from autoddp.in_rank import models
from conftest import needs_fsdp

N = 16  # samples: each rank takes its half, one process the whole (mean losses: the same step)
METHODS = ["fork", "spawn"]


def _share(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=generator)
    y = x @ torch.randn(4, 2, generator=generator)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[torch.Tensor]:
    x, y = _share(rank, world)
    for _ in range(5):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _identical(state: list[torch.Tensor]) -> bool:
    flat = torch.cat([p.flatten() for p in state])
    parts = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return all(torch.equal(parts[0], part) for part in parts)


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _one_process() -> list[torch.Tensor]:
    model = _net()
    return _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 0, 1)


class Trainer:
    """A Lightning-style trainer: the model and its optimizer made in ``__init__``, before any call."""

    def __init__(self, compiled: bool = False) -> None:
        self.model = _net()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        if compiled:  # the optimizer over the plain module's parameters, the compiled one trained
            self.model = torch.compile(self.model)

    def steps(self) -> tuple[list[torch.Tensor], bool]:
        state = _train(self.model, self.opt, autoddp.rank(), autoddp.world_size())
        return state, _identical(state)

    @autoddp.distributed(nproc=2, start_method="fork")
    def fit_forked(self) -> tuple[list[torch.Tensor], bool]:
        return self.steps()

    @autoddp.distributed(nproc=2, start_method="spawn")
    def fit_spawned(self) -> tuple[list[torch.Tensor], bool]:
        return self.steps()


@pytest.mark.parametrize("method", METHODS)
def test_a_decorated_method_trains_the_model_and_optimizer_its_object_made_before_the_call(method):
    if method == "fork":
        fork_or_skip()
    trainer = Trainer()
    state, identical = trainer.fit_forked() if method == "fork" else trainer.fit_spawned()
    assert identical  # (before: every rank trained its own copy, 4e-2 from one process)
    _close(state, _one_process())


def test_the_notice_names_a_model_made_before_the_call_and_wrapped(capfd):
    fork_or_skip()
    Trainer().fit_forked()
    err = capfd.readouterr().err
    # (before: no line for it, and "no optimizer was made over" the model)
    assert "Sequential (made before the call): DDP across 2 processes, found through the SGD" in err
    assert err.count("Sequential (made before the call)") == 1  # rank 0 alone says it


@pytest.mark.parametrize("method", METHODS)
def test_a_trainer_object_passed_to_a_decorated_function_is_trained_as_one_process(method):
    if method == "fork":
        fork_or_skip()

    @autoddp.distributed(nproc=2, start_method=method)
    def fit(trainer: Trainer) -> tuple[list[torch.Tensor], bool]:
        return trainer.steps()

    state, identical = fit(Trainer())
    assert identical
    _close(state, _one_process())


def test_a_compiled_model_made_before_the_call_with_its_optimizer_is_trained_as_one_process():
    fork_or_skip()  # (torch.compile runs in the workers only: this process never compiles)
    state, identical = Trainer(compiled=True).fit_forked()
    assert identical
    _close(state, _one_process())


_DEFAULT = _net()


def test_a_model_reached_only_through_a_default_argument_is_wrapped_with_capture_off():
    @autoddp.distributed(nproc=2, capture=False)
    def fit(model: nn.Module = _DEFAULT) -> tuple[list[torch.Tensor], bool]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        state = _train(model, opt, autoddp.rank(), autoddp.world_size())
        return state, _identical(state)

    state, identical = fit()
    assert identical
    _close(state, _one_process())


class SelfTraining(nn.Module):
    """A module that makes its own optimizer and trains itself in a decorated method."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()
        self.opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @autoddp.distributed(nproc=2, start_method="fork")
    def fit(self) -> tuple[list[torch.Tensor], bool]:
        state = _train(self, self.opt, autoddp.rank(), autoddp.world_size())
        return state, _identical(state)


def test_a_module_that_holds_its_own_optimizer_and_trains_itself_in_a_decorated_method():
    fork_or_skip()
    state, identical = SelfTraining().fit()
    assert identical
    _close(state, _one_process())


_GLOBAL_NET = _net()
_GLOBAL_OPT = torch.optim.SGD(_GLOBAL_NET.parameters(), lr=0.1, momentum=0.9)


def test_a_global_model_and_optimizer_made_before_the_call_are_trained_as_one_process():
    fork_or_skip()

    @autoddp.distributed(nproc=2, start_method="fork")
    def fit() -> tuple[list[torch.Tensor], bool]:
        state = _train(_GLOBAL_NET, _GLOBAL_OPT, autoddp.rank(), autoddp.world_size())
        return state, _identical(state)

    state, identical = fit()
    assert identical
    _close(state, _one_process())


def test_an_optimizer_over_a_model_the_call_cannot_reach_is_said():
    hidden = _net()
    reach = lambda: hidden  # noqa: E731  (a closure in an attribute: not walked)

    class Holder:
        def __init__(self) -> None:
            self.reach = reach
            self.opt = torch.optim.SGD(hidden.parameters(), lr=0.1)

    @autoddp.distributed(nproc=2, start_method="fork")
    def fit(holder: Holder) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from autoddp.in_rank._prepare import prepare_call

            prepare_call(fit.__wrapped__, (holder,), {})  # (what the call did before the body ran)
        return [str(w.message) for w in caught]

    fork_or_skip()
    said = fit(Holder())
    assert any("SGD made before this call trains 4 parameters" in line for line in said), said
    assert any("every process trains its own copy" in line for line in said), said


# --- 2: FSDP under an optimizer made before prepare ----------------------------------------------


@needs_fsdp
def test_fsdp_prepare_after_the_optimizer_rebinds_it_to_the_sharded_parameters():
    @autoddp.distributed(nproc=2, strategy="fsdp", capture=False)
    def fit() -> list[torch.Tensor]:
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # before prepare
        model = autoddp.prepare(model)
        _train(model, opt, autoddp.rank(), autoddp.world_size())
        return [p.full_tensor().clone() for p in model.parameters()]

    _close(fit(), _one_process())  # (before: every step did nothing, the weights as initialised)


@needs_fsdp
def test_fsdp_trainer_object_made_before_the_call_is_sharded_and_its_optimizer_rebound():
    @autoddp.distributed(nproc=2, strategy="fsdp")
    def fit(trainer: Trainer) -> list[torch.Tensor]:
        _train(trainer.model, trainer.opt, autoddp.rank(), autoddp.world_size())
        return [p.full_tensor().clone() for p in trainer.model.parameters()]

    _close(fit(Trainer()), _one_process())


@needs_fsdp
def test_fsdp_a_model_and_its_optimizer_passed_as_arguments_are_sharded_and_rebound():
    fork_or_skip()  # (what the caller made is frozen away from the collector in a forked worker)

    @autoddp.distributed(nproc=2, strategy="fsdp", capture=False, start_method="fork")
    def fit(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        _train(model, opt, autoddp.rank(), autoddp.world_size())
        return [p.full_tensor().clone() for p in model.parameters()]

    model = _net()
    _close(fit(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)), _one_process())


def _hidden_optimizer(model: nn.Module) -> Callable[[], torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return lambda: opt  # (reached only through a closure autoddp does not walk)


@needs_fsdp
def test_fsdp_an_optimizer_autoddp_cannot_find_is_refused_at_its_step():
    fork_or_skip()

    @autoddp.distributed(nproc=2, strategy="fsdp", capture=False, start_method="fork")
    def fit(model: nn.Module, get_opt: Callable[[], torch.optim.Optimizer]) -> None:
        _train(model, get_opt(), autoddp.rank(), autoddp.world_size())

    with pytest.raises(autoddp.ConfigurationError, match="after model = autoddp.prepare"):
        model = _net()
        fit(model, _hidden_optimizer(model))  # (before: five steps that changed nothing, no word)


def _warmed(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Two steps on the whole batch, the same on every rank (the optimizer's momentum is made)."""
    x, y = _share(0, 1)
    for _ in range(2):
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@needs_fsdp
def test_fsdp_prepare_after_steps_carries_the_optimizer_state_into_the_shards():
    @autoddp.distributed(nproc=2, strategy="fsdp", capture=False)
    def fit() -> list[torch.Tensor]:
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _warmed(model, opt)
        model = autoddp.prepare(model)
        _train(model, opt, autoddp.rank(), autoddp.world_size())
        return [p.full_tensor().clone() for p in model.parameters()]

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _warmed(model, opt)
    _close(fit(), _train(model, opt, 0, 1))


# --- 5: pruning a model wrapped before the optimizer is made ----------------------------------


def test_a_model_pruned_under_capture_after_it_was_wrapped_keeps_one_ddp():
    import torch.nn.utils.prune as prune

    def run(model: nn.Module, rank: int, world: int) -> list[torch.Tensor]:
        prune.l1_unstructured(model[0], name="weight", amount=0.5)  # weight_orig: a new parameter
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _train(model, opt, rank, world)
        prune.remove(model[0], "weight")
        return _train(model, opt, rank, world)

    @autoddp.distributed(nproc=2)
    def fit(model: nn.Module) -> tuple[list[torch.Tensor], bool, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = run(model, autoddp.rank(), autoddp.world_size())
        own = ["the Linear has a DDP of its own"] if models.distributed(model[0]) else []
        return state, _identical(state), [str(w.message) for w in caught] + own

    state, identical, said = fit(_net())
    assert identical
    assert said == []  # (before: the pruned Linear got a DDP of its own inside the model's, said)
    _close(state, run(_net(), 0, 1))


# --- 15: model.no_sync() at one process -----------------------------------------------------------


def _accumulate(rank: int, world: int) -> list[torch.Tensor]:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _share(rank, world)
    for _ in range(3):
        opt.zero_grad()
        with model.no_sync():  # the documented accumulation idiom: the first half without a sync
            (model(x[: len(x) // 2]) - y[: len(x) // 2]).pow(2).mean().div(2).backward()
        (model(x[len(x) // 2 :]) - y[len(x) // 2 :]).pow(2).mean().div(2).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_no_sync_works_at_one_process_and_leaves_modules_as_they_were():
    @autoddp.distributed(nproc=1)
    def fit() -> tuple[list[torch.Tensor], bool]:
        return _accumulate(0, 1), hasattr(nn.Linear(1, 1), "no_sync")

    state, had = fit()
    assert had
    assert not hasattr(nn.Linear(1, 1), "no_sync")  # (after the call, modules are as they were)
    reference = _net()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = _share(0, 1)
    for _ in range(3):
        opt.zero_grad()
        (reference(x[: N // 2]) - y[: N // 2]).pow(2).mean().div(2).backward()
        (reference(x[N // 2 :]) - y[N // 2 :]).pow(2).mean().div(2).backward()
        opt.step()
    _close(state, [p.detach() for p in reference.parameters()])


def test_no_sync_works_under_the_command_with_one_process(tmp_path):
    from conftest import run_python, write

    script = write(
        tmp_path / "accumulate.py",
        """
        import torch
        from torch import nn
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.no_sync():
            model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        print("ACCUMULATED")
        """,
    )
    ran = run_python(["-m", "autoddp.cli", "-n", "1", str(script)])
    assert ran.returncode == 0, ran.stderr
    assert "ACCUMULATED" in ran.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
