"""``python -m autoddp.in_rank.worker.script [--no-capture] (PATH | --module NAME) ARGS...``: a user script
in a worker.

Runs the script as ``python PATH ARGS`` / ``python -m NAME ARGS`` would (``sys.argv``,
``sys.path[0]``, ``__name__ == "__main__"``). A failure is written to torch.distributed.elastic's
error file, so the ``autoddp`` command can name the failing rank without the user adding
``@record``, and its traceback is printed without this runner's own frames.

In a world of several processes the script runs under ``autoddp.in_rank.capture`` (unless
``--no-capture``): this process is pinned to its GPU first, and the process group is made when
capture first needs it. A script that makes its own group first (torchrun-style) is left alone.
After a script that ends well, the process groups left open (its own, or the one capture made)
are destroyed at exit, after the script's own atexit hooks (``process_group.leave_open_groups``):
an open gloo group can abort the exit. While the script runs in a worker the launcher watches,
its collectives are marked for the hang report (``autoddp.in_rank.hang.marks``) and its steps
timed for the step report (``autoddp.in_rank.step_report``).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import datetime
import gc
import importlib.machinery
import inspect
import io
import json
import os
import runpy
import signal
import sys
import threading
import types
import zipfile
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from autoddp.core import _compat, _frames, _patches, _variables, backends, environment
from autoddp.core._compat import gloo_lines
from autoddp.core._warn import say
from autoddp.core.environment import hardware, preflight
from autoddp.core.state import CURRENT, RunOptions, World
from autoddp.in_rank import capture, models, step_report
from autoddp.in_rank.hang import marks
from autoddp.in_rank.run_folder import finished, transport
from autoddp.in_rank.worker import process, stdin
from autoddp.in_rank.world import process_group, stdout
from autoddp.in_rank.world.kept_groups import KeptGroups
from autoddp.in_rank.world.placement import own_gpu


def _run(argv: list[str]) -> None:
    if argv[0] == "--module":
        name, rest = argv[1], argv[2:]
        sys.argv = [name, *rest]
        sys.path[0] = os.getcwd()
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        path, rest = argv[0], argv[1:]
        sys.argv = [path, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        if os.path.isfile(path) and not zipfile.is_zipfile(path):
            _run_file(os.path.abspath(path))
        else:  # a folder or a zip with __main__.py
            runpy.run_path(path, run_name="__main__")


def _run_file(path: str) -> None:
    """Run the script at ``path`` (absolute) as ``python path`` does: in a fresh ``__main__``
    whose ``__file__`` is absolute (so ``os.path.dirname(__file__)`` survives an ``os.chdir``),
    ``__package__`` and ``__spec__`` None. (``runpy.run_path`` keeps the path as typed and sets
    ``__package__`` to ''.)"""
    with io.open_code(path) as handle:
        code = compile(handle.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=path,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __builtins__=builtins,
    )
    previous = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = previous


class _ScriptWorld:
    """The process group of a plain script: made when capture first needs it.

    It is entered and never left here: after a script that ended well, ``_leave_cleanly`` ends
    it at exit with any other group left open; after a failure it is left to the exit.
    """

    def __init__(
        self,
        world: World,
        backend: backends.Backend,
        timeout: datetime.timedelta | None,
        options: RunOptions,
    ) -> None:
        self.world, self.backend, self.timeout, self.options = world, backend, timeout, options
        self._joined: Any = None

    def join(self) -> World:
        """The group, entered with the run's options (what the code inside a rank reads as
        ``CURRENT.options``: the strategy, the memory budget, mixed precision)."""
        # preflight's notices were printed when the GPU was pinned (_start_capture)
        self._joined = process_group.joined(
            self.world, self.backend, self.timeout, self.options, announce=False
        )
        return self._joined.__enter__()


def _start_capture(
    capture_on: bool, options: RunOptions, timeout: datetime.timedelta | None = None
) -> capture.Session | None:
    """Pin this process's GPU and install capture, in a world of several processes with capture on."""
    world = environment.detect().world()
    if world.world_size <= 1 or not capture_on:
        return None
    backend = backends.resolve_backend(None, hardware.gpu_count())
    if backend.use_cuda:
        torch.cuda.set_device(preflight.check(world))  # before the script touches CUDA (or NCCL)
    else:
        own = own_gpu(world, torch.cuda.device_count())  # gloo beside GPUs: the one its rank would take
        if own is not None:
            torch.cuda.set_device(own)
    script_world = _ScriptWorld(world, backend, timeout, options)
    session = capture.Session(options, join=script_world.join, planned=world)
    session.install()
    return session


