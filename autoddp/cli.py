"""The ``autoddp`` command: run a script once per device, config-free, with torchrun's flags."""

from __future__ import annotations

import json
import os
import sys

import click

from autoddp import environment
from autoddp.command import arguments, runs
from autoddp.command.arguments import fail
from autoddp.errors import ConfigurationError
from autoddp.hang import record as hang_record
from autoddp.launch import output as launch_output
from autoddp.launch import plan as launch_plan
from autoddp.launch.contract import DEFAULT_ROLE

_CONTEXT = {
    "help_option_names": ["-h", "--help"],
    "ignore_unknown_options": True,
    "allow_interspersed_args": False,
}


@click.command(cls=arguments.OneLineCommand, context_settings=_CONTEXT)
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
    "--start-method",
    "--start_method",
    "start_method",
    default=None,
    metavar="fork|spawn",
    help="How workers start on one machine (several: fresh interpreters).  [default: fork where safe]",
)
@click.option("--role", default=DEFAULT_ROLE, show_default=True, help="The workers' ROLE_NAME.")
@click.option(
    "--standalone",
    is_flag=True,
    help="Accepted for torchrun compatibility.  [default: always standalone on a single node]",
)
@click.option("--run-path", "--run_path", "run_path", is_flag=True, help="Accepted: scripts run with runpy.")
@click.option("-q", "--quiet", is_flag=True, help="No start-up line from autoddp (how many processes, why).")
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
@click.option("--master", default=None, metavar="HOST:PORT", help="Node 0's address, where the store is.")
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
    help="torchrun's spelling of --master's PORT.  [default: one machine: a free port; several: 29500]",
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
    metavar="static|c10d",
    help="Rendezvous backend.  [default: static with --master, c10d with --rdzv-endpoint]",
)
@click.option(
    "--rdzv-id", "--rdzv_id", "rdzv_id", default=None, help="Job id shared by all nodes.  [default: autoddp]"
)
@click.option(
    "--rdzv-conf",
    "--rdzv_conf",
    "rdzv_conf",
    default=None,
    metavar="KEY=VALUE,...",
    help="Several machines: the rendezvous's settings, e.g. join_timeout=600.",
)
@click.option(
    "--local-addr",
    "--local_addr",
    "local_addr",
    default=None,
    help="Several machines: the address the others reach this one by.  [default: the route to node 0]",
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
    start_method: str | None,
    role: str,
    standalone: bool,
    run_path: bool,
    quiet: bool,
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
    rdzv_conf: str | None,
    local_addr: str | None,
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
    gets every variable torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT, ...) with torchrun's values; ARGS reach
    the script untouched. Functions decorated with @autoddp.distributed run in place in each
    process. A failing process stops all of them and the command exits non-zero with that
    process's traceback. torchrun's flags work as in torchrun, or stop with one line saying
    what autoddp does instead.

    `autoddp env` prints a report to paste into a bug report: versions, GPUs, the detected
    launcher and why, and what the decorator and this command would do here.
    """
    given = (master, master_addr, master_port)  # one machine: where its store listens
    if master is None and master_addr is not None:
        master = f"{master_addr}:{master_port or 29500}"
    if script == "env" and not as_module and not os.path.exists("env"):
        from autoddp import report

        try:
            asked = arguments.process_count(nproc) if nproc else None
            click.echo(report.for_command(master or rdzv_endpoint, script_args, asked))
        except ConfigurationError as error:
            fail(str(error))
        return
    arguments.choice("--rdzv-backend", rdzv_backend, launch_plan.RDZV_BACKENDS)
    arguments.choice("--start-method", start_method, ("fork", "spawn"))
    arguments.check_target(script, as_module, [o for p in main.params for o in p.opts + p.secondary_opts])
    count = arguments.process_count(nproc)
    try:
        plan = launch_plan.plan(
            nnodes, node_rank, master, rdzv_endpoint, rdzv_backend, rdzv_id, rdzv_conf, local_addr
        )
        store = launch_plan.one_node_store(*given)
    except ConfigurationError as error:
        fail(str(error))
    if strategy != "fsdp" and (fsdp_blocks or mixed_precision or cpu_offload):
        fail("--fsdp-blocks, --mixed-precision and --cpu-offload are FSDP's options: add --strategy fsdp")
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
        sys.exit(runs.run_nodes(plan, count, argv, max_restarts, monitor_interval, hang_report, role))
    try:
        output = launch_output.Output(ranks, log_dir)
        output.shown(count)
    except ConfigurationError as error:
        fail(str(error))
    line = arguments.process_line(nproc, count, script_args)
    if line and not quiet and not environment.detect().launched:
        click.echo(line, err=True)
    settings = {"start_method": start_method or "auto", "role": role, "store": store}
    sys.exit(runs.run_here(count, argv, max_restarts, monitor_interval, output, hang_report, **settings))


if __name__ == "__main__":
    main()
