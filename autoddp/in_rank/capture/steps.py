"""Capture's training-step hooks: ``backward``, ``grad``, every optimizer step and DDP's ``__init__``,
and what reads gradients before a step (``clip_grad_norm_``, ``GradScaler.unscale_``).

The first ``backward()`` checks the loss and, with no optimizer made yet, which models it trains by
hand; each backward pass is counted at torch's engine call (``models.count_passes``); a
step says what could not be distributed (``_undistributed``); a user's own
``DistributedDataParallel`` takes over from autoddp's, so that a model is never wrapped twice, and
counts as a model in training for the passes of the loaders (a framework's: Lightning's strategy
wraps the module it trains itself).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autoddp.core import _backward, _patches
from autoddp.core.state import CURRENT
from autoddp.in_rank import models
from autoddp.in_rank.capture._notice import where
from autoddp.in_rank.capture._registry import user_site
from autoddp.in_rank.capture._undistributed import caller_site, candidate_roots, grad_versions

#: What reads gradients between the last backward and ``step()`` (gradient accumulation leaves a
#: wrongly guessed window's gradients local until then: ``models._window``). Looked up at install.
_GRADIENT_READERS = (
    (torch.nn.utils, "clip_grad_norm_"),
    (torch.nn.utils, "clip_grad_value_"),
    (torch.nn.utils, "get_total_norm"),
    (torch.nn.utils.clip_grad, "clip_grad_norm_"),
    (torch.nn.utils.clip_grad, "clip_grad_value_"),
    (torch.nn.utils.clip_grad, "get_total_norm"),
    (torch.amp.GradScaler, "unscale_"),
)


#: ``Steps.before``'s token for a backward whose loss split_batches shows whole afterwards.
_SPLIT = "split"


class Steps:
    """The training-step hooks of one capture session (its patches and its global step hook)."""

    def __init__(self, session: Any) -> None:
        """``session``: the capture ``Session`` (its options, registry, notice and optimizers)."""
        self.session = session
        self._patches = _patches.Patches()
        self._handles: list[Any] = []
        self.own_ddp: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # the user's own DDP models
        self.accumulation_said = False
        self.undeferred_said = False

    def install(self) -> None:
        patches = [
            (torch.nn.parallel.DistributedDataParallel, "__init__", self._ddp_init),
            *((owner, name, self._reading) for owner, name in _GRADIENT_READERS if hasattr(owner, name)),
        ]
        self._patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)
        _backward.CALLS.add(self)
        # Every backward pass counted where torch runs it, whatever name reached it (one bound
        # before capture too: a decorated function's module imported it first): ``models._reduction``.
        models.count_passes()

    def install_step_hook(self) -> None:
        """Every optimizer step, from here on (a global hook: installed after every patch)."""
        self._handles.append(register_optimizer_step_pre_hook(self._before_step))

    def uninstall(self) -> None:
        _backward.CALLS.remove(self)
        self._patches.restore()

    def remove_step_hook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # --- each backward(), a watcher of ``core._backward`` ------------------------------------------

    def before(self, args: tuple, kwargs: dict, thread: int) -> Any:
        """The first backward checks the loss and the models; with split_batches each one says the
        loss of the global batch afterwards (``after``)."""
        session = self.session
        if session.busy:
            return _backward.SKIP
        if not session.undistributed.backward_checked:
            return self._first_backward(sys._getframe(2), args, kwargs)  # (2: the caller of backward)
        return _SPLIT if session.options.split_batches else _backward.SKIP

    def after(self, token: Any, args: tuple, kwargs: dict, raised: bool) -> None:
        if raised:
            return
        session = self.session
        if token is not _SPLIT:  # the first backward, no optimizer made yet: what did it train?
            frame, roots, before = token
            wrapped, site = bool(CURRENT.wrapped_models()), user_site(frame)
            session.undistributed.after_first_backward(session.notice, roots, before, site, wrapped)
        if session.options.split_batches:  # loss.item() then prints the global batch's loss
            models.show_split_loss_whole(args[0] if args else kwargs.get("tensors"))

    def _first_backward(self, frame: Any, args: tuple, kwargs: dict) -> Any:
        """With no optimizer made yet, which models does the first backward train by hand? (What
        ``after`` needs to tell: the models and their gradients' versions before it.)"""
        session = self.session
        session.undistributed.backward_checked = True
        _backward.CALLS.listen(self, session.options.split_batches)  # (later ones: only for that)
        models.check_loss(args[0] if args else kwargs.get("tensors"), session.options.split_batches)
        if session.optimizers.made:
            return _SPLIT if session.options.split_batches else _backward.SKIP
        roots = candidate_roots(session.registry, frame, CURRENT.wrapped_models())
        return frame, roots, grad_versions(roots)

    def _reading(self, original: Any) -> Any:
        """A function that reads gradients before ``step()``: gradients still local averaged first."""
        session = self.session

        @functools.wraps(original)
        def reading(*args: Any, **kwargs: Any) -> Any:
            if not session.busy:
                models.average_before_read()
            return original(*args, **kwargs)

        return reading

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        session = self.session
        if not session.busy and session.undistributed.at_step:
            closure = (args[1] if len(args) > 1 else kwargs.get("closure")) is not None
            session.undistributed.before_step(session.notice, caller_site(), closure)
        if CURRENT.accumulating and not self.accumulation_said and session.notice is not None:
            self.accumulation_said = True
            session.notice.say(
                "accumulation",
                f"gradient accumulation: {CURRENT.accumulating} backward passes per optimizer.step() at "
                f"{where(caller_site())}: the gradients are synchronised once per step, at the last one "
                "(what no_sync() does by hand); a step that comes earlier averages them then",
            )
        if CURRENT.undeferred is not None and not self.undeferred_said and session.notice is not None:
            self.undeferred_said = True
            window, why = CURRENT.undeferred
            session.notice.say(
                "accumulation, not deferred",
                f"gradient accumulation: {window} backward passes per optimizer.step() at "
                f"{where(caller_site())}: under FSDP each one reduce-scatters its gradients, as the "
                f"code is written; {why}",
            )

    def _ddp_init(self, original: Any) -> Any:
        def __init__(ddp: Any, /, *args: Any, **kwargs: Any) -> None:
            module = args[0] if args else kwargs.get("module")  # (Lightning passes module=)
            if self.session.busy or (module is not None and models.ddp_being_built(module)):
                # autoddp's own: also a rebuild inside the user's forward after the model changed
                # (a buffer deleted, a layer replaced), which is no model of the user's own
                original(ddp, *args, **kwargs)
                return
            if module is not None:
                inner = models.unwrap(module)
                if models.ddp_in_charge(inner):
                    models.release(inner)  # the user's own DDP takes over: never two
            original(ddp, *args, **kwargs)
            self.own_ddp.add(ddp)

        return __init__
