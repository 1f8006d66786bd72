"""Sharded checkpoints: ``autoddp.save(..., sharded=True)`` (or to a folder) through torch's
distributed checkpoint (``torch.distributed.checkpoint``), loadable back on any world size.

Every rank writes its own shards (a model too large for one process's memory never comes
together). Models go in as ``get_model_state_dict`` gives them, optimizers of sharded models as
``get_optimizer_state_dict`` gives them (torch's own formats, which reshard on load); other values
as they are. The folder is written next to its final name and renamed into place by rank 0 once
every rank is done, so an interrupted save leaves the previous checkpoint.

``load`` in a world of one process gives plain nested dicts with full tensors (optimizer state as a
single process's optimizer keeps it). In a world of several it gives a ``Checkpoint``: small
values come back as they are, and each model or optimizer entry is a ``Part`` that the sharded
model's ``load_state_dict`` and the optimizer's load read straight into their shards.
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from autoddp.core._leftovers import private_folder
from autoddp.in_rank import models
from autoddp.in_rank.world import barrier, current

_PARTIAL = ".autoddp-partial-"


def save(obj: Mapping[str, Any], folder: str) -> None:
    """Write ``obj`` (a dict) as a distributed checkpoint at ``folder`` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(obj, Mapping):
        obj = {"state": obj}
    state = {key: _entry(value) for key, value in obj.items()}
    final = os.path.abspath(folder.rstrip(os.sep) or folder)
    world = current()
    token = [uuid.uuid4().hex[:12]]
    if world.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(token, src=0)  # one temporary folder for every rank
    partial = f"{final}{_PARTIAL}{token[0]}"
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*torch.distributed is disabled.*"
        )  # one process: as meant
        dcp.save(state, checkpoint_id=partial, no_dist=world.world_size == 1)
    barrier()
    if world.rank == 0:
        old = None
        if os.path.exists(final):
            old = f"{final}{_PARTIAL}old-{token[0]}"
            os.replace(final, old)
        os.replace(partial, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    barrier()


def _entry(value: Any) -> Any:
    """What goes into the distributed checkpoint for one entry of the saved dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if isinstance(value, torch.nn.Module):
        return get_model_state_dict(models.unwrap(value))
    if isinstance(value, torch.optim.Optimizer):
        model = models.sharded_model_of(value)
        return get_optimizer_state_dict(model, value) if model is not None else value.state_dict()
    return value


def is_checkpoint(path: str) -> bool:
    """True for a folder that holds a distributed checkpoint."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def load(folder: str) -> Any:
    """The checkpoint at ``folder``: plain dicts with one process, a ``Checkpoint`` with several."""
    if current().world_size > 1:
        return Checkpoint(folder)
    return _plain(folder)


def _plain(folder: str) -> dict[str, Any]:
    """Everything in the checkpoint as full tensors, optimizer state keyed as a plain optimizer keys it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with private_folder("autoddp-") as scratch:
        path = os.path.join(scratch, "full.pt")
        dcp_to_torch_save(folder, path)
        state = torch.load(path, weights_only=False, map_location="cpu")
    return {key: _as_plain_optimizer_state(value) for key, value in state.items()}


def _as_plain_optimizer_state(value: Any) -> Any:
    """torch's sharded optimizer format (parameter names as keys) as a plain optimizer's (indices)."""
    groups = value.get("param_groups") if isinstance(value, dict) else None
    if not groups or not all(isinstance(p, str) for g in groups for p in g.get("params", [])):
        return value
    index: dict[str, int] = {}
    plain_groups = []
    for group in groups:
        ids = []
        for name in group["params"]:
            ids.append(index.setdefault(name, len(index)))
        plain_groups.append({**group, "params": ids})
    state = {index[name]: values for name, values in value.get("state", {}).items() if name in index}
    return {"state": state, "param_groups": plain_groups}


class Part(Mapping):
    """One model or optimizer entry of a sharded checkpoint, read when it is loaded."""

    def __init__(self, folder: str, key: str) -> None:
        self.folder, self.key = folder, key
        self._full: dict[str, Any] | None = None

    def load_into_model(self, model: torch.nn.Module) -> Any:
        """Read this entry straight into a (sharded) model's own state: every rank calls it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        state = {self.key: get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=self.folder)
        return set_model_state_dict(model, state[self.key])

    def load_into_optimizer(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
        """Read this entry into an optimizer of a sharded ``model``: every rank calls it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if model is None:
            optimizer.load_state_dict(dict(self))
            return
        state = {self.key: get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=self.folder)
        set_optimizer_state_dict(model, optimizer, state[self.key])

    def copy(self) -> Part:
        """Itself (``Optimizer.load_state_dict`` copies what it is given before its pre-hooks)."""
        return self

    def _materialized(self) -> dict[str, Any]:
        if self._full is None:
            self._full = _plain(self.folder)[self.key]
        return self._full

    def __getitem__(self, name: str) -> Any:
        return self._materialized()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._materialized())

    def __len__(self) -> int:
        return len(self._materialized())


class Checkpoint(Mapping):
    """A sharded checkpoint opened in a world of several processes (see the module docstring)."""

    def __init__(self, folder: str) -> None:
        import torch.distributed.checkpoint as dcp

        self.folder = folder
        self._metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        names = list(self._metadata)
        self._keys = list(dict.fromkeys(name.split(".", 1)[0] for name in names))
        self._leaves = {
            key
            for key in self._keys
            if names.count(key) == 1 and not any(n.startswith(key + ".") for n in names)
        }
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        if key not in self._leaves:
            return Part(self.folder, key)
        if key not in self._values:
            self._values[key] = self._read_leaf(key)
        return self._values[key]

    def _read_leaf(self, key: str) -> Any:
        """One small entry, read by this rank alone (no collective: any rank may ask for it)."""
        import torch.distributed.checkpoint as dcp

        described = self._metadata[key]
        template: Any = None
        if isinstance(described, dcp.TensorStorageMetadata):
            template = torch.empty(described.size, dtype=described.properties.dtype)
        state = {key: template}
        dcp.load(state, checkpoint_id=self.folder, no_dist=True)
        return state[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
