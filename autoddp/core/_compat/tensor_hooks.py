"""Hooking a forward's output for its backward at a fraction of ``Tensor.register_hook``'s cost.

``register_hook`` is Python: it imports ``RemovableHandle``, makes one (a weak reference, a class
counter) and an ``OrderedDict`` per tensor, about 20 thousand instructions, paid at every forward
of a guarded model. What it leaves behind is torch's C hook reading the tensor's
``_backward_hooks`` dict, registered on its ``grad_fn`` by ``Node._register_hook_dict``
(torch 2.4 to 2.15): setting both directly leaves the same hook for about 8 thousand. A tensor that
already has hooks, is not a plain ``torch.Tensor`` or has no ``grad_fn`` takes ``register_hook``
(a leaf, once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autoddp.core.errors import TorchCompatibilityError


class _Hooks(dict):
    """A tensor's hooks dict: a weak reference to it is what ``register_hook``'s handle keeps."""

    __slots__ = ("__weakref__",)


_Tensor = torch.Tensor

#: The hook's key in the tensor's hooks dict: not an int, so ``RemovableHandle``'s ids (the user's
#: own ``register_hook`` on the same tensor, later) never replace it.
KEY = "autoddp"  # (the keyword in ``_Hooks(autoddp=hook)``)


def hook_output(tensor: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Call ``hook(grad)`` when a backward reaches ``tensor`` (which requires grad), as
    ``tensor.register_hook(hook)`` does, without its handle."""
    if type(tensor) is _Tensor and tensor._backward_hooks is None:
        node = tensor.grad_fn
        if node is not None:
            tensor._backward_hooks = _Hooks(autoddp=hook)
            try:
                node._register_hook_dict(tensor)
            except AttributeError:
                tensor._backward_hooks = None
                raise _changed() from None
            return
    hooks = tensor._backward_hooks
    if tensor.grad_fn is None and hooks is not None and any(each == hook for each in hooks.values()):
        return  # a leaf hooked by an earlier forward (a parameter the forward returns): once is enough
    tensor.register_hook(hook)


def _changed() -> TorchCompatibilityError:
    return TorchCompatibilityError(
        f"autoddp hooks a forward's outputs through torch.autograd.graph.Node._register_hook_dict, "
        f"and torch {torch.__version__} no longer has it. Use a torch version autoddp supports, or "
        "report it to autoddp with this message"
    )
