"""The one check every use of a torch internal goes through: the internal, or an error naming it."""

from __future__ import annotations

from typing import Any

import torch

from autoddp.core.errors import TorchCompatibilityError


def _need(owner: Any, name: str, what: str) -> Any:
    """``owner.name``, or a TorchCompatibilityError saying what autoddp needed it for."""
    try:
        return getattr(owner, name)
    except AttributeError:
        label = getattr(owner, "__name__", type(owner).__name__)
        raise TorchCompatibilityError(
            f"autoddp needs {label}.{name} ({what}), and torch {torch.__version__} does not have it: "
            "this torch release changed an internal autoddp relies on. Use a torch version autoddp "
            "supports, or report it to autoddp with this message"
        ) from None
