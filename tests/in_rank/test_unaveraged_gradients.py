"""Gradients that DDP did not average are never stepped silently (issue 31, item 3).

Real 2-process gloo runs of habits whose gradients reach ``.grad`` without DDP's averaging, or
whose optimizer decides on the loss: each ends with the weights of one process with the global
batch, and the averaging autoddp adds is said once, at the user's line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoddp
from autoddp.core import _compat
from conftest import run_python

N = 16  # samples: each rank takes its half, one process the whole (mean losses: the same step)


def _share(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=generator)
    y = x @ torch.randn(4, 2, generator=generator)
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _by_autograd_grad(rank: int, world: int, gradients=torch.autograd.grad) -> nn.Module:
    x, y = _share(rank, world)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        loss = (model(x) - y).pow(2).mean()
        params = list(model.parameters())
        grads = gradients(loss, params)  # (the default: torch.autograd.grad as imported, unpatched)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()  # STEP LINE
    return model


def _two_backwards(rank: int, world: int, steps: int = 6) -> nn.Module:
    x, y = _share(rank, world)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    half = len(x) // 2
    for step in range(steps):
        opt.zero_grad()
        if step < 2:  # ordinary steps first: accumulation under no_sync, clipping: nothing to say
            with getattr(model, "no_sync", contextlib.nullcontext)():  # (one process: none)
                (model(x[:half]) - y[:half]).pow(2).mean().div(2).backward()
            (model(x[half:]) - y[half:]).pow(2).mean().div(2).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif step == 2:  # two forwards, one backward: nothing to say either
            first, second = (model(x[:half]) - y[:half]), (model(x[half:]) - y[half:])
            (first.pow(2).mean() + second.pow(2).mean()).backward()
        else:
            out = model(x)
            (out - y).pow(2).mean().backward(retain_graph=True)
            out.abs().mean().backward()
        opt.step()  # STEP LINE
    return model


def _trained(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.optim.Optimizer]:
    """This rank's data, the model and its optimizer."""
    model = _model()
    return (*_share(rank, world), model, torch.optim.SGD(model.parameters(), lr=0.1))


def _two_backwards_by_a_bound_name(rank: int, world: int, backward=torch.autograd.backward) -> nn.Module:
    x, y, model, opt = _trained(rank, world)
    for _ in range(4):
        opt.zero_grad()
        out = model(x)
        backward((out - y).pow(2).mean(), retain_graph=True)  # (the default: as imported, unpatched)
        backward(out.abs().mean())
        opt.step()  # STEP LINE
    return model


def _two_forwards_then_a_backward_each(rank: int, world: int) -> nn.Module:
    x, y, model, opt = _trained(rank, world)
    half = len(x) // 2
    for _ in range(4):
        opt.zero_grad()
        first, second = model(x[:half]), model(x[half:])  # (DDP averages the first backward after them)
        (first - y[:half]).pow(2).mean().div(2).backward()
        (second - y[half:]).pow(2).mean().div(2).backward()
        opt.step()  # STEP LINE
    return model


def _by_functional_call(rank: int, world: int) -> nn.Module:
    x, y, model, opt = _trained(rank, world)
    for _ in range(3):
        loss = lambda params: (torch.func.functional_call(model, params, (x,)) - y).pow(2).mean()  # noqa: E731
        grads = torch.func.grad(loss)(dict(model.named_parameters()))
        for name, p in model.named_parameters():
            p.grad = grads[name]
        opt.step()  # STEP LINE
    return model


def _grad_in_a_hook(rank: int, world: int, gradients=torch.autograd.grad) -> nn.Module:
    x, y, model, opt = _trained(rank, world)
    for _ in range(4):
        out = model(x)
        extra = model(x * 2).pow(2).mean() * 0.1  # differentiated by grad alone, inside the backward
        params, found = list(model.parameters()), []
        out.register_hook(lambda g, f=found, e=extra, ps=params: f.append(gradients(e, ps)))  # (unpatched)
        (out - y).pow(2).mean().backward()
        for p, g in zip(params, found[0], strict=True):
            p.grad.add_(g)
        opt.step()  # STEP LINE
        opt.zero_grad()
    return model


