"""What capture could not distribute, said once each: training that would run as N identical copies.

Three situations make every process repeat one process's work (or train on data autoddp did not
split) with nothing to capture, so capture says so, on rank 0, in the notice:

- the first ``backward()`` computed gradients for a model no optimizer was made over (manual SGD
  on ``p.data``): nothing wrapped it, so every process trains its own copy on the same data;
- the first ``optimizer.step()`` came with no shuffled DataLoader iterated (manual batching, an
  in-order training loader): every process trains on the same batches;
- an optimizer steps while a shuffled loader runs a pass that autoddp gave every rank in full (it
  began in an evaluation context: every model in ``eval()`` mode), so that pass is not split.

Each check is a flag test per ``backward()`` or ``step()`` once it has spoken.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch

from autoddp import _warn, models
from autoddp.capture._notice import Notice, where
from autoddp.capture._registry import Site, frame_candidates, user_site

Roots = Iterable[tuple[torch.nn.Module, Site | None]]


class Undistributed:
    """The three checks above for one capture session."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.backward_checked = False
        self.step_checked = False
        #: A DataLoader's site, or the kind of loader, whose data is given out by rank (or its own).
        self.data_shared = False
        #: Sites of loaders left whole because they are in order (``shuffle=False``).
        self.ordered: list[Site] = []
        #: The site of a shuffled loader whose current pass is whole although gradients are on.
        self.whole_pass: Site | None = None
        self._warned_whole = False

    def after_first_backward(self, notice: Notice | None, roots: Roots, site: Site) -> None:
        """Name each model that got gradients but is not distributed (``roots``: candidates)."""
        self.backward_checked = True
        if notice is None:
            return
        seen: set[int] = set()
        for root, made in roots:
            if id(root) in seen or models.distributed(root):
                continue
            seen.add(id(root))
            if not any(p.grad is not None for p in root.parameters()):
                continue
            name = type(models.unwrap(root)).__name__
            notice.say(
                ("no optimizer", id(root)),
                f"not distributed: {name} ({where(made)}) got gradients at {where(site)}, but no "
                "optimizer was made over its parameters, so autoddp did not wrap it: if the code "
                "updates it by hand (p.data -= lr * p.grad), every process trains its own copy, "
                f"{self.world_size} times the work for one process's result. Make a torch.optim "
                "optimizer over its parameters (autoddp then wraps it in DDP), or pass it to "
                "autoddp.prepare(model)",
                captured=True,
            )

    @property
    def at_step(self) -> bool:
        """True while an optimizer step has something to check (after the first, rarely)."""
        return not self.step_checked or (self.whole_pass is not None and not self._warned_whole)

    def before_step(self, notice: Notice | None, site: Site) -> None:
        """At an optimizer step: the first one checks the data; any one checks a whole pass."""
        if self.whole_pass is not None and not self._warned_whole:
            self._warned_whole = True
            _warn.warn(
                f"an optimizer steps while the shuffled DataLoader at {where(self.whole_pass)} runs a "
                "pass that every process gets in full: autoddp took that pass for evaluation (every "
                "model was in eval() mode when it began), so it is not split between the processes. "
                "If this is your training loop, call model.train() before iterating the loader"
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
        notice.say(
            ("no sharded data",),
            f"not distributed: no shuffled DataLoader was iterated before the first optimizer step "
            f"({where(site)}){ordered}, so unless the code gives each process its own data, every "
            f"process trains on the same batches, {self.world_size} times the work for one process's "
            "result. Use a DataLoader with shuffle=True (autoddp shards it), or split the data with "
            "autoddp.rank() and autoddp.world_size()",
            captured=True,
        )


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
