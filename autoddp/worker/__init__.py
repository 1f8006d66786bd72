"""A worker: one process of a run, from its start to its result.

Its plumbing, which the in-a-world code also uses: ``streams`` (each rank's random streams),
``placement`` (which GPU is this process's), ``process_group`` (the backend, joining and leaving
the group), ``transport`` (what travels between processes and the run folder) and ``finished``
(which ranks' code ran to its end). Its call path, above everything it runs: ``running`` (the one
call path, in place or in a worker), ``process`` (a worker process set up around it), ``script``
(a plain script run as ``python script.py`` would) and ``__main__`` (``python -m autoddp.worker``,
a fresh worker interpreter). Import the module you need: this package imports nothing.
"""