def _pass_in_a_hook_before_the_output(rank: int, world: int, by_grad: bool = False) -> nn.Module:
    x, y, model, opt = _trained(rank, world)
    for _ in range(3):
        opt.zero_grad()
        out, extra = model(x), model(x * 2).pow(2).mean() * 0.1
        params, found, error = list(model.parameters()), [], (out - y) * 1.0
        if by_grad:  # its results added to .grad after the pass
            error.register_hook(lambda g, f=found, e=extra, ps=params: f.append(torch.autograd.grad(e, ps)))
        else:  # a second backward through the forward, begun before the output's hook
            aux = out.abs().mean()
            error.register_hook(lambda g, a=aux: a.backward(retain_graph=True))
        error.pow(2).mean().backward()
        for p, g in zip(params, found[0] if found else [], strict=False):
            p.grad.add_(g)
        opt.step()  # STEP LINE
    return model


def _grad_in_a_hook_before_the_output(rank: int, world: int) -> nn.Module:
    return _pass_in_a_hook_before_the_output(rank, world, by_grad=True)


def _saliency_on_rank0(rank: int, world: int) -> nn.Module:
    x, y, model, opt = _trained(rank, world)
    for _ in range(3):
        opt.zero_grad()
        image = x.clone().requires_grad_()
        out = model(image)
        loss = (out - y).pow(2).mean()
        loss.backward(retain_graph=True)
        if rank == 0:  # a saliency map, logged by one rank: nothing of the model's .grad
            torch.autograd.grad(loss, image, retain_graph=True)
            loss.backward(inputs=[image])
        torch.save(out, io.BytesIO())  # (the output's hooks say nothing)
        opt.step()
    return model


@dataclasses.dataclass
class Output:
    prediction: torch.Tensor


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.net(x))


class Policy(Regressor):
    """A forward that returns a ``torch.distributions`` object (a policy), no container."""

    def forward(self, x: torch.Tensor) -> torch.distributions.Normal:  # type: ignore[override]
        mean = self.net(x)
        return torch.distributions.Normal(mean, torch.ones_like(mean))


def _two_backwards_through_a_dataclass(rank: int, world: int, policy: bool = False) -> nn.Module:
    x, y = _share(rank, world)
    model = Policy() if policy else Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        out = model(x)
        if policy:
            first, second = -out.log_prob(y).mean(), out.mean.abs().mean()
        else:
            first, second = (out.prediction - y).pow(2).mean(), out.prediction.abs().mean()
        first.backward(retain_graph=True)
        second.backward()
        opt.step()  # STEP LINE
    return model


def _two_backwards_through_a_distribution(rank: int, world: int) -> nn.Module:
    return _two_backwards_through_a_dataclass(rank, world, policy=True)


def _ordinary(rank: int, world: int) -> nn.Module:
    return _two_backwards(rank, world, steps=3)


def _stepped_in_backward(rank: int, world: int) -> nn.Module:
    x, y = _share(rank, world)
    model = _model()
    optimizers = {p: torch.optim.Adam([p], lr=0.05) for p in model.parameters()}

    def step_now(p: torch.Tensor) -> None:
        optimizers[p].step()  # STEP LINE
        optimizers[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    for _ in range(4):
        (model(x) - y).pow(2).mean().backward()
    return model


def _lbfgs(rank: int, world: int, second_backward: bool = False) -> nn.Module:
    x, y = _share(rank, world)
    model = _model()
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=5, line_search_fn="strong_wolfe")
    for _ in range(3):

        def closure() -> torch.Tensor:
            opt.zero_grad()
            out = model(x)
            loss = (out - y).pow(2).mean()
            loss.backward(retain_graph=second_backward)
            if second_backward:  # gradients DDP does not average, inside the step
                out.abs().mean().mul(0.1).backward()
            return loss

        opt.step(closure)  # STEP LINE
    return model


def _lbfgs_two_backwards(rank: int, world: int) -> nn.Module:
    return _lbfgs(rank, world, second_backward=True)


