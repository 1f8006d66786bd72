"""Every place a collective can be reached by name: ``rank0()`` refuses it there, the hang report marks it.

Two families issue collectives from Python. torch.distributed's functions (``COLLECTIVES``, FSDP2's
``all_gather_single``/``reduce_scatter_single`` among them) and the functional collectives of
``torch.distributed._functional_collectives`` (private: DTensor's ``full_tensor``/``redistribute``
and so FSDP2's state dicts gather through them; they return at once and wait in ``wait_tensor``).
Other torch modules bind some of these functions under their own names (``from
torch.distributed.distributed_c10d import broadcast, scatter`` in DTensor's collective helpers), so
a stand-in put only in the defining module would miss them: ``sites`` finds every binding in the
loaded ``torch.distributed`` modules.
"""

from __future__ import annotations

import importlib
import sys
from types import FunctionType, ModuleType
from typing import Any

from autoddp.core._compat import COLLECTIVES

#: The functional collectives (``torch.distributed._functional_collectives``) by name: each issues
#: a collective (``wait_tensor`` waits for one, and is not among them).
FUNCTIONAL_COLLECTIVES = (
    "all_gather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_autograd",
    "all_gather_single_coalesced",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
    "permute_tensor",
    "reduce_scatter_single",
    "reduce_scatter_single_autograd",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced",
)
#: The functional collectives' wait: where a rank blocks until one completes.
FUNCTIONAL_WAIT = "wait_tensor"
FUNCTIONAL_MODULE = "torch.distributed._functional_collectives"
_PREFIX = "torch.distributed"


def functional() -> ModuleType:
    """The functional collectives' module (imported: DTensor imports it anyway)."""
    return importlib.import_module(FUNCTIONAL_MODULE)


def _originals(value: Any) -> list[Any]:
    """``value`` and what it wraps (``functools.wraps``' ``__wrapped__``), outermost first."""
    chain = [value]
    while hasattr(chain[-1], "__wrapped__") and len(chain) < 8:
        chain.append(chain[-1].__wrapped__)
    return chain


def sites(*, functional_too: bool = True) -> list[tuple[ModuleType, str, str, bool]]:
    """(module, attribute, collective's name, functional?) for every binding of a collective.

    The defining modules' own names first, then every other loaded ``torch.distributed`` module's
    attribute bound to one of those functions (or to a wrapper of one): by identity, whatever
    the name it is bound under.
    """
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    known: dict[int, tuple[str, bool]] = {}
    found: list[tuple[ModuleType, str, str, bool]] = []
    defining: list[tuple[ModuleType, tuple[str, ...], bool]] = [
        (dist, COLLECTIVES, False),
        (c10d, COLLECTIVES, False),
    ]
    if functional_too:
        defining.append((functional(), FUNCTIONAL_COLLECTIVES, True))
    for module, names, is_functional in defining:
        for name in names:
            value = vars(module).get(name)
            if value is None:
                continue
            found.append((module, name, name, is_functional))
            for each in _originals(value):
                known.setdefault(id(each), (name, is_functional))
    seen = {(id(module), attribute) for module, attribute, _, _ in found}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(_PREFIX) or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            hit = known.get(id(value))  # (ids of live functions: no other object has one)
            if hit is None and type(value) is FunctionType and "__wrapped__" in vars(value):
                # (bound to a wrapper of one while it stood in its module: imported meanwhile)
                hit = next((known[id(v)] for v in _originals(value) if id(v) in known), None)
            if hit is not None and (id(module), attribute) not in seen:
                found.append((module, attribute, *hit))
    return found
