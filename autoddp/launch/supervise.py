"""Supervision: start the workers with elastic's multiprocessing, wait, stop them all on a failure
or a signal, and give the caller its own signal handlers back."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from autoddp.core._warn import say
from autoddp.core.errors import WorkerError
from autoddp.launch import output
from autoddp.launch.exits import Exits
from autoddp.launch.failures import exit_codes

POLL_SECONDS = 0.05
_STOP_GRACE_SECONDS = 5


def supervise(
    entry: Any,
    entry_args: dict,
    envs: dict,
    method: str,
    poll_seconds: float,
    logs: tuple[Any, dict[int, str]],
    watch: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    exits: Exits | None = None,
) -> Any:
    """Start the workers with elastic's multiprocessing and wait for all to end or one to fail.

    ``watch`` (the hang report) and ``exits`` (a rank that never ends after the user's code) run
    while they do; they start once the workers have, so that no thread of theirs is running when
    forked workers are made.
    """
    from torch.distributed.elastic.multiprocessing import start_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException

    logs_specs, prefixes = logs
    with caller_signal_handlers_kept() as handlers, elastic_logs_quiet():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # forked children must not inherit unflushed output
        context = None
        try:
            with output.forks_write_to_descriptors(method):  # (a notebook's streams: see there)
                context = start_processes(
                    name="autoddp",
                    entrypoint=entry,
                    args=entry_args,
                    envs=envs,
                    logs_specs=logs_specs,
                    log_line_prefixes=prefixes,
                    start_method="fork" if method == "fork" else "spawn",
                )
            ended = exits.watching(context.pids) if exits is not None else contextlib.nullcontext()
            with watch(), ended:
                return context, _wait(context, poll_seconds, exits)
        except SignalException as exc:  # (start_processes closes its workers itself if it fails)
            handlers.hold()  # a second Ctrl-C must not cut the stop short (workers left running)
            if context is not None:
                context.close(timeout=_STOP_GRACE_SECONDS)
            stopped_by = exc.sigval
        except BaseException:
            if context is not None:
                context.close(timeout=_STOP_GRACE_SECONDS)
            raise
    raise Stopped(stopped_by, handlers)  # the run's folders go on the way out; ``acting_on_signals`` acts


def _wait(context: Any, poll_seconds: float, exits: Exits | None) -> Any:
    """Elastic's wait, also stopping at a worker that ended without its function's result
    (``Exits.without_result``: elastic would wait for it forever under fork), and ending a script's
    run whose every worker exited with status 0 (a script that ends with ``os._exit(0)``, which
    skips teardown: under fork elastic waits forever for a return value no worker sends)."""
    from torch.distributed.elastic.multiprocessing.api import RunProcsResult

    while True:
        result = context.wait(timeout=0)
        if result is not None:
            return result
        if exits is not None and exits.returns:
            gone = exits.without_result(exit_codes(context))
            if gone:
                raise exits.without_result_error(gone)
        elif exits is not None:
            codes = exit_codes(context)
            if codes and all(code == 0 for code in codes.values()):
                return RunProcsResult(return_values=dict.fromkeys(codes))
        time.sleep(poll_seconds)


class Stopped(BaseException):
    """The workers were stopped by a signal to this process; raised through the run's ``with``
    blocks (so its folders are removed, as after Ctrl-C) up to ``acting_on_signals``.

    ``handlers``: the caller's signal handlers, held back (the signals ignored) until then.
    """

    def __init__(self, sig: signal.Signals, handlers: Handlers | None = None) -> None:
        super().__init__(sig.name)
        self.sig = sig
        self.handlers = handlers


@contextlib.contextmanager
def acting_on_signals(where: str = "", for_good: bool = False) -> Iterator[None]:
    """Around a whole launch: once its folders are gone, act on a signal that stopped the workers
    as the caller's process would have (its own handlers are back: SIGTERM kills it with 143).

    ``for_good``: the process ends after this (the command): the signals stay ignored, so that
    a second Ctrl-C cannot interrupt its exit (a traceback instead of status 130).
    """
    try:
        yield
    except Stopped as stop:
        if stop.handlers is not None and not for_good:
            stop.handlers.restore()
        say(f"{stop.sig.name} received: stopped all workers{where}")
        if stop.sig == signal.SIGINT:
            raise KeyboardInterrupt from None
        if for_good:
            signal.signal(stop.sig, signal.SIG_DFL)
        signal.raise_signal(stop.sig)
        raise WorkerError(
            f"workers stopped by {stop.sig.name}", rank=-1, exitcode=None, signal=stop.sig.name
        ) from None


class Handlers:
    """The caller's handlers of the signals that stop a run, given back when the run ends."""

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")

    def __init__(self, main_thread: bool = True) -> None:
        signals = (getattr(signal, name) for name in self.NAMES if hasattr(signal, name) and main_thread)
        self.saved = {sig: signal.getsignal(sig) for sig in signals}
        self.held = False

    def hold(self) -> None:
        """Ignore these signals from now on, the caller's handlers given back by ``restore`` only."""
        self.held = True
        for sig in self.saved:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self.saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextlib.contextmanager
def caller_signal_handlers_kept() -> Iterator[Handlers]:
    """Elastic installs its own handlers while workers run; give the caller's back afterwards
    (unless ``Handlers.hold``: then whoever acts on the stop gives them back)."""
    if threading.current_thread() is not threading.main_thread():
        yield Handlers(main_thread=False)  # (only the main thread has signal handlers)
        return
    handlers = Handlers()
    try:
        yield handlers
    finally:
        if not handlers.held:
            handlers.restore()


@contextlib.contextmanager
def elastic_logs_quiet() -> Iterator[None]:
    """Elastic logs every stop and failure; autoddp reports failures itself."""
    loggers = [
        logging.getLogger(name)
        for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing"))
    ]
    previous = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, was in zip(loggers, previous, strict=True):
            logger.disabled = was
