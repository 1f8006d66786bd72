"""What DDP's own error messages say, read for the user: the parameters that got no gradient.

DDP's "Expected to have finished reduction in the prior iteration" error lists those parameters by
their index among the module's parameters that require a gradient ("Parameter indices which did
not receive grad for rank 0: 2 3", torch 2.4 to 2.15; the names themselves only under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``). The text is torch's, not an API: ``tests/core/test_compat.py``
makes DDP raise it and checks that it still reads.
"""

from __future__ import annotations

import re

import torch

_INDICES = re.compile(r"did not receive grad for rank \d+: ([\d ]+)")


def unused_parameters(error: BaseException, module: torch.nn.Module) -> list[str] | None:
    """The names of the parameters of ``module`` that DDP's ``error`` says got no gradient, or None
    where its message lists none."""
    found = _INDICES.search(str(error))
    if found is None:
        return None
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    return [names[int(i)] for i in found.group(1).split() if int(i) < len(names)]
