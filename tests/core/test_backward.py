"""The one wrapper of ``torch.autograd.backward`` (``core._backward``): each watcher's ``before`` and
``after`` in the wrappers' nesting order, a watcher with nothing to do not called back, errors in
the pass or in a watcher, and the function put back exactly when the last watcher leaves."""

from __future__ import annotations

import pytest
import torch
from helpers import fork_or_skip

import autoddp
from autoddp.core import _backward, _patches
from autoddp.core.errors import TorchCompatibilityError


class Recorder:
    """A watcher that writes what it sees into ``log`` (``skip``: nothing to do after the pass)."""

    def __init__(self, name: str, log: list, skip: bool = False, fails: str = "") -> None:
        self.name, self.log, self.skip, self.fails = name, log, skip, fails

    def before(self, args: tuple, kwargs: dict, thread: int) -> object:
        self.log.append(("before", self.name))
        if self.fails == "before":
            raise ValueError(self.name)
        return _backward.SKIP if self.skip else self.name

    def after(self, token: object, args: tuple, kwargs: dict, raised: bool) -> None:
        self.log.append(("after", self.name, token, raised))
        if self.fails == "after":
            raise KeyError(self.name)


def _loss() -> torch.Tensor:
    return (torch.ones(2, requires_grad=True) * 2).sum()


@pytest.mark.unit
def test_one_wrapper_calls_the_watchers_nested_as_wrappers_would_and_leaves_with_the_last():
    original = torch.autograd.backward
    calls, log = _backward.BackwardCalls(), []
    inner, idle, outer = Recorder("inner", log), Recorder("idle", log, skip=True), Recorder("outer", log)
    try:
        for watcher in (inner, idle, outer):
            calls.add(watcher)
        calls.add(inner)  # (twice: once)
        wrapper = torch.autograd.backward
        assert wrapper is not original and wrapper.__wrapped__ is original  # one layer for all three
        _loss().backward()
        assert log == [
            ("before", "outer"),
            ("before", "idle"),
            ("before", "inner"),
            ("after", "inner", "inner", False),
            ("after", "outer", "outer", False),
        ]
        log.clear()
        calls.listen(outer, False)  # nothing to do for a while: not called at all
        _loss().backward()
        assert [entry[1] for entry in log] == ["idle", "inner", "inner"]
        calls.remove(inner)
        calls.remove(idle)
        assert torch.autograd.backward is wrapper
        calls.remove(outer)  # the last one: the function put back exactly
        assert torch.autograd.backward is original
        calls.add(inner)
        assert torch.autograd.backward is wrapper  # made once per original: the very same object
    finally:
        for watcher in (inner, idle, outer):
            calls.remove(watcher)
    assert torch.autograd.backward is original


@pytest.mark.unit
def test_a_pass_or_a_watcher_that_raises_still_ends_every_watcher_that_began():
    calls, log = _backward.BackwardCalls(), []
    inner, outer = Recorder("inner", log), Recorder("outer", log)
    calls.add(inner)
    calls.add(outer)
    try:
        with pytest.raises(RuntimeError):  # the pass fails: both told so, innermost first
            torch.ones(2).sum().backward()
        assert log[2:] == [("after", "inner", "inner", True), ("after", "outer", "outer", True)]
        log.clear()
        inner.fails = "before"  # the outer one began: it ends, told the pass failed
        with pytest.raises(ValueError):
            _loss().backward()
        assert log == [("before", "outer"), ("before", "inner"), ("after", "outer", "outer", True)]
        log.clear()
        inner.fails = "after"  # the outer one still ends
        with pytest.raises(KeyError):
            _loss().backward()
        assert log[-1] == ("after", "outer", "outer", True)
    finally:
        calls.remove(inner)
        calls.remove(outer)


@pytest.mark.unit
def test_a_wrapper_of_someone_else_over_ours_stays_when_ours_leaves():
    original = torch.autograd.backward
    calls, log = _backward.BackwardCalls(), []
    watcher = Recorder("ours", log)
    calls.add(watcher)
    ours = torch.autograd.backward
    theirs = _patches.install([(torch.autograd, "backward", lambda *a, **k: ours(*a, **k))])
    try:
        calls.remove(watcher)  # ours is not on top: theirs stays, and will put ours back
        assert torch.autograd.backward is not original
    finally:
        theirs.restore()
    assert torch.autograd.backward is original


def _layers_over_backward() -> tuple[int, str]:
    """How many wrappers stand over ``torch.autograd.backward`` (``functools.wraps``' chain), and
    what is under them."""
    function, layers = torch.autograd.backward, 0
    while hasattr(function, "__wrapped__"):
        function, layers = function.__wrapped__, layers + 1
    return layers, f"{function.__module__}.{function.__qualname__}"


@autoddp.distributed(nproc=2, start_method="fork")
def _training_with_every_watcher() -> tuple[int, str]:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        opt.step()
    return _layers_over_backward()


@pytest.mark.timeout(120)
def test_a_worker_s_backward_is_wrapped_once_for_capture_the_marks_and_the_step_report():
    """Capture, the hang report's marks and the step report all watch each ``backward()`` of the
    user's code, through one layer (four before, with capture's count: a frame each per step)."""
    fork_or_skip()
    assert _training_with_every_watcher() == (1, "torch.autograd.backward")
    assert _layers_over_backward() == (0, "torch.autograd.backward")  # the caller's, untouched


class Seen:
    """A watcher that keeps each call's arguments."""

    def __init__(self) -> None:
        self.args = []

    def before(self, args: tuple, kwargs: dict, thread: int) -> object:
        self.args.append((args, dict(kwargs)))
        return None

    def after(self, token: object, args: tuple, kwargs: dict, raised: bool) -> None:
        pass


@pytest.mark.unit
def test_the_wrapper_takes_torch_s_parameters_and_goes_with_its_last_watcher():
    """Positional or by keyword, the wrapper binds torch.autograd.backward's parameters (the
    watchers get them in ``PARAMETERS``' order); the last watcher out puts the function back."""
    original = torch.autograd.backward
    calls, seen = _backward.BackwardCalls(), Seen()
    leaf = torch.ones(2, requires_grad=True)
    try:
        calls.add(seen)
        (leaf * 2).sum().backward()
        loss = (leaf * 3).sum()
        torch.autograd.backward(tensors=loss, retain_graph=True, inputs=[leaf])
        assert leaf.grad.tolist() == [5.0, 5.0]
        assert [len(args) for args, _ in seen.args] == [6, 6] and seen.args[1][1] == {}
        assert seen.args[1][0][0] is loss and seen.args[1][0][2] is True and seen.args[1][0][5] == [leaf]
        calls.remove(seen)
        assert torch.autograd.backward is original
    finally:
        calls.remove(seen)
        torch.autograd.backward = original


@pytest.mark.unit
def test_a_torch_whose_backward_takes_other_parameters_is_a_loud_error(monkeypatch):
    def backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
        pass

    monkeypatch.setattr(torch.autograd, "backward", backward)
    with pytest.raises(TorchCompatibilityError, match="torch.autograd.backward"):
        _backward.BackwardCalls().add(Seen())