def _own_groups_checked(world: World, timeout: datetime.timedelta | None) -> _patches.Patches:
    """The script's own ``init_process_group`` calls, made as ``process_group.own_group_arguments``
    says (a world that is not this process's refused; the run's ``timeout`` where the call gives
    none), in a world of several processes."""
    if world.world_size <= 1:
        return _patches.Patches()

    def checked(original: Any) -> Any:
        signature = inspect.signature(original)

        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:  # torch's own error, from the call itself
                return original(*args, **kwargs)
            return original(**process_group.own_group_arguments(world, arguments, timeout))

        return init_process_group

    owners = (torch.distributed, torch.distributed.distributed_c10d)
    return _patches.Patches([_patches.wrapping(owner, "init_process_group", checked) for owner in owners])


def _runner_flags(argv: list[str]) -> tuple[bool, RunOptions, datetime.timedelta | None, list[str]]:
    """The command's own flags before the script: ``--no-capture``, ``--run-options JSON``,
    ``--timeout SECONDS``."""
    capture_on, options, timeout = True, RunOptions(), None
    while argv[:1] in (["--no-capture"], ["--run-options"], ["--timeout"]):
        if argv[0] == "--no-capture":
            capture_on, argv = False, argv[1:]
        elif argv[0] == "--timeout":
            timeout, argv = backends.as_timeout(float(argv[1])), argv[2:]
        else:
            given = json.loads(argv[1])
            given["fsdp_blocks"] = tuple(given.get("fsdp_blocks", ()))
            options, argv = dataclasses.replace(options, **given), argv[2:]
    return capture_on, options, timeout, argv


def _run_captured(argv: list[str], kept: KeptGroups) -> None:
    """Run the script, under capture unless the command said ``--no-capture``; the groups of its
    own DDP models are ``kept`` (released after its atexit hooks)."""
    capture_on, options, timeout, argv = _runner_flags(argv)
    world = environment.detect().world()
    one = models.no_sync_at_one_process() if world.world_size <= 1 else _patches.Patches()
    # the run's options for the script, its own group's too (--no-capture: autoddp.prepare's strategy)
    previous, CURRENT.options = CURRENT.options, options
    # the hang report's marks outermost, then the step report's clock
    with marks.marking(world), step_report.measuring(world), _own_groups_checked(world, timeout), one:
        session = _start_capture(capture_on, options, timeout)
        kept.install()
        try:
            with models.recovering():
                _run(argv)
            if session is not None:
                session.ended_well = True
        finally:
            kept.uninstall()
            if session is not None:
                session.uninstall()
            CURRENT.options = previous


def main(leave_groups_at_exit: bool = True, kept: KeptGroups | None = None) -> None:
    """Run the script named in ``sys.argv`` as this interpreter's program.

    ``leave_groups_at_exit``: end the process groups the script left open at exit. A forked
    worker leaves with ``os._exit`` (no interpreter teardown, so no abort of gloo's threads to
    prevent), and ending the group there would leave the script's own DDP to be freed after its
    group, when atexit lets go of the script's hooks (a deadlock in gloo). ``kept``: the groups
    of the script's DDP models, released by the caller after the atexit hooks (else at exit here).
    """
    process.die_with_parent()
    gloo_lines.quiet_gloo_connections(stdout.without_lines)  # the script's own process groups too
    run_folder = os.environ.get(_variables.RUN_FOLDER)
    if run_folder:  # a worker of autoddp's launcher (srun, mpirun: their own stdin and stacks)
        process.give_stdin(int(os.environ.get("RANK", "0")))
        process.whole_lines()
        # where this rank was if autoddp stops it (a peer timed out or died waiting for it)
        process.STACK_DUMP.arm(run_folder, int(os.environ.get("RANK", "0")))
    if kept is None:
        kept = KeptGroups()
        atexit.register(_ended_here, kept)  # registered first, so it runs last
    if leave_groups_at_exit:
        # Registered before the script runs, so it runs after the script's own atexit hooks.
        atexit.register(_leave_cleanly)
    try:
        _run_captured(sys.argv[1:], kept)
    except SystemExit as stop:
        folder = os.environ.get(_variables.RUN_FOLDER)
        if folder and stop.code not in (None, 0):  # the launcher names the rank and the code
            transport.save_error(folder, int(os.environ.get("RANK", "0")), stop)
        _ended(well=stop.code in (None, 0))
        raise
    except KeyboardInterrupt:  # the launcher passes Ctrl-C on and reports it once, for everyone
        sys.exit(128 + 2)
    except BaseException as exc:
        stdin.note_eof(exc, int(os.environ.get("RANK", "0")) if run_folder else 0)
        ErrorHandler().record_exception(exc)
        folder = os.environ.get(_variables.RUN_FOLDER)
        if folder:
            transport.save_error(folder, int(os.environ.get("RANK", "0")), exc)
        exc.__traceback__ = _frames.without_runners(exc.__traceback__)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)
    if os.environ.get("WORLD_SIZE", "1") != "1":
        finished.mark_finished(int(os.environ.get("RANK", "0")))  # (peers still waiting are told why)
    _ended(well=True)


