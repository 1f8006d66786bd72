"""What runs inside one rank of a world, as a worker or in place: the worker, the run folder it
shares with the caller, the world, capture, models, data, checkpoints, ``rank0()`` blocks, the
rank's half of the hang report, ``prepare`` (``_prepare``) and ``print`` (``console``). Never
imports ``launch/``."""
