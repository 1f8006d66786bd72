"""The ``autoddp`` command: run a script once per device, config-free, with torchrun's flags."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import signal
import sys

import click

from autoddp import environment, hardware
from autoddp.errors import ConfigurationError, WorkerError
from autoddp.hang import record as hang_record
from autoddp.launch import in_place, local, nodes
from autoddp.launch import output as launch_output
from autoddp.launch import plan as launch_plan

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
    gpus = hardware.gpu_count()
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
    if target.startswith("-") and not os.path.exists(target):
        known = [opt for param in main.params for opt in param.opts + param.secondary_opts]
        close = difflib.get_close_matches(target.split("=", 1)[0], known, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        _fail(
            f"unknown option {target!r}{hint} (autoddp's options come before the script; see autoddp --help)"
        )
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
    default=0.05,
    show_default=True,
    help="Seconds between checks of the workers' health.",
)
@click.option(
    "--standalone",
    is_flag=True,
    help="Accepted for torchrun compatibility.  [default: always standalone on a single node]",
)
@click.option(
    "--ranks",
    "--local-ranks-filter",
    "--local_ranks_filter",
    "ranks",
    default="0",
    show_default=True,
    help="Whose output reaches the console: 0, all (lines prefixed [rank N]) or local ranks like 0,1.",
)
@click.option(
    "--log-dir",
    "--log_dir",
    "log_dir",
    default=None,
    help="Keep every rank's stdout/stderr in files under this folder.  [default: a private temporary folder]",
)
@click.option("--nnodes", default=None, metavar="N|MIN:MAX", help="Machines taking part.  [default: 1]")
@click.option(
    "--node-rank",
    "--node_rank",
    "node_rank",
    type=click.IntRange(min=0),
    default=None,
    help="This machine's rank, 0 to nnodes-1 (static rendezvous).  [default: 0]",
)
@click.option("--master", default=None, metavar="HOST:PORT", help="Node 0's address for multi-node runs.")
@click.option(
    "--master-addr",
    "--master_addr",
    "master_addr",
    default=None,
    help="torchrun's spelling of --master's HOST.",
)
@click.option(
    "--master-port",
    "--master_port",
    "master_port",
    type=click.IntRange(1, 65535),
    default=None,
    help="torchrun's spelling of --master's PORT.  [default: 29500 with --master-addr]",
)
@click.option(
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "rdzv_endpoint",
    default=None,
    metavar="HOST:PORT",
    help="Rendezvous endpoint (c10d, elastic node counts).",
)
@click.option(
    "--rdzv-backend",
    "--rdzv_backend",
    "rdzv_backend",
    default=None,
    type=click.Choice(["static", "c10d"]),
    help="Rendezvous backend.  [default: static with --master, c10d with --rdzv-endpoint]",
)
@click.option(
    "--rdzv-id", "--rdzv_id", "rdzv_id", default=None, help="Job id shared by all nodes.  [default: autoddp]"
)
@click.option(
    "--strategy",
    type=click.Choice(["ddp", "fsdp"]),
    default="ddp",
    show_default=True,
    help="How models are distributed: replicated (DDP) or sharded (FSDP2).",
)
@click.option(
    "--fsdp-blocks",
    default=None,
    metavar="CLASS,...",
    help="FSDP: module classes that get their own shard unit.  [default: autoddp chooses]",
)
@click.option(
    "--mixed-precision",
    type=click.Choice(["bf16", "fp16"]),
    default=None,
    help="FSDP: compute in this dtype, reduce gradients in float32.  [default: off]",
)
@click.option("--cpu-offload", is_flag=True, help="FSDP: keep parameter shards on the CPU.  [default: off]")
@click.option(
    "--find-unused-parameters",
    is_flag=True,
    help="DDP: allow parameters that get no gradient in a step (slower).  [default: off]",
)
@click.option(
    "--capture/--no-capture",
    default=True,
    show_default=True,
    help="Distribute the models, shuffled loaders and torch.save calls a plain script makes.",
)
@click.option(
    "--hang-report",
    "--hang_report",
    "hang_report",
    type=click.FloatRange(min=0),
    default=hang_record.DEFAULT_SECONDS,
    show_default=True,
    metavar="SECONDS",
    help="When ranks have waited this long in a collective for others, say which rank is late and "
    "where (its stack); the run goes on. 0 turns it off.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="SECONDS",
    help="How long a collective may wait before the run fails (the process group autoddp makes for "
    "a plain script; @distributed(timeout=) for a function).  [default: 10 minutes on GPUs, 30 on CPU]",
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
    ranks: str,
    log_dir: str | None,
    nnodes: str | None,
    node_rank: int | None,
    master: str | None,
    master_addr: str | None,
    master_port: int | None,
    rdzv_endpoint: str | None,
    rdzv_backend: str | None,
    rdzv_id: str | None,
    strategy: str,
    fsdp_blocks: str | None,
    mixed_precision: str | None,
    cpu_offload: bool,
    find_unused_parameters: bool,
    capture: bool,
    hang_report: float,
    timeout: float | None,
    script: str | None,
    script_args: tuple[str, ...],
) -> None:
    """Run SCRIPT once per device, each process ready for torch.distributed.

    An unmodified single-GPU script becomes distributed: the model its optimizer trains is
    wrapped in DDP, its shuffled DataLoaders are sharded (ordered ones, for evaluation, stay
    whole) and torch.save to a path is written once, by rank 0 (--no-capture turns this off).
    A torchrun-style script that sets up torch.distributed itself is left alone: every process
    gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT as
    torchrun sets them; ARGS reach the script untouched. Functions decorated with
    @autoddp.distributed run in place in each process. A failing process stops all of them and
    the command exits non-zero with that process's traceback.

    `autoddp env` prints a report to paste into a bug report: versions, GPUs, the detected
    launcher and why, and what autoddp would do here.
    """
    if master is None and master_addr is not None:
        master = f"{master_addr}:{master_port or 29500}"
    if script == "env" and not as_module and not os.path.exists("env"):
        from autoddp import report

        try:
            click.echo(report.for_command(master or rdzv_endpoint, script_args))
        except ConfigurationError as error:
            _fail(str(error))
        return
    _check_target(script, as_module)
    count = _process_count(nproc)
    try:
        plan = launch_plan.plan(nnodes, node_rank, master, rdzv_endpoint, rdzv_backend, rdzv_id)
    except ConfigurationError as error:
        _fail(str(error))
    if strategy != "fsdp" and (fsdp_blocks or mixed_precision or cpu_offload):
        _fail("--fsdp-blocks, --mixed-precision and --cpu-offload are FSDP's options: add --strategy fsdp")
    run_options = {
        "strategy": strategy,
        "fsdp_blocks": [b.strip() for b in (fsdp_blocks or "").split(",") if b.strip()],
        "mixed_precision": mixed_precision,
        "cpu_offload": cpu_offload,
        "ddp_kwargs": {"find_unused_parameters": True} if find_unused_parameters else {},
    }
    argv = [
        *([] if capture else ["--no-capture"]),
        *(["--run-options", json.dumps(run_options)] if strategy != "ddp" or find_unused_parameters else []),
        *(["--timeout", repr(timeout)] if timeout is not None else []),
        *(["--module"] if as_module else []),
        script,
        *script_args,
    ]
    if plan.multi:
        sys.exit(_launch_nodes(plan, count, argv, max_restarts, monitor_interval, hang_report))
    try:
        output = launch_output.Output(ranks, log_dir)
        output.shown(count)
    except ConfigurationError as error:
        _fail(str(error))
    sys.exit(_launch(count, argv, max_restarts, monitor_interval, output, hang_report))


def _launch_nodes(
    plan: launch_plan.Nodes,
    nproc: int,
    argv: list[str],
    max_restarts: int,
    monitor_interval: float,
    hang_report: float = hang_record.DEFAULT_SECONDS,
) -> int:
    """This machine's share of a multi-node run, through elastic's agent and rendezvous."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        nodes.run_agent(
            plan,
            nproc,
            ["-m", "autoddp._script", *argv],
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            hang_report=hang_report,
        )
    except ConfigurationError as error:  # before anything started: node 0's address, say
        _fail(str(error))
    except ChildFailedError as error:
        click.echo(
            f"autoddp: {nodes.describe_failure(error, nproc * plan.max_nodes)}; its traceback is above",
            err=True,
        )
        return 1
    except SignalException as error:
        click.echo(f"autoddp: {error.sigval.name} received: stopped all workers on this node", err=True)
        return 128 + int(error.sigval)
    return 0


