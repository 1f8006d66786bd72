"""Batches drawn per pass from loaders over an IterableDataset, to name a rank that ran out first.

A user who shards an IterableDataset unevenly (rank 0 gets 5 batches, rank 1 gets 6) sees rank 0
leave its loop while rank 1 waits in DDP's all-reduce for batch 6: gloo's "Connection closed by
peer". Each rank keeps, per loop (its file and line) over such a loader, how many batches each
pass drew, and writes it to the run folder when a pass ends and when its code ends; the launcher
(``launch.failures``) reads every rank's counts when a rank's error is a consequence of another's
leaving, and names the rank that finished early in the loop some rank was drawing from last.
Nothing per batch: the count is the iterator's own, read when its pass ends (its ``__del__``, or
the next pass of a persistent one) or when the file is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from autoddp.core import _compat, _variables
from autoddp.core._class_swap import cached_subclass
from autoddp.in_rank.capture._notice import where
from autoddp.in_rank.capture._registry import user_site
from autoddp.in_rank.run_folder import transport

_ENTRY = "_autoddp_passes"


class _Loader:
    """One loop's passes (over one loader, or a new one each epoch): the batches each drew, the
    last one's read from its live iterator."""

    def __init__(self, owner: Passes) -> None:
        self.owner = owner
        self.counts: list[int] = []
        self.iterator: weakref.ref | None = None

    def start(self, iterator: Any) -> None:
        self.end_pass()  # a persistent iterator, reused for the next pass
        self.counts.append(0)
        self.iterator = weakref.ref(iterator)
        iterator.__dict__[_ENTRY] = self
        if type(iterator).__dict__.get("__del__") is not _iterator_del:
            iterator.__class__ = cached_subclass(type(iterator), {"__del__": _iterator_del})

    def end_pass(self, iterator: Any = None) -> None:
        iterator = iterator if iterator is not None else (self.iterator() if self.iterator else None)
        if iterator is not None and self.counts:
            self.counts[-1] = _compat.batches_drawn(iterator)
            self.owner.write()
        self.iterator = None

    def current(self) -> list[int]:
        live = self.iterator() if self.iterator is not None else None
        return [*self.counts[:-1], _compat.batches_drawn(live)] if live is not None else list(self.counts)


def _iterator_del(iterator: Any) -> None:
    """The pass of a watched iterator ended (it is being freed): record its count, then free it."""
    entry = iterator.__dict__.pop(_ENTRY, None)
    if entry is not None:
        with contextlib.suppress(Exception):  # never raise while being freed
            entry.end_pass(iterator)
    parent = getattr(type(iterator).__bases__[0], "__del__", None)
    if parent is not None:
        parent(iterator)


class Passes:
    """This rank's watched loaders, in the order they were first iterated (the same on every rank)."""

    def __init__(self) -> None:
        self.loaders: dict[str, _Loader] = {}  # by the site of the loop: a new loader per epoch is one
        self.latest: _Loader | None = None  # the loader of the pass that began last

    def watch(self, loader: DataLoader, original: Callable[[DataLoader], Any]) -> Any:
        """``iter(loader)``, its passes counted when it reads an IterableDataset."""
        if not isinstance(loader.dataset, IterableDataset):
            return original(loader)
        site = where(user_site(sys._getframe(1)))
        entry = self.loaders.get(site)
        if entry is None:
            entry = self.loaders[site] = _Loader(self)
        entry.end_pass()
        iterator = original(loader)
        entry.start(iterator)
        self.latest = entry
        return iterator

    def write(self) -> None:
        """Write this rank's counts to the run folder (when a launcher reads them)."""
        folder, rank = os.environ.get(_variables.RUN_FOLDER), os.environ.get("RANK", "")
        if not folder or not rank.isdigit() or not self.loaders:
            return
        data = [
            {"site": site, "passes": entry.current(), "last": entry is self.latest}
            for site, entry in self.loaders.items()
        ]
        with contextlib.suppress(OSError):
            transport.write_private(_path(folder, int(rank)), json.dumps(data).encode())


def _path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"passes-{rank}.json")


def uneven(folder: str, world_size: int) -> str | None:
    """The launcher's side: a sentence naming the rank that ran out of batches first, if one did."""
    ranks: dict[int, list[dict[str, Any]]] = {}
    for rank in range(world_size):
        with contextlib.suppress(OSError, ValueError), open(_path(folder, rank)) as handle:
            ranks[rank] = json.load(handle)
    if len(ranks) < 2:
        return None
    sites = {rank: {loader["site"]: loader for loader in loaders} for rank, loaders in ranks.items()}
    for site in set.intersection(*(set(by_site) for by_site in sites.values())):
        if not any(by_site[site].get("last") for by_site in sites.values()):
            continue  # no rank was drawing from it last (an evaluation shard, say)
        passes = {rank: by_site[site]["passes"] for rank, by_site in sites.items()}
        for number in range(min(len(p) for p in passes.values())):
            drawn = {rank: p[number] for rank, p in passes.items()}
            early, late = min(drawn, key=drawn.get), max(drawn, key=drawn.get)
            if drawn[early] != drawn[late]:
                which = f" in pass {number + 1}" if number else ""
                return (
                    f"rank {early} finished its DataLoader ({site}) after {drawn[early]} batches{which} "
                    f"while rank {late} went on to batch {drawn[early] + 1}: every rank must draw the "
                    "same number of batches, since each step's gradients are averaged across all ranks "
                    "and a rank that stops leaves the others waiting. Shard the IterableDataset evenly "
                    "(the same number of samples on every rank, dropping the remainder), or use a "
                    "map-style Dataset with DataLoader(shuffle=True), which autoddp shards evenly"
                )
    return None
