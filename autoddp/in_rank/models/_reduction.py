"""Which backward passes DDP averaged: what the step's averaging guard needs to trust ``.grad``.

DDP averages the gradients of one backward pass after each forward through it (the first one that
accumulates into ``.grad``). Gradients that reach ``.grad`` otherwise are this process's own: a
second backward through the same forward (``retain_graph=True``), or ``torch.autograd.grad``'s
results assigned to ``.grad`` by hand. Capture counts every backward pass, ``backward``'s and
``grad``'s, at torch's engine call (``at_engine``), in ``CURRENT``; a
forward through a guarded model's DDP hooks its outputs (``Ledger.forwarded``), so that a pass
reaching them tells whether DDP averages it; the guard (``_averaging``) averages at ``step()`` when
one did not, or when a step runs inside a backward pass (before DDP's all-reduce has finished). A
backward through forwards that deferred their synchronisation (gradient accumulation, ``_window``;
the user's own ``no_sync``) leaves gradients to be averaged by a later synchronised backward, else
by the guard (``DEFERRED``).

Every forward through a guarded model's DDP is hooked: leaving outputs unhooked until a backward
keeps its graph misses two forwards followed by a backward each, where DDP averages the first only,
and a rule that turns hooking on where that happens decides on one rank alone when rank 0 alone
runs a forward (a ``rank0()`` body), so that its step would average alone. The counter at the engine
call is installed for the life of the process by the first guarded model (``count_passes``), under
capture or not (``capture=False`` with a model and its optimizer made before the call): the hook
(``core._compat.tensor_hooks``) and the counter cost a step about 15 thousand instructions. Each
pass is numbered as it runs (``CURRENT.backward_number``: a pass run from another's hooks has its
own, and the outer one its own again after it) with the ``inputs`` it was given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import unserializable_hook

from autoddp.core._compat import engine, tensor_hooks
from autoddp.core.state import CURRENT
from autoddp.in_rank.models._routing import on_backward

#: ``CURRENT.backward_kind`` while ``torch.autograd.backward`` (accumulating) or ``grad`` runs.
BACKWARD = "backward"
GRAD = "grad"
#: Why ``.grad`` holds local gradients: only backward passes through forwards in ``no_sync``.
DEFERRED = "deferred"
#: The reasons averaged without a word (nothing the user's code did differently from one process).
SILENT = (DEFERRED,)
#: Set on the engine call's counter (``count_passes``: installed once).
_COUNTING = "_autoddp_counts_passes"


def count_passes() -> None:
    """Count every backward pass from now on, for the life of the process (idempotent): a guarded
    model's ledger tells one pass from the next by it, whoever wrapped the model."""
    owner, name = engine.engine_call()
    if not getattr(getattr(owner, name), _COUNTING, False):
        counter = functools.wraps(getattr(owner, name))(at_engine(getattr(owner, name)))
        setattr(counter, _COUNTING, True)
        setattr(owner, name, counter)


