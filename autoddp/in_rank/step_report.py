"""The rank's half of the step report: where the time of each optimizer step goes, in this rank.

While the user's code runs in a worker whose launcher asks for the report (``AUTODDP_STEP_REPORT``,
a world of several processes), ``measuring`` times, on the thread that runs the user's code:

- **a step**: from the end of one optimizer step to the end of the next (a global step post-hook;
  with several optimizers the first one to step paces the steps, until another steps twice
  without it). The first step is not timed (it builds DDP's buckets and warms everything up);
- **waiting for data**: time inside a DataLoader's iterator (each batch's ``__next__``, and
  ``iter(loader)``, which starts its workers); each batch's samples are counted (the first
  dimension of its first tensor);
- **waiting in collectives**: the end of each ``backward()``, from the moment this rank has computed
  every gradient until it returns, after DDP's wait for their all-reduce (an autograd final
  callback queued when the pass begins runs after its last gradient, before DDP's, queued once its
  last bucket is ready), in the steps that begin ``SAMPLE_SECONDS`` after the last one so timed
  (every step, for steps that long; the others counted at their mean), plus the waits the hang
  report's marks see (torch.distributed's collectives, DDP's buffer broadcast, rank0() blocks:
  ``hang.marks``);
- **computing**: the rest.

A rank that arrives late at a step makes the others wait for it there: the launcher compares the
ranks (``launch.step_report``). The totals go into this rank's step record (``run_folder.step_record``:
one memory write) with each sampled step and at the end. On GPUs the times are the host's: a collective
queued on the GPU is waited for where the host next waits for the GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader

from autoddp.core import _backward, _patches, _variables
from autoddp.core._compat import timing
from autoddp.core.state import World
from autoddp.in_rank.hang.marks import MARKS
from autoddp.in_rank.run_folder import step_record

#: A step's backward passes are timed to their end (a hook and a callback in each: about 16 µs on
#: a slow CPU) when it begins at least this long after the last step so timed; the others are
#: taken to wait in backward() as those did, on the mean: a cost of at most a few in ten thousand.
SAMPLE_SECONDS = 0.1


class StepClock:
    """This rank's step times and the hooks that take them: the module's one state."""

    def __init__(self) -> None:
        self.thread = -1  # the thread whose steps are timed; -1: not installed (or a forked child)
        self.writer: step_record.Writer | None = None
        self.patches = _patches.Patches()
        self.handle: Any = None  # the global optimizer step hook
        self.queue: Callable[[Callable[[], None]], None] | None = None
        self.forks_watched = False
        self._reset()

    def _reset(self) -> None:
        self.pacer: int | None = None  # id() of the optimizer whose steps end a step
        self.others: set[int] = set()  # the other optimizers that stepped since the pacer did
        self.last: float | None = None  # when the last step ended (perf_counter)
        self.data, self.wait, self.samples = 0.0, 0.0, 0  # since the last step
        self.marks_at = MARKS.waited
        self.in_data = False
        self.root: Any = None  # the prehook on the running backward's first node
        self.computed, self.marks_at_computed = 0.0, 0.0
        #: Whether this step's backward passes are timed to their end (``SAMPLE_SECONDS``), since when
        self.sampling, self.sampled_at = False, 0.0
        self.tails, self.tail_steps = 0.0, 0  # their seconds waiting in backward(), in the steps timed
        self.marked = 0.0  # the seconds the marks counted in the steps timed
        #: steps timed, their seconds, seconds waiting for data, in collectives, samples, all steps
        self.totals: list[Any] = [0, 0.0, 0.0, 0.0, 0, 0]

    # --- lifecycle ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self, folder: str, world: World) -> Iterator[None]:
        """The step record and the hooks for a ``with`` block (the user's code)."""
        self._reset()
        self.queue = timing.backward_callbacks()
        iterators = timing.loader_iterator_class()
        self.writer = step_record.Writer(folder, world.rank, world.world_size)
        self.thread = threading.get_ident()
        try:
            if not self.forks_watched:
                os.register_at_fork(after_in_child=self._forked)
                self.forks_watched = True
            patches = [
                (iterators, "__next__", self._next),
                (DataLoader, "__iter__", self._iter),
            ]
            self.patches.install(_patches.wrapping(owner, name, make) for owner, name, make in patches)
            _backward.CALLS.add(self, listening=False)  # (called in the sampled steps: ``_stepped``)
            self.handle = register_optimizer_step_post_hook(self._stepped)
            yield
        finally:
            self._uninstall()

    def write(self) -> None:
        if self.writer is not None:
            self.writer.write(*self.totals)

    def _uninstall(self) -> None:
        self.write()
        _backward.CALLS.remove(self)
        self.patches.restore()
        if self.handle is not None:
            self.handle.remove()
        if self.root is not None:
            self.root.remove()
        if self.writer is not None:
            self.writer.close()
        self.thread, self.handle, self.root, self.writer = -1, None, None, None

    def _forked(self) -> None:
        """In a child forked while installed (a DataLoader worker): time nothing, write nothing."""
        self.thread = -1
        if self.writer is not None:
            self.writer.forget()
        self.patches.forget()

    # --- the hooks ----------------------------------------------------------------------------

    def _next(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        clock, get_ident, now = self, threading.get_ident, time.perf_counter

        def __next__(iterator: Any, /) -> Any:
            if clock.in_data or get_ident() != clock.thread:
                return original(iterator)
            clock.in_data = True
            start = now()
            try:
                batch = original(iterator)
            finally:
                clock.data += now() - start
                clock.in_data = False
            clock.samples += samples(batch)
            return batch

        return __next__

    def _iter(self, original: Callable[[Any], Any]) -> Callable[[Any], Any]:
        clock, get_ident, now = self, threading.get_ident, time.perf_counter

        def __iter__(loader: Any, /) -> Any:
            if clock.in_data or get_ident() != clock.thread:
                return original(loader)
            clock.in_data = True
            start = now()
            try:
                return original(loader)
            finally:
                clock.data += now() - start
                clock.in_data = False

        return __iter__

    def before(self, args: tuple, kwargs: dict, thread: int) -> Any:
        """A ``backward()`` begins (``core._backward``'s watcher): in a sampled step, timed to its end."""
        if not self.sampling or thread != self.thread:
            return _backward.SKIP
        self._watch(args[0] if args else kwargs.get("tensors"))
        return True

    def after(self, token: Any, args: tuple, kwargs: dict, raised: bool) -> None:
        self._returned()

    def _watch(self, tensors: Any) -> None:
        """Hook the first node of the backward pass about to run (it runs first in the pass)."""
        if isinstance(tensors, (list, tuple)):
            tensors = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        node = tensors.grad_fn if isinstance(tensors, torch.Tensor) else None
        if node is None:
            return
        if self.root is not None:
            self.root.remove()
        self.root = node.register_prehook(self._began)

    def _began(self, grad_outputs: Any) -> None:
        """The pass began: queue the callback that runs once it has computed every gradient."""
        if self.root is not None:
            self.root.remove()
            self.root = None
        if self.queue is not None:
            self.queue(self._computed)

    def _computed(self) -> None:
        self.computed, self.marks_at_computed = time.perf_counter(), MARKS.waited

    def _returned(self) -> None:
        """The pass returned, after DDP's wait for the gradients' all-reduce (its callback ran after
        ``_computed``): the time since every gradient was computed was spent waiting."""
        if self.computed:
            marked = MARKS.waited - self.marks_at_computed  # (counted by the marks already)
            self.wait += max(time.perf_counter() - self.computed - marked, 0.0)
            self.computed = 0.0

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """An optimizer stepped: the pacer's step ends a step, and the totals are written."""
        if threading.get_ident() != self.thread:
            return
        key = id(optimizer)
        if key != self.pacer:
            if self.pacer is not None and key not in self.others:
                self.others.add(key)
                return
            self.pacer = key  # the first to step, or one that stepped twice without the pacer
        self.others.clear()
        now, marks, totals = time.perf_counter(), MARKS.waited, self.totals
        totals[5] += 1
        if self.last is not None:
            totals[0] += 1
            totals[1] += now - self.last
            totals[2] += self.data
            self.marked += marks - self.marks_at
            if self.sampling:
                self.tails, self.tail_steps = self.tails + self.wait, self.tail_steps + 1
            waited = self.marked + self.tails / max(self.tail_steps, 1) * totals[0]  # (an estimate)
            totals[3] = max(min(waited, totals[1] - totals[2]), 0.0)
            totals[4] += self.samples
        sampling = now - self.sampled_at >= SAMPLE_SECONDS
        if sampling is not self.sampling:
            self.sampling = sampling
            _backward.CALLS.listen(self, sampling)
        if sampling:  # (the record too: the launcher reads it at most this late while it runs)
            self.sampled_at = now
            self.write()
        self.last, self.marks_at = now, marks
        self.data, self.wait, self.samples = 0.0, 0.0, 0


def samples(batch: Any) -> int:
    """The samples in ``batch``: the first dimension of its first array (a tensor, or anything with a
    ``shape``; in a tuple, list or mapping at most two deep), 0 where none is found."""
    for _ in range(3):
        shape = getattr(batch, "shape", None)
        if shape is not None:
            return int(shape[0]) if len(shape) else 1
        if isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        elif isinstance(batch, Mapping) and batch:
            batch = next(iter(batch.values()))
        else:
            return 0
    return 0


CLOCK = StepClock()


def measuring(world: World) -> contextlib.AbstractContextManager[None]:
    """Time this rank's steps while the user's code runs in ``world``.

    A no-op unless an autoddp launcher asks for the report (``AUTODDP_STEP_REPORT`` and its run
    folder), the world has several processes and this is the main thread; and inside a block
    already timed (a decorated function called by a script the command runs).
    """
    folder = os.environ.get(_variables.RUN_FOLDER)
    if (
        not folder
        or os.environ.get(_variables.STEP_REPORT) != "1"
        or world.world_size <= 1
        or CLOCK.thread != -1
        or threading.current_thread() is not threading.main_thread()
    ):
        return contextlib.nullcontext()
    return CLOCK.installed(folder, world)
