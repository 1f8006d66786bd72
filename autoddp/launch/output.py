"""Console routing: which ranks' output reaches the console, where every rank's output is kept,
and autoddp's own one-line messages on stderr."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import sys
from collections.abc import Iterator
from typing import Any

from autoddp.core._warn import say
from autoddp.core.errors import ConfigurationError


@dataclasses.dataclass(frozen=True)
class Output:
    """Which ranks' output reaches the console, and where every rank's output is kept.

    ``ranks``: ``"0"`` (default: rank 0 only, as written), ``"all"`` (every rank, each line
    prefixed ``[rank N]``) or comma-separated local ranks. Every rank's stdout and stderr also
    go to files under ``log_dir`` (a private folder removed after the run when unset), in a
    folder named by the rank; the last lines of a failed rank that the console did not show are
    printed when it fails. On several machines the same holds on each: ``ranks`` names that
    machine's local ranks (as torchrun's ``--local-ranks-filter``), ``N`` and the files' folders
    are global ranks, so machines that share ``log_dir`` never mix their files.
    """

    ranks: str = "0"
    log_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, str):
            raise ConfigurationError(f"ranks={self.ranks!r}: use '0', 'all' or local ranks such as '0,1'")
        if self.log_dir is not None and not isinstance(self.log_dir, (str, os.PathLike)):
            raise ConfigurationError(
                f"log_dir={self.log_dir!r} is not a folder path; pass a path such as 'logs' (or None)"
            )
        if self.log_dir is not None:
            _check_writable_folder(os.fspath(self.log_dir))
        if self.ranks != "all":
            try:
                shown = {int(r) for r in self.ranks.split(",")}
            except ValueError:
                raise ConfigurationError(
                    f"ranks={self.ranks!r}: use '0', 'all' or comma-separated local ranks such as '0,1'"
                ) from None
            if not shown or min(shown) < 0:
                raise ConfigurationError(f"ranks={self.ranks!r}: local ranks count from 0")

    def shown(self, nproc: int) -> set[int]:
        """The local ranks whose output reaches the console in a run of ``nproc`` processes."""
        if self.ranks == "all":
            return set(range(nproc))
        shown = {int(r) for r in self.ranks.split(",")}
        if not shown <= set(range(nproc)):
            raise ConfigurationError(
                f"ranks={self.ranks!r} names ranks outside 0..{nproc - 1} (this run has {nproc} processes)"
            )
        return shown

    @property
    def prefixed(self) -> bool:
        """True when the launcher prefixes every line with ``[rank N]`` (``ranks="all"``)."""
        return self.ranks == "all"

    def logs_specs(self, folder: str, nproc: int) -> tuple[Any, dict[int, str]]:
        """Elastic's log settings for a run on this machine: the specs and each rank's line prefix.

        Shown ranks write straight to the console (a terminal stays a terminal: progress bars
        redraw, colours stay); hidden ranks write to files. With ``log_dir`` the shown ranks are
        also kept in files (teed to the console line by line). With ``"all"`` every rank goes
        through a file so that its lines can be prefixed. When this process's stdout is not a
        real file (captured, redirected to a StringIO), forked workers could not redirect
        theirs: then everything passes through unfiltered.
        """
        specs = self._specs(folder, nproc)
        if not real_stdio():
            return specs, {}
        if self.prefixed:
            return specs, {r: f"[rank {r}] " for r in range(nproc)}
        return specs, ({r: "" for r in self.shown(nproc)} if self.log_dir is not None else {})

    def agent_logs(self, folder: str, nproc: int) -> tuple[Any, str | None]:
        """The same settings for elastic's agent (several machines): the specs and the line
        prefix template, ``[rank N]`` with N the global rank (the agent takes no per-rank prefixes)."""
        from autoddp.core import _compat

        specs = self._specs(folder, nproc)
        if not real_stdio():
            return specs, None
        if self.prefixed:
            return specs, "[rank ${rank}] "
        return specs, (_compat.no_line_prefix() if self.log_dir is not None else None)

    def _specs(self, folder: str, nproc: int) -> Any:
        """Which local ranks write to files under which folder, and which of those reach the console."""
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        from autoddp.launch.rank_logs import RankLogs

        shown = self.shown(nproc)
        if not real_stdio():
            return DefaultLogsSpecs(log_dir=os.devnull)
        log_dir = os.fspath(self.log_dir) if self.log_dir is not None else os.path.join(folder, "logs")
        if self.log_dir is not None:
            _make_folder(log_dir)
        if self.prefixed:
            return RankLogs(log_dir=log_dir, redirects=Std.ALL, tee=Std.ALL)
        if self.log_dir is not None:  # every rank in the files; the shown ones on the console too
            tee = {r: (Std.ALL if r in shown else Std.NONE) for r in range(nproc)}
            return RankLogs(log_dir=log_dir, redirects=Std.ALL, tee=tee)
        redirects = {r: (Std.NONE if r in shown else Std.ALL) for r in range(nproc)}
        return RankLogs(log_dir=log_dir, redirects=redirects)


def _make_folder(path: str) -> None:
    """Make the user's log folder now, so that a path the system refuses is one clear error."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"log_dir={path!r} cannot be made ({exc.strerror}); choose another folder for the logs"
        ) from None