def _run(habit) -> tuple[list[torch.Tensor], list[tuple[str, str, int]]]:
    @autoddp.distributed(nproc=2)
    def train():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = habit(autoddp.rank(), autoddp.world_size())
        flat = _flat(model)
        everyone = [torch.zeros_like(flat) for _ in range(autoddp.world_size())]
        dist.all_gather(everyone, flat)
        return everyone, [(str(w.message), w.filename, w.lineno) for w in caught]

    return train()


def _step_line(habit) -> int:
    import inspect

    lines, first = inspect.getsourcelines(habit)
    return first + next(i for i, line in enumerate(lines) if "# STEP LINE" in line)


def _check(habit, words: str, written_in=None) -> None:
    everyone, messages = _run(habit)
    one = _flat(habit(0, 1))
    assert torch.equal(everyone[0], everyone[1])  # the ranks agree
    torch.testing.assert_close(everyone[0], one, rtol=1e-5, atol=1e-6)  # and equal one process
    assert len(messages) == 1, messages
    text, filename, line = messages[0]
    assert words in text and "autoddp average" in text, text
    assert (filename, line) == (__file__, _step_line(written_in or habit))


def _by_torch_autograd_grad(rank: int, world: int) -> nn.Module:
    return _by_autograd_grad(rank, world, lambda loss, params: torch.autograd.grad(loss, params))


def test_gradients_from_autograd_grad_put_into_grad_by_hand_are_averaged_and_said():
    _check(_by_autograd_grad, "torch.autograd.grad")  # the name bound before the call (unpatched)
    _check(_by_torch_autograd_grad, "torch.autograd.grad", _by_autograd_grad)  # looked up in the call


def test_a_second_backward_through_one_forward_is_averaged_and_said():
    _check(_two_backwards, "retain_graph=True")


def test_a_second_backward_under_a_name_bound_before_the_call_is_averaged_and_said():
    _check(_two_backwards_by_a_bound_name, "retain_graph=True")


def test_two_forwards_then_a_backward_for_each_is_averaged_and_said():
    _check(_two_forwards_then_a_backward_each, "two forwards, then a backward for each")


def _second_backwards_of_both_kinds(x, y, model, opt) -> nn.Module:
    half = len(x) // 2
    for step in range(4):
        opt.zero_grad()
        if step % 2:  # two forwards, then a backward for each
            parts = [model(x[:half]) - y[:half], model(x[half:]) - y[half:]]
            losses = [part.pow(2).mean().div(2) for part in parts]
        else:  # one forward, two backward passes through it
            out = model(x)
            losses = [(out - y).pow(2).mean(), out.abs().mean()]
        losses[0].backward(retain_graph=True)
        losses[1].backward()
        opt.step()
    return model


def test_with_capture_off_a_model_and_optimizer_passed_in_are_guarded_as_under_capture():
    """``capture=False``: the model its optimizer was made with before the call is wrapped and its
    steps guarded all the same, so its backward passes are counted as under capture (they were not:
    a second backward and two forwards then a backward each went unaveraged, silently)."""

    @autoddp.distributed(nproc=2, capture=False)
    def train(model, opt):
        x, y = _share(autoddp.rank(), autoddp.world_size())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _second_backwards_of_both_kinds(x, y, model, opt)
        flat = _flat(model)
        everyone = [torch.zeros_like(flat) for _ in range(autoddp.world_size())]
        dist.all_gather(everyone, flat)
        return everyone, [str(w.message) for w in caught]

    model = _model()
    everyone, messages = train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    one = _model()
    _second_backwards_of_both_kinds(*_share(0, 1), one, torch.optim.SGD(one.parameters(), lr=0.1))
    assert torch.equal(everyone[0], everyone[1])
    torch.testing.assert_close(everyone[0], _flat(one), rtol=1e-5, atol=1e-6)
    assert len(messages) == 1 and "autoddp average" in messages[0], messages


def test_gradients_from_torch_func_grad_over_functional_call_are_averaged_and_said():
    """``torch.func.functional_call`` swaps the parameters for the caller's tensors, which DDP cannot
    run on (it used to fail building a DDP over them): the call is the module's own, and the
    gradients put into ``.grad`` are averaged at the step."""
    _check(_by_functional_call, "torch.func.functional_call")


