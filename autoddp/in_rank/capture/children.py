"""Processes the user's code starts itself: training there is not distributed, and is said so.

A script that trains in processes of its own (pytorch/examples' ``mnist_hogwild``:
``model.share_memory()``, then ``mp.Process(target=train, args=(rank, args, model, ...))``) makes
no optimizer and runs no backward in the process autoddp started: each of the N ranks starts its
own children, and they train the whole data set, N times over. Capture cannot distribute what runs
there, so it says so, in the notice:

- at the ``join()`` of such a process, when the weights of a model it was given changed (training
  ran there) while this rank made no optimizer and ran no backward;
- at the end of the user's code, when this rank never made an optimizer nor ran a backward and its
  code started such processes (they may have trained models of their own).

A process is the user's when its target (or, for ``torch.multiprocessing.spawn``, the function its
target runs) is the user's code: DataLoader workers, pools and autoddp's own are not. In such a
process, forked, capture ends (``_forked``): its code runs there as in one process.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing.process
import os
import sys
import weakref
from typing import Any

import torch

from autoddp.core import _frames, _patches
from autoddp.core._compat import forks
from autoddp.in_rank import models
from autoddp.in_rank.capture._notice import where
from autoddp.in_rank.capture._registry import Site, user_site

#: How deep into a process's arguments models are looked for (``args=(rank, args, model)``: 1).
_DEPTH = 2


@dataclasses.dataclass
class Started:
    """One process the user's code started: where, what it runs, the models it was given."""

    site: Site
    target: str
    models: list[torch.nn.Module]
    weights: list[float | None]


class Children:
    """The ``start``/``join`` hooks of one capture session on ``multiprocessing``'s processes."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self._patches = _patches.Patches()
        self._pid = os.getpid()  # (a forked child inherits the patches: it says nothing)
        self.started: dict[int, Started] = {}
        self._said = False
        #: The user's code is forking a process of its own now (read in the child, see ``_forked``).
        self.starting = False

    def install(self) -> None:
        owner = multiprocessing.process.BaseProcess
        patches = [(owner, "start", self._start), (owner, "join", self._join)]
        self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)
        if hasattr(os, "register_at_fork"):  # (never removed: it holds this object weakly)
            os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def uninstall(self) -> None:
        self._patches.restore()

    def _start(self, original: Any) -> Any:
        children = self

        def start(process: Any, /) -> None:
            if os.getpid() != children._pid or children.session.busy:
                return original(process)
            children._record(process, user_site(sys._getframe(1)))
            children.starting = id(process) in children.started
            try:
                return original(process)
            finally:
                children.starting = False

        return start

    def _join(self, original: Any) -> Any:
        children = self

        def join(process: Any, /, timeout: float | None = None) -> None:
            result = original(process, timeout)
            ours = os.getpid() == children._pid and id(process) in children.started
            if ours and process.exitcode is not None:
                children.check(ended=False)
            return result

        return join

    def _record(self, process: Any, site: Site) -> None:
        target, args, kwargs = forks.process_call(process)
        args += tuple(kwargs.values())
        run = type(process).run  # (a subclass of Process with its own run())
        runs = _users_function(target, args, None if run is multiprocessing.process.BaseProcess.run else run)
        if runs is None:
            return
        found = _models_in(args)
        self.started[id(process)] = Started(site, runs, found, [_weights(m) for m in found])

    def check(self, ended: bool) -> None:
        """Say, once, that training ran in the processes the user's code started (see the module
        docstring); ``ended``: the user's code has ended (no optimizer or backward comes any more)."""
        session = self.session
        if self._said or not self.started or session.notice is None:
            return
        if session.optimizers.made or session.undistributed.backward_checked:
            return  # this rank trains itself: its children are its own business
        changed = [
            (started, model)
            for started in self.started.values()
            for model, before in zip(started.models, started.weights, strict=True)
            if before is not None and _weights(model) != before
        ]
        if not changed and not ended:
            return
        self._said = True
        first = next(iter(self.started.values()))
        n = session.notice.world_size
        if changed:
            started, model = changed[0]
            name = type(models.unwrap(model)).__name__
            what = (
                f"the weights of the {name} given to the process started at {where(started.site)} "
                f"(target {started.target}) changed there: training ran in processes the script "
                "started itself"
            )
        else:
            what = (
                f"the script started processes itself (at {where(first.site)}, target "
                f"{first.target}) and this process made no optimizer and ran no backward: if they "
                "train, training ran in processes the script started itself"
            )
        session.notice.say(
            ("children",),
            f"not distributed: {what}. autoddp did not distribute it: each of the {n} ranks ran it "
            f"whole, {n} copies of the work for one process's result (the other lines speak only of "
            "the code of the processes autoddp started). Run such a script with plain python (it "
            "starts its processes itself), or train in the process autoddp started (an optimizer "
            "over the model there; autoddp then wraps it in DDP)",
        )


def _forked(ref: weakref.ref) -> None:
    """In a process the user's code forked (``mp.Process`` under fork): capture ends there, its
    code runs as the user wrote it (an optimizer made there wraps nothing in DDP: no other rank
    would join it), and ``join`` in the rank says whether it trained."""
    children = ref()
    if children is not None and children.starting:
        children.starting = False
        children.session.take_out()


def _users_function(target: Any, args: tuple, run: Any) -> str | None:
    """The name of the user's function a process runs: its target, a target's first argument
    (``torch.multiprocessing.spawn`` runs the user's function through its own ``_wrap``), or the
    ``run()`` of the user's own subclass of ``Process``."""
    for candidate in (target, args[0] if args else None, run):
        code = getattr(candidate, "__code__", None)
        if code is not None and _frames.is_user(code.co_filename):
            return getattr(candidate, "__qualname__", code.co_name)
    return None


def _models_in(args: tuple) -> list[torch.nn.Module]:
    """The modules among a process's arguments, and in lists, tuples and dicts among them."""
    found: list[torch.nn.Module] = []
    level: list[Any] = list(args)
    for _ in range(_DEPTH):
        below: list[Any] = []
        for value in level:
            if isinstance(value, torch.nn.Module):
                if all(value is not known for known in found):
                    found.append(value)
            elif isinstance(value, (list, tuple)):
                below.extend(value[:64])
            elif isinstance(value, dict):
                below.extend(list(value.values())[:64])
        level = below
    return found


def _weights(model: torch.nn.Module) -> float | None:
    """A sum over every weight of ``model``: it changes when an optimizer steps (None: unreadable)."""
    try:
        with torch.no_grad():
            return sum(float(p.detach().sum(dtype=torch.float64)) for p in model.parameters())
    except Exception:  # (meta or otherwise unreadable parameters: no evidence either way)
        return None
