"""Counting the instructions a block of code runs, with valgrind's callgrind: a cost that the
machine's load does not change (``step_parts.py --clock instructions``).

The benchmark runs itself again under callgrind with instrumentation off (``rerun``), so that
starting Python, importing torch and launching the workers run at valgrind's uninstrumented
speed. Each worker switches instrumentation on once (``callgrind_control -i on``), then counts
block by block (``Counter.block``: collection on, then a dump per block). Only the thread that
runs the steps is read: DDP's all-reduce runs in gloo's threads, whose polling depends on how long
the other rank takes, and which the steps' own cost does not include (as the ``cpu`` clock).
torch does the same in ``torch.utils.benchmark``'s ``collect_callgrind``. Blocks of 32 steps
(``--steps 32``) hold one pass over the data each, so that each starts one epoch's iterator.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch

#: Where the counts go; set by ``rerun`` for the processes under valgrind.
FOLDER = "STEP_PARTS_CALLGRIND"


def under_valgrind() -> bool:
    return FOLDER in os.environ and "vgpreload" in os.environ.get("LD_PRELOAD", "")


def rerun(argv: list[str]) -> int:
    """This command again under callgrind, instrumentation off until a worker switches it on."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("--clock instructions needs valgrind (apt install valgrind)", file=sys.stderr)
        return 2
    folder = tempfile.mkdtemp(prefix="step-parts-callgrind-")
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        "--separate-threads=yes",
        "--trace-children=yes",
        "--trace-children-skip=*callgrind_control*,*perl*",
        f"--callgrind-out-file={folder}/cg.%p",
        "--log-file=" + os.path.join(folder, "valgrind.%p.log"),
        sys.executable,
        *argv,
    ]
    try:
        return subprocess.run(command, env={**os.environ, FOLDER: folder}).returncode
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class Counter:
    """This process's blocks, counted in order (``block``), read back once they are all done."""

    def __init__(self) -> None:
        self.folder = os.environ[FOLDER]
        self.blocks = 0
        pid = str(os.getpid())
        subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)

    @contextlib.contextmanager
    def block(self) -> Iterator[None]:
        """Count the block; Python's garbage collector off (a collection would land in one block)."""
        gc.collect()
        gc.disable()
        torch._C._valgrind_toggle()
        try:
            yield
        finally:
            torch._C._valgrind_toggle_and_dump_stats()
            gc.enable()
            self.blocks += 1

    def read(self) -> list[int]:
        """Each block's instructions on the main thread, in the order counted."""
        found: dict[int, int] = {}
        for path in glob.glob(os.path.join(self.folder, f"cg.{os.getpid()}.*-01")):
            number = int(re.search(r"\.(\d+)-01$", path).group(1))
            with open(path) as dump:
                totals = next(line for line in dump if line.startswith("totals:"))
            found[number] = int(totals.split()[1])
        numbers = sorted(found)[-self.blocks :]
        if len(numbers) != self.blocks:
            found_ = f"callgrind wrote {len(numbers)} counts for {self.blocks} blocks"
            raise RuntimeError(f"{found_}: {self.folder}")
        return [found[n] for n in numbers]
