"""``python -m autoddp._worker_main FOLDER``: the entry point of a fresh worker interpreter.

Kept apart from ``autoddp._worker`` so that running it with ``-m`` never finds the module
already imported by the package.
"""

from autoddp._worker import main

if __name__ == "__main__":
    main()