def at_engine(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's engine call (``core._compat.engine``), counting every backward pass in ``CURRENT`` for
    the step's averaging guard (which passes DDP averaged, a step inside one): ``backward`` and
    ``grad`` alike, under whatever name the caller reached them by (one bound before capture: a
    module imported first, a default argument, a container), nested in another pass's hooks or not."""
    compiling, key, at = torch.compiler.is_compiling, engine.ACCUMULATES, engine.INPUTS_AT

    def run(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if compiling():  # traced: exactly the original
            return original(t_outputs, *args, **kwargs)
        current = CURRENT
        previous = current.backward_kind, current.backward_number, current.backward_inputs
        current.backwards += 1
        current.backward_number = current.backwards  # (this pass's: back to the outer one's after it)
        # (``engine.accumulates`` and ``engine.inputs``, inline: every step's path)
        current.backward_kind = BACKWARD if kwargs.get(key, True) else GRAD
        current.backward_inputs = (args[at] if len(args) > at else None) or None
        try:
            return original(t_outputs, *args, **kwargs)
        finally:
            current.backward_kind, current.backward_number, current.backward_inputs = previous

    return run


def stepping_in_backward() -> bool:
    """True while a backward pass runs (an optimizer stepped from a hook steps before DDP averaged)."""
    return CURRENT.backward_kind == BACKWARD


class Ledger:
    """Whether a model's ``.grad`` holds gradients DDP did not average since its last reduction.

    ``parameters()``: the model's (a pass given ``inputs`` that holds none of them leaves its
    ``.grad`` alone: a saliency map's ``grad(loss, x)``, ``backward(inputs=[out])``, on one rank or all).
    """

    def __init__(self, parameters: Callable[[], Any]) -> None:
        self.parameters = parameters
        #: A forward through the DDP with synchronisation on awaits the backward DDP averages.
        self.pending = False
        #: What put gradients DDP did not average into ``.grad`` since its last reduction, or None.
        self.unreduced: str | None = None
        #: The number of the last backward that reached this model's forwards (``CURRENT.backward_number``).
        self.last = -1
        #: The number of the pass that set ``unreduced`` (a pass nested in a later one's hooks: kept).
        self.marked = -1
        #: The reasons the guard has given for averaging this model's gradients (each said once).
        self.said: set[str] = set()

    def forwarded(self, result: Any, synced: bool) -> None:
        """A forward with gradients went through the DDP: hook its outputs (``synced``: not in no_sync)."""
        self.pending = self.pending or synced
        hook = self.reached if synced else self.reached_deferred
        if type(result) is torch.Tensor:  # the usual output: hooked directly, nothing walked
            if result.requires_grad:
                tensor_hooks.hook_output(result, hook)
        else:
            on_backward(result, hook)

    @unserializable_hook
    def reached(self, grad: torch.Tensor) -> None:
        """A backward (or ``torch.autograd.grad``) reached a forward's outputs: did DDP average it?"""
        current = CURRENT  # (``_arrived``, inline: every step's path)
        number = current.backward_number
        if current.backward_inputs is not None and not self._touched(current.backward_inputs):
            return  # (a pass that leaves this model's .grad alone)
        if current.backward_kind != BACKWARD:  # grad, or None: one imported by name before capture
            self.unreduced, self.marked = GRAD, number  # (its results may be put into .grad)
        elif number != self.last:  # the first hook this backward pass reaches
            self.last = number
            if not self.pending:
                self.unreduced, self.marked = BACKWARD, number  # a second backward through one forward
            else:
                self.pending = False  # DDP averages all of .grad at its end
                if self.marked < number:  # (not what a pass inside this one's hooks left)
                    self.unreduced = None

    @unserializable_hook
    def reached_deferred(self, grad: torch.Tensor) -> None:
        """A backward reached a forward made in ``no_sync``: its gradients wait for a synchronisation."""
        if self._arrived():
            number = CURRENT.backward_number
            if self.pending:
                self.pending = False  # a synchronised forward's backward too
                if self.marked < number:
                    self.unreduced = None
            elif self.unreduced is None:
                self.unreduced, self.marked = DEFERRED, number

    def _arrived(self) -> bool:
        """Whether this is the first hook a new backward pass reaches (``torch.autograd.grad``: noted)."""
        current = CURRENT
        if current.backward_inputs is not None and not self._touched(current.backward_inputs):
            return False
        if current.backward_kind != BACKWARD:  # grad, or None: one imported by name before capture
            self.unreduced, self.marked = GRAD, current.backward_number
            return False
        if current.backward_number == self.last:
            return False  # another output, or another forward, of the same backward
        self.last = current.backward_number
        return True

    def _touched(self, inputs: Any) -> bool:
        """Whether a pass given ``inputs`` reaches this model's ``.grad`` (or returns its gradients)."""
        given = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
        return any(id(p) in given for p in self.parameters())

    def due(self) -> str | None:
        """What left gradients DDP did not average (None: nothing)."""
        return self.unreduced

    def take(self) -> str | None:
        """``due()``, forgotten: the caller averages the gradients now."""
        found, self.unreduced = self.unreduced, None
        return found
