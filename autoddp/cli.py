"""The ``autoddp`` command: run a script once per device, config-free, with torchrun's flags."""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid

import click

from autoddp import environment, launch, transport

_CONTEXT = {
    "help_option_names": ["-h", "--help"],
    "ignore_unknown_options": True,
    "allow_interspersed_args": False,
}


def _fail(message: str, code: int = 2) -> None:
    """One line on stderr naming the problem and the fix, then exit (2: usage error)."""
    click.echo(f"autoddp: error: {message}", err=True)
    sys.exit(code)


def _process_count(value: str | None) -> int:
    gpus = environment.gpu_count()
    if value is None or value in ("auto", "gpu"):
        if value == "gpu" and gpus == 0:
            _fail("--nproc-per-node=gpu but no GPU is visible; give a number, e.g. -n 2")
        return gpus or 1
    if value == "cpu":
        return 1
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        _fail(f"--nproc-per-node={value!r} is not a positive whole number (or 'auto', 'gpu', 'cpu')")
    if gpus and count > gpus:
        _fail(f"--nproc-per-node={count} but only {gpus} GPU(s) are visible; use at most {gpus}")
    return count


def _check_target(target: str | None, as_module: bool) -> None:
    if target is None:
        _fail("no script given: autoddp [OPTIONS] script.py [ARGS]... (see autoddp --help)")
    if as_module:
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            _fail(f"no module named {target!r} importable from {os.getcwd()}; check the name and folder")
    elif not os.path.exists(target):
        _fail(f"no such script: {target!r} (looked in {os.getcwd()})")
    elif os.path.isdir(target) and not os.path.exists(os.path.join(target, "__main__.py")):
        _fail(f"{target!r} is a folder without __main__.py; give the script to run inside it")


@click.command(context_settings=_CONTEXT)
@click.option(
    "-n",
    "--nproc-per-node",
    "--nproc_per_node",
    "--nproc",
    "nproc",
    metavar="N",
    default=None,
    help="Processes on this node: a number, 'gpu', 'cpu' or 'auto'.  "
    "[default: one per visible GPU, 1 without GPUs]",
)
@click.option(
    "-m",
    "--module",
    "as_module",
    is_flag=True,
    help="Run SCRIPT as a module name, like python -m.  [default: off]",
)
@click.option(
    "--max-restarts",
    "--max_restarts",
    "max_restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Restart all workers this many times after a failure.",
)
@click.option(
    "--monitor-interval",
    "--monitor_interval",
    "monitor_interval",
    type=click.FloatRange(min=0.01),
    default=0.1,
    show_default=True,
    help="Seconds between checks of the workers' health.",
)
@click.option(
    "--standalone",
    is_flag=True,
    help="Accepted for torchrun compatibility.  [default: always standalone on a single node]",
)
@click.argument("script", required=False, metavar="SCRIPT")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
@click.version_option(package_name="autoddp", prog_name="autoddp")
def main(
    nproc: str | None,
    as_module: bool,
    max_restarts: int,
    monitor_interval: float,
    standalone: bool,
    script: str | None,
    script_args: tuple[str, ...],
) -> None:
    """Run SCRIPT once per device, each process ready for torch.distributed.

    Every process gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and a free
    MASTER_PORT as torchrun sets them; ARGS reach the script untouched. Functions decorated
    with @autoddp.distributed run in place in each process. A failing process stops all of
    them and the command exits non-zero with that process's traceback.
    """
    _check_target(script, as_module)
    count = _process_count(nproc)
    sys.exit(_launch(count, as_module, script, list(script_args), max_restarts, monitor_interval))


def _launch(
    nproc: int, as_module: bool, script: str, args: list[str], max_restarts: int, monitor_interval: float
) -> int:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_id = uuid.uuid4().hex
    # The command's own process: these variables reach the workers through elastic's agent.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, environment.cpu_count() // nproc)))
    os.environ["AUTODDP_RUN_ID"] = run_id
    os.environ["AUTODDP_PARENT_PID"] = str(os.getpid())
    entry_args = ["-m", "autoddp._script", *(["--module"] if as_module else []), script, *args]
    # The rendezvous store listens on loopback only: elastic's c10d backend opens its store on
    # this port in this process and so shares this loopback-bound server.
    with transport.run_folder() as folder, launch.loopback_store(nproc) as port:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nproc,
            run_id=run_id,
            rdzv_backend="c10d",
            rdzv_endpoint=f"{environment.LOOPBACK}:{port}",
            rdzv_configs={"is_host": True},
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method="spawn",
            local_addr=environment.LOOPBACK,
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(folder, "logs")),
        )
        try:
            with launch.elastic_logs_quiet():
                elastic_launch(config, entrypoint=sys.executable)(*entry_args)
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            click.echo(_failure_line(rank, failure, nproc), err=True)
            return 1
        except SignalException as exc:  # Ctrl-C or SIGTERM: elastic has stopped every worker
            click.echo(f"autoddp: {exc.sigval.name} received: stopped all {nproc} workers", err=True)
            return 128 + int(exc.sigval)
    return 0


def _failure_line(rank: int, failure, world_size: int) -> str:
    code = failure.exitcode
    if code is not None and code < 0:
        how = f"was killed by {failure.signal_name()}"
    else:
        how = f"exited with code {code}"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
    detail = f": {message.splitlines()[0]}" if message else ""
    return f"autoddp: rank {rank} of {world_size} (pid {failure.pid}) {how}{detail}; its traceback is above"


if __name__ == "__main__":
    main()
