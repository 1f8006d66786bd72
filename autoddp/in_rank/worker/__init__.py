"""A worker: one process of a run, from its start to its result; the call path alone.

``running`` (the one call path, in place or in a worker), ``process`` (a worker process set up
around it), ``script`` (a plain script run as ``python script.py`` would) and ``__main__``
(``python -m autoddp.in_rank.worker``, a fresh worker interpreter). The plumbing they share with
the in-a-world code lives in ``in_rank.world`` and ``in_rank.run_folder``. Import the module you
need: this package imports nothing.
"""
