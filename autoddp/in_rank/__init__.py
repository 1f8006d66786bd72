"""What runs inside one rank of a world, as a worker or in place: the worker, the world, capture,
models, data, checkpoints, ``rank0()`` blocks, the rank's half of the hang report. Never imports
``launch/``."""
