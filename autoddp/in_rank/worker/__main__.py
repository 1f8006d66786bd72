"""``python -m autoddp.in_rank.worker FOLDER``: the entry point of a fresh worker interpreter.

Kept apart from ``autoddp.in_rank.worker.process`` so that running it with ``-m`` never finds the module
already imported by the package.
"""

from autoddp.in_rank.worker.process import main

if __name__ == "__main__":
    main()