def _check_writable_folder(path: str) -> None:
    """``path`` is a folder this user can write to, or one that can be made: else a clear error."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigurationError(
            f"log_dir={path!r} cannot be written ({probe!r} is not a folder this user can write to); "
            "choose another folder for the logs"
        )


def real_stdio() -> bool:
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def forks_write_to_descriptors(method: str) -> Iterator[None]:
    """While forked workers are started: ``sys.stdout``/``sys.stderr`` write to descriptors 1 and 2
    where this process's streams send their output around them, so the workers inherit streams on
    the descriptors that elastic routes (``ranks=``, ``[rank N]``, log files).

    A notebook's streams (ipykernel's) claim another descriptor (a copy of the kernel's console)
    and send what is written over the kernel's socket, from a forked child too: elastic would
    redirect the copy, and every rank's ``print`` would reach the cell. The kernel watches its
    descriptors 1 and 2 and shows what reaches them in the cell. A plain file, a stream with no
    descriptor (nothing is routed then) and one on 1 or 2 are left as they are.
    """
    swapped = {}
    if method == "fork":
        for name, descriptor in (("stdout", 1), ("stderr", 2)):
            stream = getattr(sys, name)
            if _around_descriptor(stream, descriptor):
                stream.flush()
                swapped[name] = stream
                raw = io.BufferedWriter(io.FileIO(descriptor, "w", closefd=False))
                encoding = getattr(stream, "encoding", None) or "utf-8"
                setattr(sys, name, io.TextIOWrapper(raw, encoding, "backslashreplace", line_buffering=True))
    try:
        yield
    finally:
        for name, stream in swapped.items():
            getattr(sys, name).flush()
            setattr(sys, name, stream)


def _around_descriptor(stream: Any, descriptor: int) -> bool:
    """Whether ``stream`` claims a descriptor other than ``descriptor`` and is no plain file."""
    if stream is None or isinstance(stream, io.TextIOWrapper):
        return False
    try:
        return stream.fileno() != descriptor
    except (AttributeError, OSError, ValueError):
        return False


def show_hidden_output(
    error: BaseException, files: Any, shown: set[int], first_rank: int = 0, lines: int = 20
) -> None:
    """Print the last lines of a failed rank whose output the console did not show.

    ``files``: elastic's ``stdouts``/``stderrs`` by local rank (a run's result, or the agent's
    layout); ``shown``: the local ranks on the console; ``first_rank``: this node's first global rank.
    """
    rank = getattr(error, "autoddp_rank", getattr(error, "rank", None))
    if files is None or not isinstance(rank, int) or rank - first_rank in shown:
        return
    tail: list[str] = []
    for path in (files.stdouts.get(rank - first_rank), files.stderrs.get(rank - first_rank)):
        if path and os.path.isfile(path):
            with open(path, errors="replace") as handle:
                tail += handle.read().splitlines()[-lines:]
    if tail:
        console = ", ".join(str(first_rank + r) for r in sorted(shown))
        say(f"last lines of rank {rank}'s output (the console shows rank(s) {console}):")
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in tail[-lines:]))
        sys.stderr.flush()


def announce_exit(error: BaseException, world_size: int) -> None:
    """One line when the failure is a rank calling ``sys.exit``: Python prints nothing for it."""
    if isinstance(error, SystemExit):
        rank = getattr(error, "autoddp_rank", "?")
        say(f"rank {rank} of {world_size} called sys.exit({error.code!r}); exiting with it")