def test_grad_called_in_a_hook_during_a_backward_under_a_name_bound_before_is_averaged_and_said():
    _check(_grad_in_a_hook, "torch.autograd.grad")


def test_a_pass_run_from_a_hook_before_the_output_is_told_from_the_pass_around_it():
    """A backward or ``grad`` run from a hook the outer pass reaches before the model's output: the
    outer pass is still a second backward, and the nested ``grad``'s mark is kept (they were
    taken for one pass, silently)."""
    _check(_pass_in_a_hook_before_the_output, "retain_graph=True")
    _check(_grad_in_a_hook_before_the_output, "torch.autograd.grad", _pass_in_a_hook_before_the_output)


def test_a_pass_given_inputs_outside_the_model_leaves_it_alone_on_one_rank_too():
    """``grad(loss, image)`` and ``backward(inputs=[image])`` on rank 0 alone (a saliency map) touch
    no ``.grad`` of the model's: nothing averaged (it hung: rank 0 averaged alone), nothing said,
    and saving an output says nothing either."""
    everyone, messages = _run(_saliency_on_rank0)
    assert torch.equal(everyone[0], everyone[1])
    torch.testing.assert_close(everyone[0], _flat(_saliency_on_rank0(0, 1)), rtol=1e-5, atol=1e-6)
    assert messages == []


def test_a_second_backward_through_a_forward_returning_a_dataclass_is_averaged_and_said():
    _check(_two_backwards_through_a_dataclass, "retain_graph=True")


def test_a_second_backward_through_a_forward_returning_a_distribution_is_averaged_and_said():
    _check(_two_backwards_through_a_distribution, "retain_graph=True", _two_backwards_through_a_dataclass)


def test_ordinary_steps_are_left_to_ddp_alone():
    everyone, messages = _run(_ordinary)  # no_sync accumulation, clipping, two forwards, one backward
    assert torch.equal(everyone[0], everyone[1])
    torch.testing.assert_close(everyone[0], _flat(_ordinary(0, 1)), rtol=1e-5, atol=1e-6)
    assert messages == []


def _hooked(rank: int, world: int) -> nn.Module:
    x, y = _share(rank, world)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = None
    for step in range(5):
        if step == 1:  # the model's own hook, added after a step without any
            model.register_forward_hook(lambda module, args, out: out * 2)
        elif step == 2:  # a global one, for the model's calls (DDP's own calls too: it lets them be)
            handle = nn.modules.module.register_module_forward_hook(
                lambda module, args, out: out + 1 if module is model else None
            )
        elif step == 4 and handle is not None:
            handle.remove()
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    return model


def test_hooks_on_the_model_and_global_ones_run_as_in_one_process():
    """The routing calls DDP's forward and the module's directly only where Module.__call__ would
    run nothing else: a hook of the model's, or a global one, added at any step, still runs."""
    everyone, messages = _run(_hooked)
    assert torch.equal(everyone[0], everyone[1])
    torch.testing.assert_close(everyone[0], _flat(_hooked(0, 1)), rtol=1e-5, atol=1e-6)
    assert messages == []


def test_an_optimizer_stepped_inside_the_backward_pass_steps_on_averaged_gradients():
    _check(_stepped_in_backward, "inside the backward pass")


def test_lbfgs_line_search_decides_on_the_global_loss_like_one_process():
    everyone, messages = _run(_lbfgs)
    one = _flat(_lbfgs(0, 1))
    assert torch.equal(everyone[0], everyone[1])
    torch.testing.assert_close(everyone[0], one, rtol=1e-4, atol=1e-5)
    assert messages == []


