"""``python -m autoddp.worker FOLDER``: the entry point of a fresh worker interpreter.

Kept apart from ``autoddp.worker.process`` so that running it with ``-m`` never finds the module
already imported by the package.
"""

from autoddp.worker.process import main

if __name__ == "__main__":
    main()
