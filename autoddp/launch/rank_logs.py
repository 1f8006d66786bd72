"""Where each rank's output files go: elastic's layout, each rank's folder named by its global rank.

Elastic names a worker's folder by its local rank (``<log_dir>/<run>/attempt_0/0/stdout.log``
on every machine), so the files of two nodes that share one log folder cannot be told apart.
Here the folder is named by the worker's global rank (``RANK``): on one machine that is the same
number, on several ``attempt_0/2/`` is rank 2's wherever it ran.
"""

from __future__ import annotations

import os
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import LogsDest


class RankLogs(DefaultLogsSpecs):
    """``DefaultLogsSpecs`` whose per-rank folders are named by global rank; keeps the last layout
    it made (``dest``) so that a failed rank's files can be read afterwards."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dest: LogsDest | None = None

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        # Highest local rank first: on a node whose first global rank is above 0 no new name is taken.
        for local in sorted(envs, reverse=True):
            error_file = dest.error_files.get(local, "")
            rank = envs[local].get("RANK", str(local))
            if rank == str(local) or not error_file or error_file == os.devnull:
                continue
            old = os.path.dirname(error_file)
            new = os.path.join(os.path.dirname(old), rank)
            os.rename(old, new)
            for paths in (dest.stdouts, dest.stderrs, dest.tee_stdouts, dest.tee_stderrs, dest.error_files):
                if paths.get(local, "").startswith(old + os.sep):
                    paths[local] = new + paths[local][len(old) :]
            envs[local]["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local]
        self.dest = dest
        return dest
