"""The environment variables autoddp's launchers give their workers: each name has its home here.

torchrun's own variables (``RANK``, ``MASTER_ADDR``, ...) are ``launch.contract``'s; these are
autoddp's additions, read by the workers and by the environment detection.
"""

from __future__ import annotations

#: Marks a worker autoddp started (with ``RANK``/``WORLD_SIZE``): the environment detection's first case.
RUN_ID = "AUTODDP_RUN_ID"
#: The launcher's pid: a worker ends itself when its parent is gone.
PARENT_PID = "AUTODDP_PARENT_PID"
#: The run folder: where a worker reports its error, its result and that its code finished.
RUN_FOLDER = "AUTODDP_RUN_FOLDER"
#: "1" where the launcher prefixes each output line with the rank, "0" where it does not.
LINE_PREFIX = "AUTODDP_LINE_PREFIX"
#: The hang report's records (set only where a launcher watches its workers).
HANG_FOLDER = "AUTODDP_HANG_FOLDER"
#: "1" where the launcher asks its workers for the step report (``in_rank.step_report``).
STEP_REPORT = "AUTODDP_STEP_REPORT"
#: strategy="auto" after a restart for memory: the plan to start from (``core.memory.budget.LADDER``).
PLAN_FLOOR = "AUTODDP_PLAN_FLOOR"
#: Seconds a rank that finished the user's code may take to end before it is named and stopped.
EXIT_SECONDS = "AUTODDP_EXIT_SECONDS"