def run_script_forked(argv: list[str]) -> None:
    """Entry point of a worker forked from the ``autoddp`` command (its fast start): run the script
    as ``python -m autoddp.in_rank.worker.script ARGV`` would, then leave as that interpreter would.

    Returns only on success, as elastic expects; the exit status otherwise. The command's own
    atexit hooks and signal handlers are not the script's: dropped first (the script's atexit
    hooks run at its end); what the command's process holds is frozen away from the garbage
    collector (a loopback store's server thread lives there).
    """
    gc.freeze()
    process.own_session()  # (a session of its own, as torchrun's workers)
    _compat.clear_atexit_hooks()
    _fresh_random_streams()
    process.start_method_of_caller(None)  # (as in a fresh interpreter: the script may choose one)
    process.use_thread_count()  # (torch read OMP_NUM_THREADS in the command, before it was set)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    sys.argv = [sys.argv[0], *argv]
    code: Any = 0
    kept = KeptGroups()
    try:
        main(leave_groups_at_exit=False, kept=kept)
    except SystemExit as stop:
        code = stop.code
    if isinstance(code, str):  # as the interpreter does for sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    _compat.run_atexit_hooks()  # the script's own; letting go of them frees what they held
    if not code and _ENDED_WELL[0]:
        # A rank that is done must not keep its connections open while it waits for elastic to
        # collect the others: a peer still in a collective with it would wait, not fail.
        finished.mark(_rank(), finished.LEAVING)
        gc.collect()
        _leave_cleanly()
        kept.release()  # the last references of the script's groups: gloo's threads end, unblocked
        finished.mark(_rank(), finished.ENDED)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if code:
        os._exit(int(code) if isinstance(code, int) else 1)


def _fresh_random_streams() -> None:
    """Seed torch, ``random`` and NumPy from the system, as a fresh interpreter starts them.

    A forked worker would otherwise draw the command process's numbers, the same on every rank;
    under torchrun, ranks of a script that does not seed draw different ones.
    """
    import random

    torch.seed()
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


#: Whether the script ended well (after an error the group is left alone: others may still use it).
_ENDED_WELL = [False]


def _ended(well: bool) -> None:
    """Note how the script ended; after a good end, collect its garbage first thing at exit.

    Registered now, the collection runs before the script's own atexit hooks (last registered,
    first run): a DDP kept alive only by a reference cycle is gone before a hook of the script
    destroys the group itself (freeing a DDP after its group can abort or deadlock gloo).
    """
    _ENDED_WELL[0] = well
    if well:
        atexit.register(gc.collect)


def _leave_cleanly() -> None:
    """At exit, after a script that ended well: end the process groups it left open.

    An open gloo group can abort the interpreter's exit; the script's own atexit hooks have
    run by now, with the group still there.
    """
    if not _ENDED_WELL[0]:
        return
    finished.mark(_rank(), finished.LEAVING)  # (idempotent: a forked worker marked it already)
    try:
        process_group.leave_open_groups()
    except Exception as error:  # the script succeeded: say so, do not turn it into a failure
        say(f"could not end the process group the script left open: {error}")


def _ended_here(kept: KeptGroups) -> None:
    """The last of a fresh interpreter's atexit hooks: let go of the kept groups, then say so."""
    kept.release()
    if _ENDED_WELL[0]:
        finished.mark(_rank(), finished.ENDED)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    main()