def _launch(
    nproc: int,
    argv: list[str],
    max_restarts: int,
    monitor_interval: float,
    output: launch_output.Output,
    hang_report: float = hang_record.DEFAULT_SECONDS,
) -> int:
    """Run the script once per process on this machine; the exit status of the command."""
    env = environment.detect()
    if env.launched:
        # Already one process of a distributed run (srun, mpirun, torchrun): no second layer.
        try:
            in_place.exec_script(argv, env.world())
        except ConfigurationError as error:
            _fail(str(error))
    try:
        local.launch_script(
            argv,
            nproc=nproc,
            max_restarts=max_restarts,
            poll_seconds=monitor_interval,
            output=output,
            hang_report=hang_report,
        )
    except KeyboardInterrupt:  # Ctrl-C: the workers are stopped and one line was printed
        return 128 + int(signal.SIGINT)
    except SystemExit as error:  # a rank called sys.exit(code): the launcher said so in one line
        return error.code if isinstance(error.code, int) else 1
    except WorkerError as error:  # died without a Python exception: there is no traceback to point at
        click.echo(f"autoddp: {error}", err=True)
        for note in getattr(error, "__notes__", ()):  # e.g. the late rank a rank aborted waiting for
            if note.startswith("autoddp:"):
                click.echo(note, err=True)
        return 1
    except Exception as error:  # a worker failed: it printed its own traceback
        click.echo(f"autoddp: {launch_output.one_line(error)} (its traceback is above)", err=True)
        for note in getattr(error, "__notes__", ()):  # what autoddp found out about it
            if note.startswith("autoddp:"):
                click.echo(note, err=True)
        return 1
    return 0


if __name__ == "__main__":
    main()
