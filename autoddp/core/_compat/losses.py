"""How a loss reduced over its batch, read from its autograd graph (private node attributes).

The nodes of torch's loss functions keep their arguments as ``_saved_*`` attributes: internals
with no public equivalent, so they live here in ``_compat``; ``tests/core/test_compat.py`` reads real
losses' graphs through them.
"""

from __future__ import annotations

from typing import Any

import torch

#: Autograd nodes that scale a loss by a number (``loss / accumulation_steps``): looked through.
_SCALINGS = ("DivBackward0", "MulBackward0")


def loss_reduction(loss: Any) -> str | None:
    """``"sum"``, ``"mean"`` or ``"weighted mean"``: how ``loss`` reduced over the batch, where its
    autograd graph says so (a ``.sum()``/``.mean()``, a loss function's ``reduction=``, through
    scalings and sums of terms that reduce alike); else None.

    A loss function's node keeps its reduction in ``_saved_reduction`` (1: mean, 2: sum); NLL's
    (``cross_entropy``) its class weights in ``_saved_weight`` and ``ignore_index`` beside its
    ``_saved_target``: a mean over them is normalised by the weights of the samples it saw.
    """
    return _reduction(getattr(loss, "grad_fn", None), 4)


def _reduction(node: Any, depth: int) -> str | None:
    for _ in range(depth):
        if node is None:
            return None
        name = node.name()
        if name in _SCALINGS and len(node.next_functions) == 2 and node.next_functions[1][0] is None:
            node = node.next_functions[0][0]
            continue
        if name == "AddBackward0" and len(node.next_functions) == 2:
            terms = {_reduction(term, depth) for term, _ in node.next_functions}
            return terms.pop() if len(terms) == 1 else None
        if name == "SumBackward0":
            return "sum"
        if name == "MeanBackward0":
            return "mean"
        reduction = {1: "mean", 2: "sum"}.get(getattr(node, "_saved_reduction", None))
        return "weighted mean" if reduction == "mean" and _weighted(node) else reduction
    return None


def _weighted(node: Any) -> bool:
    if getattr(node, "_saved_weight", None) is not None:
        return True
    index, target = getattr(node, "_saved_ignore_index", None), getattr(node, "_saved_target", None)
    if not isinstance(index, int) or not isinstance(target, torch.Tensor):
        return False
    index = index - 2**64 if index >= 2**63 else index  # (kept as an unsigned 64-bit number)
    return bool((target == index).any())


def weight_of_mean(loss: Any) -> torch.Tensor | None:
    """What ``loss``, a mean from ``nll_loss``/``cross_entropy`` (through scalings), divides by: the
    summed class weights of the targets it counts (1 each without ``weight=``; none for an ignored
    one), as a tensor (nothing waits for it); None for any other loss.

    Parts of a batch then combine into the whole batch's mean exactly, weighed by it, whatever
    ``ignore_index`` left out of each part.
    """
    node = getattr(loss, "grad_fn", None)
    for _ in range(4):
        if node is None:
            return None
        if node.name() in _SCALINGS and len(node.next_functions) == 2 and node.next_functions[1][0] is None:
            node = node.next_functions[0][0]
            continue
        break
    if node is None or getattr(node, "_saved_reduction", None) != 1:
        return None
    target, index = getattr(node, "_saved_target", None), getattr(node, "_saved_ignore_index", None)
    if not isinstance(target, torch.Tensor) or not isinstance(index, int):
        return None
    index = index - 2**64 if index >= 2**63 else index  # (kept as an unsigned 64-bit number)
    counted = target != index
    weight = getattr(node, "_saved_weight", None)
    if isinstance(weight, torch.Tensor):
        return weight[target.clamp(min=0)].mul(counted).sum()
    return counted.sum().to(torch.float64)
