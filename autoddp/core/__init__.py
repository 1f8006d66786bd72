"""What knows no run: the run's state, errors, the backend choice (``backends``), the ``AUTODDP_*``
variables, the patch engine, whose frame is the user's (``_frames``), the house's voice
(``_warn``), containers, leftovers, the class swap, the torch compatibility layer (``_compat/``)
and where this process is (``environment/``). Imports nothing from ``launch/`` or ``in_rank/``."""
