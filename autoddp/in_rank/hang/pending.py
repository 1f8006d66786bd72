"""Collectives that returned before they completed: watched until they do, off the training thread.

A collective's Python call can end long before the collective does: an asynchronous call
(``async_op=True``) returns its work object at once, and on NCCL every collective returns once
queued on the GPU stream (DDP's gradient all-reduce too: its reducer makes the stream wait, not
the CPU). So the marks around the call alone would say "outside" while this rank in truth still
waits for the others. Each such call leaves a token here: the work object itself (held weakly, so
its tensors are freed when the user lets go of it) or, for a synchronous call on CUDA tensors, a
CUDA event recorded after it on the current stream, which completes only after the collective (the
stream ran it, or waits for it). A thread polls the tokens ``PERIOD`` times a second and writes
the oldest one not completed into the record (``record.Writer.pending``); the training thread only
appends to a deque. Nothing ever waits for a GPU here.
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from autoddp.core import _frames

PERIOD = 0.25  # seconds between two polls of the tokens
#: Tokens kept at most: beyond, the oldest go (memory stays bounded even if a work object never
#: says it completed; a rank that truly waits issues no more collectives, its oldest stays).
MAX_TOKENS = 4096


class Pending:
    """The tokens of one worker's collectives not known to be complete, oldest first."""

    def __init__(self) -> None:
        self.cuda = False  # CUDA is in use in this process (set by the poller): only then look at tensors
        # (number, token, name, since, site), oldest first
        self.tokens: collections.deque = collections.deque(maxlen=MAX_TOKENS)
        self.events: collections.deque = collections.deque()  # CUDA events free for reuse
        self.writer: Any = None
        self.number = 0  # the number of the last token added
        self.shown = 0  # the number of the token the record shows (0: none)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the training thread's side: a few attribute reads, an append when there is something --

    def work(self, name: int, since: float, work: Any) -> None:
        """A collective returned ``work`` (asynchronous, or a backend's pending work object)."""
        if isinstance(work, dist.Work):
            self._add(weakref.ref(work), name, since)

    def after_cuda(self, name: int, since: float, args: tuple, kwargs: dict) -> None:
        """A synchronous collective (or DDP's backward) returned: on CUDA tensors, follow the stream."""
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, list | tuple) and first:
            first = first[0]
        # (Not while a CUDA graph is captured: an event recorded there could not be queried.)
        if getattr(first, "is_cuda", False) and not torch.cuda.is_current_stream_capturing():
            event = self.events.popleft() if self.events else torch.cuda.Event()
            event.record()  # on the current stream: it completes after the collective
            self._add(event, name, since)

    def _add(self, token: Any, name: int, since: float) -> None:
        self.number += 1
        self.tokens.append((self.number, token, name, since, _caller()))

    # --- the poller's side ----------------------------------------------------------------------

    def start(self, writer: Any) -> None:
        self.writer, self.shown, self.cuda = writer, 0, torch.cuda.is_initialized()
        self._stop.clear()
        self._thread = threading.Thread(
            target=self.poll_pending_collectives, name="autoddp-hang-pending", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """End the poller (before the record is closed) and forget the tokens."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._thread, self.writer = None, None
        self.tokens.clear()

    def forked(self) -> None:
        """In a forked child: no poller runs there, and nothing may be written."""
        self._thread, self.writer, self.cuda = None, None, False
        self.tokens, self.events = collections.deque(maxlen=MAX_TOKENS), collections.deque()

    def poll_pending_collectives(self) -> None:  # named in record.POLLER: the caller hides its stack
        while not self._stop.wait(PERIOD):
            try:
                self.poll()
            except Exception:  # (the record was closed meanwhile): the watch only loses this rank's view
                return

    def poll(self) -> None:
        """Drop the completed tokens at the front; show the oldest one left in the record."""
        if not self.cuda:
            self.cuda = torch.cuda.is_initialized()
        tokens = self.tokens
        while tokens and _completed(tokens[0][1]):
            token = tokens.popleft()[1]
            if isinstance(token, torch.cuda.Event):
                self.events.append(token)
        front = tokens[0] if tokens else None
        number = front[0] if front is not None else 0
        if number != self.shown and self.writer is not None:
            if front is None:
                self.writer.pending(0, 0, 0.0, None)
            else:
                self.writer.pending(number, front[2], front[3], front[4])
            self.shown = number


def _completed(token: Any) -> bool:
    if isinstance(token, weakref.ref):
        work = token()
        return work is None or work.is_completed()  # (let go of: no longer watched)
    return token.query()


def _caller() -> tuple[str, int, str] | None:
    """The user's frame (``_frames``) that made the call, or None."""
    frame = _frames.user_frame(sys._getframe(3))
    if frame is None:
        return None
    return frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
