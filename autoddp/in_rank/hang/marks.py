"""The worker's side of the hang report: say in the record what this rank waits in, and since when.

While the user's code runs in a worker that an autoddp launcher watches (``AUTODDP_HANG_FOLDER``
set, a world of several processes), ``marking`` replaces torch.distributed's collectives and the
functional ones DTensor (so FSDP2's state dicts and whole reads) gathers through, wherever a
loaded ``torch.distributed`` module binds them (``_compat.collectives.sites``, as ``rank0()``'s
refusals do), with thin wrappers, and watches ``torch.autograd.backward`` (a watcher of
``core._backward``'s one wrapper). A functional collective returns
at once and waits in ``wait_tensor``: that wait is marked under the name of the last one issued.
On entry a wrapper writes "in all_reduce since t" into the record (a memory write into a mapped
file), on exit "outside since t": about a microsecond per call, on the collectives only. DDP's
gradient all-reduce runs in C++ inside ``backward()``; the backward watcher marks it once a
DistributedDataParallel exists in the process. A call that returns before its collective completes
(a work object; on CUDA tensors, NCCL's queued collectives and DDP's backward) leaves a token to
``pending``, whose thread keeps "in all_reduce since t" in the record until the collective
completes. ``rank0()`` marks its blocks itself (``mark``/``unmark``). The time spent in a collective
or waiting for rank 0's block adds up in ``Marks.waited``: the step report's time in collectives
(``autoddp.in_rank.step_report``). Only the thread that runs
the user's code is marked; code being traced by ``torch.compile`` and forked children pass
through.

The worker also answers ``record.DUMP_SIGNAL`` with its Python stacks (faulthandler, in C, so
it answers while it blocks in C++ or holds the GIL), written to its dump file for the launcher.
Everything is put back when the user's code ends.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from autoddp.core import _backward, _compat, _patches, _variables
from autoddp.core._compat import collectives
from autoddp.core.state import World
from autoddp.in_rank.hang import pending, record

_BACKWARD = record.NAMES.index("backward")
#: Marked beside the collectives: they wait for every rank too.
_OTHERS = ("init_process_group", "new_group")
_AT = record.STATE_OFFSET
_pack, _monotonic = record.STATE.pack_into, time.monotonic
#: The kinds counted as waiting for the other ranks (DDP's backward is timed by the step report itself).
_WAITING = (record.COLLECTIVE, record.WAITS_FOR_RANK0)


class Marks:
    """This worker's record and the wrappers that keep it up to date: the module's one state."""

    def __init__(self) -> None:
        self.thread = -1  # the thread whose calls are marked; -1: not installed (or a forked child)
        self.kind = record.OUTSIDE
        self.sequence = 0
        self.flags = 0
        self.since = 0.0
        self.map: Any = None
        self.writer: record.Writer | None = None
        self.dump: Any = None
        self.patches = _patches.Patches()  # the wrappers in place while installed
        self.wrappers: dict[int, tuple[Any, Any]] = {}  # id(original) -> (original, its wrapper)
        self.forks_watched = False
        self.pending = pending.Pending()
        self.functional = -1  # the last functional collective issued (its wait is shown as it)
        #: Seconds spent waiting for the other ranks, in a collective or for rank 0's block, since
        #: installed (the step report's time in collectives: ``in_rank.step_report``).
        self.waited = 0.0

    # --- lifecycle ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def installed(self, folder: str, world: World) -> Iterator[None]:
        """The record and the wrappers for a ``with`` block (the user's code)."""
        self.writer = record.Writer(
            record.record_path(folder, world.local_rank), world.rank, world.world_size, world.local_rank
        )
        self.map, self.thread, self.flags = self.writer.map, threading.get_ident(), record.ACTIVE
        try:
            self._answer_dumps(record.dump_path(folder, world.local_rank))
            self.patch()
            if not self.forks_watched:
                os.register_at_fork(after_in_child=self._forked)
                self.forks_watched = True
            self._write(record.OUTSIDE, 0)
            self.pending.start(self.writer)
            yield
        finally:
            self._uninstall()

    def _answer_dumps(self, path: str) -> None:
        """Have faulthandler write every thread's stack to ``path`` on DUMP_SIGNAL."""
        if record.DUMP_SIGNAL is None:
            return
        self.dump = os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600), "w")
        # What the signal does once faulthandler lets go of it (after the call, at exit): nothing.
        signal.signal(record.DUMP_SIGNAL, signal.SIG_IGN)
        faulthandler.register(record.DUMP_SIGNAL, file=self.dump, all_threads=True, chain=False)
        self.flags |= record.ANSWERS

    def _uninstall(self) -> None:
        self.unpatch()
        self.pending.stop()
        if self.map is not None:
            self.flags = 0  # first: the launcher sends no signal to a worker that says so
            self._write(record.OUTSIDE, 0)
        if self.dump is not None:
            faulthandler.unregister(record.DUMP_SIGNAL)  # back to SIG_IGN
            self.dump.close()
        if self.writer is not None and self.map is not None:
            self.writer.close()
        self.thread, self.kind, self.map, self.writer, self.dump = -1, record.OUTSIDE, None, None, None
        self.functional = -1

    def _forked(self) -> None:
        """In a child forked while installed (a DataLoader worker): mark nothing, write nothing."""
        self.thread, self.map, self.writer, self.dump = -1, None, None, None
        self.patches.forget()
        self.pending.forked()

    def patch(self) -> None:
        """Put the wrappers in place (``installed`` does; ``unpatch`` takes them out).

        One wrapper per original, made once: patched again, a function is replaced by the very
        same object (so Python's specialised calls to it stay valid).
        """
        _compat.ddp_buffer_broadcast()  # checks that DDP's broadcast is where autoddp expects it
        patches = []
        ours = {id(wrapper) for _, wrapper in self.wrappers.values()}
        for module, attribute, name, functional in collectives.sites():
            original = vars(module)[attribute]
            if id(original) in ours:  # bound to our wrapper (imported while marks stood): it marks already
                continue
            marked = functools.partial(self._collective, record.NAMES.index(name), functional=functional)
            patches.append(self._wrapper(module, attribute, original, marked))
        for module in (dist, dist.distributed_c10d):
            for name in (*_OTHERS, _compat.DDP_BUFFER_BROADCAST):
                original = vars(module).get(name)
                if original is not None:
                    patches.append(
                        self._wrapper(
                            module,
                            name,
                            original,
                            functools.partial(self._collective, record.NAMES.index(name)),
                        )
                    )
        funcol = collectives.functional()
        wait = vars(funcol)[collectives.FUNCTIONAL_WAIT]
        patches.append(self._wrapper(funcol, collectives.FUNCTIONAL_WAIT, wait, self._functional_wait))
        ddp = torch.nn.parallel.DistributedDataParallel
        patches.append(self._wrapper(ddp, "__init__", ddp.__init__, self._ddp_init))
        self.patches.install(patches)
        _backward.CALLS.add(self, listening=bool(self.flags & record.HAS_DDP))  # (``_ddp_init``)

    def unpatch(self) -> None:
        """The originals back, where a wrapper of ours is still in place (``_patches``' rule)."""
        _backward.CALLS.remove(self)
        self.patches.restore()

    def _wrapper(self, owner: Any, name: str, original: Any, make: Callable[[Any], Any]) -> tuple:
        if id(original) not in self.wrappers:  # (the original is kept: its id stays its own)
            self.wrappers[id(original)] = (original, make(original))
        return owner, name, self.wrappers[id(original)][1]

    # --- the record ---------------------------------------------------------------------------

    def _write(self, kind: int, name: int) -> None:
        now = _monotonic()
        if self.kind in _WAITING:  # a wait for the others ends
            self.waited += now - self.since
        sequence = self.sequence + 1
        self.kind, self.sequence, self.since = kind, sequence, now
        _pack(self.map, _AT, sequence, self.flags, kind, name, now)

    def mark(self, kind: int, site: str) -> bool:
        """Mark a rank0() block (``record.WAITS_FOR_RANK0`` or ``RUNS_RANK0`` at ``site``).

        True when marked: then call ``unmark`` when it ends. False where nothing is watched.
        """
        if self.kind or threading.get_ident() != self.thread or self.writer is None:
            return False
        self.writer.site(site)
        self._write(kind, 0)
        return True

    def unmark(self) -> None:
        if self.map is not None and threading.get_ident() == self.thread:
            self._write(record.OUTSIDE, 0)

    @contextlib.contextmanager
    def marked(self, kind: int, site: str) -> Iterator[None]:
        """``mark`` for a ``with`` block."""
        marked = self.mark(kind, site)
        try:
            yield
        finally:
            if marked:
                self.unmark()

    # --- the wrappers -------------------------------------------------------------------------

    def _collective(
        self, index: int, original: Callable[..., Any], functional: bool = False
    ) -> Callable[..., Any]:
        marks, get_ident, compiling, waits = (
            self,
            threading.get_ident,
            torch.compiler.is_compiling,
            self.pending,
        )

        @functools.wraps(original)
        def marked(*args: Any, **kwargs: Any) -> Any:
            # Traced by torch.compile: exactly the original (``compiling()`` is a constant there).
            if compiling() or marks.kind or get_ident() != marks.thread:
                return original(*args, **kwargs)
            marks._write(record.COLLECTIVE, index)
            since = marks.since
            if functional:  # it returns at once: its wait (``_functional_wait``) is shown under its name
                marks.functional = index
            try:
                result = original(*args, **kwargs)
            finally:
                marks._write(record.OUTSIDE, 0)
            if functional:
                return result
            # Returned before completing? A work object (async_op=True); on CUDA, NCCL's queue.
            if result is not None:
                waits.work(index, since, result)
            elif waits.cuda:
                waits.after_cuda(index, since, args, kwargs)
            return result

        return marked

    def _functional_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """The functional collectives' ``wait_tensor``, marked as the last one issued (blocks there)."""
        marks, get_ident, compiling = self, threading.get_ident, torch.compiler.is_compiling

        @functools.wraps(original)
        def wait_tensor(*args: Any, **kwargs: Any) -> Any:
            if compiling() or marks.kind or get_ident() != marks.thread or marks.functional < 0:
                return original(*args, **kwargs)
            marks._write(record.COLLECTIVE, marks.functional)
            try:
                return original(*args, **kwargs)
            finally:
                marks._write(record.OUTSIDE, 0)

        return wait_tensor

    def before(self, args: tuple, kwargs: dict, thread: int) -> Any:
        """A ``backward()`` begins (``core._backward``'s watcher): marked once a DDP exists."""
        if self.kind or not self.flags & record.HAS_DDP or thread != self.thread:
            return _backward.SKIP
        # ``_write(record.BACKWARD, _BACKWARD)`` inline (the path of every step; outside, no wait ends)
        now, sequence = _monotonic(), self.sequence + 1
        self.kind, self.sequence, self.since = record.BACKWARD, sequence, now
        _pack(self.map, _AT, sequence, self.flags, record.BACKWARD, _BACKWARD, now)
        return now

    def after(self, since: float, args: tuple, kwargs: dict, raised: bool) -> None:
        # ``_write(record.OUTSIDE, 0)`` inline (the path of every step)
        now, sequence = _monotonic(), self.sequence + 1
        if self.kind in _WAITING:  # (a backward is no wait: only where something else marked since)
            self.waited += now - self.since
        self.kind, self.sequence, self.since = record.OUTSIDE, sequence, now
        _pack(self.map, _AT, sequence, self.flags, record.OUTSIDE, 0, now)
        if not raised and self.pending.cuda:  # on NCCL DDP's all-reduce completes on the GPU later
            self.pending.after_cuda(_BACKWARD, since, args, kwargs)

    def _ddp_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        marks = self

        @functools.wraps(original)
        def __init__(ddp: Any, /, *args: Any, **kwargs: Any) -> None:
            original(ddp, *args, **kwargs)
            if marks.map is not None and not marks.flags & record.HAS_DDP:
                marks.flags |= record.HAS_DDP  # written with the next entry or exit
                _backward.CALLS.listen(marks, True)  # (each backward() marked from now on)

        return __init__


MARKS = Marks()


def marking(world: World) -> contextlib.AbstractContextManager[None]:
    """Keep this worker's hang record while the user's code runs in ``world``.

    A no-op unless an autoddp launcher watches this worker (``AUTODDP_HANG_FOLDER``), the world
    has several processes and this is the main thread; and inside a block already marked (a
    decorated function called by a script the command runs).
    """
    folder = os.environ.get(_variables.HANG_FOLDER)
    if (
        not folder
        or world.world_size <= 1
        or MARKS.thread != -1
        or threading.current_thread() is not threading.main_thread()
    ):
        return contextlib.nullcontext()
    return MARKS.installed(folder, world)
