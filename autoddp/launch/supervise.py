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

from autoddp._warn import say
from autoddp.errors import WorkerError
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
    with caller_signal_handlers_kept(), elastic_logs_quiet():
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # forked children must not inherit unflushed output
        context = None
        try:
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
            if context is not None:
                context.close(timeout=_STOP_GRACE_SECONDS)
            stopped_by = exc.sigval
        except BaseException:
            if context is not None:
                context.close(timeout=_STOP_GRACE_SECONDS)
            raise
    raise Stopped(stopped_by)  # the run's folders go on the way out; ``acting_on_signals`` acts


def _wait(context: Any, poll_seconds: float, exits: Exits | None) -> Any:
    """Elastic's wait, also stopping at a worker that ended without its function's result
    (``Exits.without_result``: elastic would wait for it forever under fork)."""
    while True:
        result = context.wait(timeout=0)
        if result is not None:
            return result
        if exits is not None and exits.returns:
            gone = exits.without_result(exit_codes(context))
            if gone:
                raise exits.without_result_error(gone)
        time.sleep(poll_seconds)


class Stopped(BaseException):
    """The workers were stopped by a signal to this process; raised through the run's ``with``
    blocks (so its folders are removed, as after Ctrl-C) up to ``acting_on_signals``."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.sig = sig


@contextlib.contextmanager
def acting_on_signals(where: str = "") -> Iterator[None]:
    """Around a whole launch: once its folders are gone, act on a signal that stopped the workers
    as the caller's process would have (its own handlers are back: SIGTERM kills it with 143)."""
    try:
        yield
    except Stopped as stop:
        say(f"{stop.sig.name} received: stopped all workers{where}")
        if stop.sig == signal.SIGINT:
            raise KeyboardInterrupt from None
        signal.raise_signal(stop.sig)
        raise WorkerError(
            f"workers stopped by {stop.sig.name}", rank=-1, exitcode=None, signal=stop.sig.name
        ) from None


@contextlib.contextmanager
def caller_signal_handlers_kept() -> Iterator[None]:
    """Elastic installs its own handlers while workers run; give the caller's back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    saved = {sig: signal.getsignal(sig) for sig in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


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
