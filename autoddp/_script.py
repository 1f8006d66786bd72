"""``python -m autoddp._script (PATH | --module NAME) ARGS...``: run a user script in a worker.

Runs the script as ``python PATH ARGS`` / ``python -m NAME ARGS`` would (``sys.argv``,
``sys.path[0]``, ``__name__ == "__main__"``). A failure is written to torch.distributed.elastic's
error file, so the ``autoddp`` command can name the failing rank without the user adding
``@record``, and its traceback is printed without this runner's own frames. After a script
that ends well, the process groups it left open are destroyed at exit, after the script's own
atexit hooks (``process_group.leave_open_groups``): an open gloo group can abort the exit.
"""

from __future__ import annotations

import atexit
import gc
import os
import runpy
import sys
import types

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from autoddp import _worker, process_group, transport


def _run(argv: list[str]) -> None:
    if argv[0] == "--module":
        name, rest = argv[1], argv[2:]
        sys.argv = [name, *rest]
        sys.path[0] = os.getcwd()
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        path, rest = argv[0], argv[1:]
        sys.argv = [path, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(path))
        runpy.run_path(path, run_name="__main__")


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop the leading frames of this runner and runpy, keeping the user's own."""
    runner_files = (__file__, runpy.__file__)
    while tb is not None and (
        tb.tb_frame.f_code.co_filename in runner_files
        or tb.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        tb = tb.tb_next
    return tb


def main() -> None:
    _worker.die_with_parent()
    # Registered before the script runs, so it runs after the script's own atexit hooks.
    atexit.register(_leave_cleanly)
    try:
        _run(sys.argv[1:])
    except SystemExit as stop:
        _ended(well=stop.code in (None, 0))
        raise
    except KeyboardInterrupt:  # the launcher passes Ctrl-C on and reports it once, for everyone
        sys.exit(128 + 2)
    except BaseException as exc:
        ErrorHandler().record_exception(exc)
        folder = os.environ.get("AUTODDP_RUN_FOLDER")
        if folder:
            transport.save_error(folder, int(os.environ.get("RANK", "0")), exc)
        exc.__traceback__ = _user_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)
    _ended(well=True)


#: Whether the script ended well (after an error the group is left alone: others may still use it).
_ENDED_WELL = [False]


def _ended(well: bool) -> None:
    """Note how the script ended; after a good end, collect its garbage first thing at exit.

    Registered now, the collection runs before the script's own atexit hooks (last registered,
    first run): a DDP kept alive only by a reference cycle is gone before a hook of the script
    destroys the group itself (freeing a DDP after its group can abort or deadlock gloo).
    """
    _ENDED_WELL[0] = well
    if well:
        atexit.register(gc.collect)


def _leave_cleanly() -> None:
    """At exit, after a script that ended well: end the process groups it left open.

    An open gloo group can abort the interpreter's exit; the script's own atexit hooks have
    run by now, with the group still there.
    """
    if not _ENDED_WELL[0]:
        return
    try:
        process_group.leave_open_groups()
    except Exception as error:  # the script succeeded: say so, do not turn it into a failure
        print(f"autoddp: could not end the process group the script left open: {error}", file=sys.stderr)


if __name__ == "__main__":
    main()