class Checkpointed(nn.Module):
    """A block recomputed in the backward pass by the reentrant ``torch.utils.checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.block, self.last = nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(self.block, self.first(x), use_reentrant=True)
        return self.last(torch.tanh(hidden))


def _checkpointed(rank: int, world: int) -> tuple[nn.Module, list[int]]:
    x, y = _share(rank, world)
    model = Checkpointed()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    issued = []
    for _ in range(4):
        before = _compat.collectives_issued() if dist.is_initialized() else 0
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        issued.append((_compat.collectives_issued() if dist.is_initialized() else 0) - before)
    return model, issued


def test_a_block_recomputed_by_the_reentrant_checkpoint_is_no_call_beside_the_ddp():
    """The reentrant checkpoint calls the block again inside the backward pass, outside the DDP's
    forward: its own forward recomputed, not an auxiliary loss. Nothing is said, nothing averaged
    again (DDP's one all-reduce a step), and the weights are one process's."""

    @autoddp.distributed(nproc=2)
    def train():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, issued = _checkpointed(autoddp.rank(), autoddp.world_size())
        return _flat(model), issued, [str(w.message) for w in caught if "autoddp" in str(w.message)]

    weights, issued, messages = train()
    torch.testing.assert_close(weights, _flat(_checkpointed(0, 1)[0]), rtol=1e-5, atol=1e-6)
    assert messages == []
    assert issued[2:] == [1, 1], issued  # (the first steps: capture's agreement, DDP's bucket rebuild)


def test_lbfgs_averages_what_its_closure_leaves_unaveraged_at_every_call():
    _check(_lbfgs_two_backwards, "retain_graph=True", _lbfgs)


#: An unchanged script for the command, where capture counts every backward from the first line and
#: hooks every forward's outputs (``models._reduction``): ``python s.py HABIT``.
SCRIPT = """
    import json, sys, torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.randn(4, 2, generator=g)
    data = torch.utils.data.TensorDataset(x, y)
    order = torch.Generator().manual_seed(2)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=order)
    habit = sys.argv[1]

    def issued():  # the collectives this rank issued so far (none in one process)
        import torch.distributed as dist
        from autoddp.core import _compat
        return _compat.collectives_issued() if dist.is_initialized() else 0

    counts = []
    for epoch in range(2):
        for step, (xb, yb) in enumerate(loader):
            before = issued()
            opt.zero_grad()
            out = model(xb)
            loss = (out - yb).pow(2).mean()
            if habit == "two backwards" or (habit == "later" and epoch == 1 and step == 2):
                loss.backward(retain_graph=True)
                (out - yb).abs().mean().backward()  # a second backward through the same forward
            elif habit == "grad by hand":
                params = list(model.parameters())
                for p, grad in zip(params, torch.autograd.grad(loss, params)):
                    p.grad = grad
            else:
                loss.backward()
            opt.step()
            counts.append(issued() - before)
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    print("RESULT", json.dumps({"weights": weights, "counts": counts}))
"""


@pytest.mark.parametrize("habit", ["ordinary", "two backwards", "later", "grad by hand"])
def test_under_the_command_gradients_ddp_did_not_average_are_averaged_from_the_first_step(tmp_path, habit):
    """Under the command, the step that first leaves gradients DDP did not average (the first
    step, or a later one) still steps on one process's gradients (``--split-batches``: each rank
    half of every batch), and ordinary steps, before and after it, cost DDP's one all-reduce."""
    script = tmp_path / "habit.py"
    script.write_text(textwrap.dedent(SCRIPT))
    alone = run_python([str(script), habit], timeout=60)
    assert alone.returncode == 0, alone.stderr
    ran = run_python(["-m", "autoddp.cli", "-n", "2", "--split-batches", str(script), habit], timeout=90)
    assert ran.returncode == 0, ran.stderr
    theirs = json.loads(alone.stdout.split("RESULT ", 1)[1])
    ours = json.loads(ran.stdout.split("RESULT ", 1)[1])
    for a, b in zip(ours["weights"], theirs["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)
    # Per step: DDP's all-reduce and split_batches' of the loss (a backward's); not the first two
    # steps (the first holds capture's first-step agreement, the second DDP's bucket rebuild).
    counts = ours["counts"][2:]
    if habit == "ordinary":
        assert counts == [2] * 6, ours["counts"]
    elif habit == "later":  # epoch 1, step 2: a second backward's loss, and autoddp's averaging
        assert counts == [2] * 4 + [4, 2], ours["counts"]
