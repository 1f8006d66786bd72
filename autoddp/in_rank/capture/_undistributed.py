"""What capture could not distribute, said once each: training that would run as N identical copies.

Three situations make every process repeat one process's work (or train on data autoddp did not
split) with nothing to capture, so capture says so, on rank 0, in the notice, or at the user's line:

- the first ``backward()``, with no optimizer made, computed gradients for a model (manual SGD on
  ``p.data``) or for tensors no model holds: nothing wrapped them, so every process trains its
  own copy;
- the first ``optimizer.step()`` came before any pass over a sharded loader (manual batching, an
  in-order training loader, a shuffled one only iterated for its statistics): every process
  trains on the same batches;
- an optimizer steps while a shuffled loader runs a pass that autoddp gave every rank in full (it
  began outside training: every model in ``eval()`` mode, or no optimizer made yet), so that pass
  is not split.

Each check is a flag test per ``backward()`` or ``step()`` once it has spoken.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from autoddp.core import _compat, _warn
from autoddp.in_rank import models
from autoddp.in_rank.capture._notice import Notice, where
from autoddp.in_rank.capture._registry import Site, frame_candidates, user_site

Roots = Iterable[tuple[torch.nn.Module, Site | None]]


class Undistributed:
    """The three checks above for one capture session."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.backward_checked = False
        #: True while an optimizer step has something to check (after the first, rarely): a plain
        #: attribute, read at every step (``_recheck`` keeps it after each change of what it reads).
        self.at_step = True
        self._step_checked = False
        #: A pass over a sharded loader has run (or the data is given out by rank some other way).
        self.data_shared = False
        #: Sites of loaders left whole because they are in order (``shuffle=False``).
        self.ordered: list[Site] = []
        #: A shuffled loader's site and iterator, while its pass is whole although gradients are on.
        self.whole_pass: tuple[Site, Any] | None = None
        self._warned_whole = False
        self._postponed = False  # the first step's check, for the next step (a closure: see before_step)

    def begin_pass(self, whole_site: Site | None, iterator: object) -> None:
        """A pass over a loader began: whole while gradients are on (at ``whole_site``), or not."""
        if whole_site is None:
            self.whole_pass = None
        else:
            try:
                self.whole_pass = (whole_site, weakref.ref(iterator))
            except TypeError:  # an iterator that takes no weak reference: held until the next pass
                self.whole_pass = (whole_site, lambda: iterator)
        self._recheck()

    def _in_whole_pass(self) -> Site | None:
        """The site of the whole pass still running (its iterator alive and not exhausted)."""
        if self.whole_pass is None:
            return None
        site, ref = self.whole_pass
        iterator = ref()
        try:
            running = iterator is not None and _compat.batches_drawn(iterator) < len(iterator)
        except Exception:  # not one of torch's DataLoader iterators: it may still run
            running = iterator is not None
        return site if running else None

    def after_first_backward(
        self, notice: Notice | None, roots: Roots, before: dict[int, object], site: Site, distributed: bool
    ) -> None:
        """Name each model the first backward gave gradients that nothing distributes; with none
        such and no model distributed (``distributed``), say the gradients went to loose tensors.

        ``roots``: the candidates; ``before``: their gradients as they were before that backward.
        """
        if notice is None:
            return
        named = False
        seen: set[int] = set()
        for root, made in roots:
            if id(root) in seen or models.distributed(root):
                continue
            seen.add(id(root))
            if all(_grad_state(p) == before.get(id(p)) for p in root.parameters()):
                continue  # (no gradient, or one left from before this backward: not trained here)
            named = True
            name = type(models.unwrap(root)).__name__
            notice.say(
                ("no optimizer", id(root)),
                f"not distributed: {name} ({where(made)}) got gradients at {where(site)}, but no "
                "optimizer autoddp could see was made over its parameters (one made before the call is "
                "seen where the call reaches it), so autoddp did not wrap it: if the code "
                "updates it by hand (p.data -= lr * p.grad), every process trains its own copy, "
                f"{self.world_size} times the work for one process's result. Make a torch.optim "
                "optimizer over its parameters (autoddp then wraps it in DDP), or pass it to "
                "autoddp.prepare(model)",
                captured=True,
                subject=root,
            )
        if not named and not distributed:
            notice.say(
                ("no model",),
                f"not distributed: the backward at {where(site)} computed gradients, but no model is "
                "distributed (no optimizer was made over a module's parameters, none was passed to "
                "autoddp.prepare): if the code updates tensors by hand, every process trains its own "
                f"copy, {self.world_size} times the work for one process's result. Keep the "
                "parameters in an nn.Module and make a torch.optim optimizer over them",
                captured=True,
            )

    @property
    def step_checked(self) -> bool:
        """Whether the first optimizer step checked the data."""
        return self._step_checked

    @step_checked.setter
    def step_checked(self, checked: bool) -> None:
        self._step_checked = checked
        self._recheck()

    def _recheck(self) -> None:
        self.at_step = not self._step_checked or (self.whole_pass is not None and not self._warned_whole)

    def before_step(self, notice: Notice | None, site: Site, closure: bool = False) -> None:
        """At an optimizer step: the first one checks the data; any one checks a whole pass.

        A first step given a closure (LBFGS) runs the model's forwards after this: its data is
        checked at the next step, once the model's first call has decided (``models._at_call``).
        """
        whole = self._in_whole_pass() if not self._warned_whole else None
        decided = models.split_at_call() if whole is not None or not self.step_checked else []
        if closure and not decided and not self.step_checked and not self._postponed:
            self._postponed = True
            return
        split = any(state is True for _, state in decided)
        if whole is not None:
            self._warned_whole = True
            self._recheck()
            what = (
                ": each process loads every batch, and the model splits it at its call"
                if split
                else ", so it is not split between the processes"
            )
            _warn.warn(
                f"an optimizer steps while the shuffled DataLoader at {where(whole)} runs a pass that "
                "every process gets in full: autoddp took that pass for evaluation (when it began, "
                f"every model was in eval() mode, or no optimizer had been made yet){what}. If this "
                "is your training loop, make the optimizer and call model.train() before iterating the "
                "loader"
            )
        if self.step_checked:
            return
        self.step_checked = True
        if self.data_shared or notice is None:
            return
        ordered = ""
        if self.ordered:
            ordered = (
                f" (the DataLoader at {where(self.ordered[0])} is in order, shuffle=False, so autoddp "
                "left it whole as an evaluation loader: pass shuffle=True if it is the training data)"
            )
        self._say_split(notice, decided, ordered)
        if split or any(state == models.DRAWN_APART for _, state in decided):
            return
        refused = "".join(
            f" (its batches could not be split at {type(model).__name__}'s call: {state})"
            for model, state in decided[:1]
            if isinstance(state, str)
        )
        if whole is not None:  # a shuffled loader's pass runs, left whole: say that, not "no pass"
            notice.say(
                ("no sharded data",),
                f"not distributed: the first optimizer step ({where(site)}) came during a pass over the "
                f"shuffled DataLoader at {where(whole)} that autoddp left whole (it began before any "
                f"optimizer was made, or with every model in eval()){refused}, so every process trains on "
                f"the same batches, {self.world_size} times the work for one process's result. Make the "
                "optimizer and call model.train() before iterating the loader (iter(loader) included)",
                captured=True,
            )
            return
        notice.say(
            ("no sharded data",),
            f"not distributed: no pass over a shuffled DataLoader ran before the first optimizer step "
            f"({where(site)}){ordered}{refused}, so unless the code gives each process its own data, "
            f"every process trains on the same batches, {self.world_size} times the work for one "
            "process's result. Use a DataLoader with shuffle=True (autoddp shards it), or split the "
            "data with autoddp.rank() and autoddp.world_size()",
            captured=True,
        )

    def _say_split(
        self, notice: Notice, decided: list[tuple[torch.nn.Module, bool | str]], ordered: str
    ) -> None:
        """What became of the batches that reached a model the same on every rank (``models._at_call``)."""
        n = self.world_size
        for model, state in decided:
            name = type(model).__name__
            if state is True:
                notice.say(
                    ("split at call", id(model)),
                    f"{name}: its batches, the same on every process (drawn without a DataLoader, or from "
                    f"a pass left whole), are split at its call: each of the {n} processes runs its rows "
                    "of every batch, and what the call returns is the whole batch's (one all-gather per "
                    "tensor it returns), so the lines after it, the loss and the step are one process's",
                    captured=True,
                )
            elif state == models.DRAWN_APART:  # each rank trains on batches of its own: not N copies
                notice.say(
                    ("split at call", id(model)),
                    f"{name}: its batches differ between the processes{ordered} (nothing seeds the random "
                    f"numbers alike on every process): each of the {n} trains on its own, so a step learns "
                    f"from {n} times one process's batch, not one process's run; seed them at the top of "
                    "the script (torch.manual_seed(0)) for autoddp to split one batch between the processes",
                    captured=True,
                )


def _grad_state(param: torch.Tensor) -> object:
    """What a backward changes about ``param``'s gradient: the tensor, and its in-place version."""
    grad = param.grad
    return None if grad is None else (id(grad), _compat.version(grad))


def grad_versions(roots: Roots) -> dict[int, object]:
    """Each candidate parameter's gradient as it is now, to see which ones a backward changes."""
    return {id(p): _grad_state(p) for root, _ in roots for p in root.parameters()}


def candidate_roots(
    registry: Any, frame: Any, wrapped: list[torch.nn.Module]
) -> list[tuple[torch.nn.Module, Site | None]]:
    """Outermost modules the user's code may have trained: those built under capture, then the
    frames' (never a part of another candidate or of a model already distributed)."""
    found = [(root, registry.site(root)) for root in registry.roots()]
    found += [(module, None) for module in frame_candidates(frame)]
    outer = [*wrapped, *(module for module, _ in found)]
    inside = {id(sub) for module in outer for sub in module.modules() if sub is not module}
    return [(module, site) for module, site in found if id(module) not in inside]


def caller_site() -> Site:
    """The user's line that called into the hook running now."""
    return user_site(sys._getframe(2))
