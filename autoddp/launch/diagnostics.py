"""NCCL's own diagnostics for the workers of a GPU run, and the flight-recorder dumps they leave.

torchrun gives its workers ``TORCH_NCCL_ASYNC_ERROR_HANDLING``; autoddp gives them NCCL's error
handling too, plus torch's flight recorder: the last collectives of every rank, written to a file
per rank when a collective times out, for ``torchfrtrace`` to say which rank stopped where. The
launcher sets them in its workers' environment; a value the user set (under any name torch reads
it by) is kept. Runs without GPUs get none of them (gloo records into the flight recorder too,
at a cost per collective, and never dumps it).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping

from autoddp.core._warn import say

#: The dump of rank R is ``<folder>/nccl_trace_rank_R`` (``torchfrtrace FOLDER -p nccl_trace_rank_``).
TRACE_PREFIX = "nccl_trace_rank_"
#: Collectives each rank's flight recorder keeps (torchtitan's and torch's tests use 2000 to 20000).
TRACE_ENTRIES = "2000"


def nccl_variables(environ: Mapping[str, str], trace_folder: str, gpus: int) -> dict[str, str]:
    """The variables a GPU run's workers get (none without GPUs), less those the user set.

    Each setting is listed with every name torch 2.13 reads it by, the current name first.
    Error handling is 3 (tear the process down on a NCCL error or timeout, without aborting the
    communicator first): torch's own default, where torchrun's 1 aborts before the flight
    recorder has written its dump (pytorch/pytorch#121055). ``TORCH_NCCL_DESYNC_DEBUG`` is not
    set: it times every collective with CUDA events (``TORCH_NCCL_ENABLE_TIMING``).
    """
    if gpus <= 0:
        return {}
    dump = os.path.join(trace_folder, TRACE_PREFIX)
    settings = [
        (("TORCH_NCCL_ASYNC_ERROR_HANDLING",), "3"),
        (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
        (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), TRACE_ENTRIES),
        (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), dump),
    ]
    return {names[0]: value for names, value in settings if not any(name in environ for name in names)}


def keep_traces(run_folder: str, keep_in: str | os.PathLike | None = None) -> str | None:
    """Move the ranks' dumps out of ``run_folder`` (removed after the run); where they went, or None.

    They go to ``keep_in`` (the run's ``log_dir``) if given, else to a new folder of their own.
    """
    dumps = sorted(glob.glob(os.path.join(run_folder, f"{TRACE_PREFIX}*")))
    if not dumps:
        return None
    target = os.fspath(keep_in) if keep_in is not None else tempfile.mkdtemp(prefix="autoddp-nccl-trace-")
    os.makedirs(target, exist_ok=True)
    for dump in dumps:
        shutil.move(dump, os.path.join(target, os.path.basename(dump)))
    return target


def traces_line(folder: str) -> str:
    """The line that says where the dumps are and how to read them."""
    return (
        f"NCCL's flight recorder wrote the ranks' last collectives to {folder}; "
        f"`torchfrtrace {folder} -p {TRACE_PREFIX}` says which rank stopped where"
    )


@contextlib.contextmanager
def node_traces(environ: Mapping[str, str], run_id: str, gpus: int) -> Iterator[dict[str, str]]:
    """The variables for the workers of a multi-node agent, dumping into a folder of this run.

    The folder (in the temporary directory, named for the run) is removed at the end if no rank
    dumped into it; else one line says where the dumps are.
    """
    folder = os.path.join(tempfile.gettempdir(), f"autoddp-nccl-trace-{run_id}")
    variables = nccl_variables(environ, folder, gpus)
    if not variables.get("TORCH_FR_DUMP_TEMP_FILE"):
        yield variables
        return
    os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        yield variables
    finally:
        if glob.glob(os.path.join(folder, f"{TRACE_PREFIX}*")):
            say(traces_line(folder))
        else:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
