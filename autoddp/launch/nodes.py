"""Several machines: parse the multi-node options and run this node's workers through elastic's agent.

Multi-node runs use torch.distributed.elastic's agent and rendezvous exactly as torchrun does:
``static`` when the address of node 0 and this node's rank are given (``--master HOST:PORT
--node-rank R``), ``c10d`` (torchrun's dynamic rendezvous) with ``--rdzv-endpoint``. The
rendezvous store has no authentication: run multi-node jobs on a trusted network only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from autoddp import hardware, network, transport
from autoddp._leftovers import private_folder
from autoddp.errors import WorkerError
from autoddp.hang import record as hang_record
from autoddp.hang.combine import Exchange
from autoddp.hang.watch import Watch
from autoddp.launch import diagnostics
from autoddp.launch.contract import DEFAULT_ROLE
from autoddp.launch.output import announce_exit, say
from autoddp.launch.plan import Nodes, split_endpoint
from autoddp.launch.side_gloo import side_gloo_variables
from autoddp.launch.supervise import caller_signal_handlers_kept, elastic_logs_quiet
from autoddp.running import Job


def run_agent(
    nodes: Nodes,
    nproc: int,
    args: list[str],
    *,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_dir: str | None = None,
    hang_report: float = hang_record.DEFAULT_SECONDS,
    role: str = DEFAULT_ROLE,
) -> None:
    """Run ``python ARGS`` in ``nproc`` workers on this node as part of a multi-node world.

    The workers reach the other machines through the interface that routes to node 0 (unless
    the user named one, see ``autoddp.network``); one start-up line says which. This node's
    ranks are watched for the hang report (node 0 combines every node's view when it can). Raises
    elastic's ``ChildFailedError`` when a worker fails and ``SignalException`` when this
    launcher is stopped; elastic has then stopped the local workers.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    host, port = split_endpoint(nodes.endpoint or "")
    net = network.choose(host, os.environ)
    rdzv_configs: dict[str, Any] = dict(nodes.conf)  # --rdzv-conf, as torchrun passes it
    if nodes.backend == "static":
        rdzv_configs["rank"] = nodes.node_rank
    route = net.route
    if nodes.backend == "c10d" and route is not None and route.owns_address:
        # This machine owns the endpoint's address; torch recognises it only by the host name.
        rdzv_configs["is_host"] = True
    # elastic keeps its error files in a folder of its own (a new one in /tmp when none is given,
    # never removed): one of autoddp's, which goes with the run (after a SIGKILL, at a later start)
    logs_folder = contextlib.nullcontext(log_dir) if log_dir else private_folder("autoddp-elastic-")
    with logs_folder as logs:
        config = LaunchConfig(
            min_nodes=nodes.min_nodes,
            max_nodes=nodes.max_nodes,
            nproc_per_node=nproc,
            run_id=nodes.run_id,
            rdzv_backend=nodes.backend,
            rdzv_endpoint=nodes.endpoint or "",
            rdzv_configs=rdzv_configs,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=log_dir or logs),
            # The address the other nodes' workers are given for this node (else its host name).
            local_addr=nodes.local_addr or (route.local_address if route and route.interface else None),
            role=role,  # the workers' ROLE_NAME (elastic's own default is "default_role")
        )
        say(_start_line(nodes, nproc, net))
        gpus = hardware.gpu_count()
        with hang_record.folder() as folder, diagnostics.node_traces(os.environ, nodes.run_id, gpus) as nccl:
            variables = {**net.variables, **nccl, **side_gloo_variables(os.environ, gpus)}
            if hang_report > 0:
                variables[hang_record.FOLDER_VARIABLE] = folder
            with (
                elastic_logs_quiet(),
                _worker_environment(nproc, variables),
                Watch(
                    folder, nproc, hang_report, node=_node_name(nodes), exchange=_exchange(nodes, host, port)
                ),
            ):
                elastic_launch(config, entrypoint=sys.executable)(*args)


def _exchange(nodes: Nodes, host: str, port: int) -> Exchange | None:
    """How this node's hang report reaches node 0's combined view (static rendezvous: its store)."""
    if nodes.backend != "static" or nodes.node_rank is None:
        return None
    return Exchange(host, port, nodes.run_id, nodes.node_rank, nodes.max_nodes)


def _node_name(nodes: Nodes) -> str:
    return f"node {nodes.node_rank} of {nodes.max_nodes}" if nodes.backend == "static" else "this node"


def _start_line(nodes: Nodes, nproc: int, net: network.Choice) -> str:
    where = _node_name(nodes)
    if nodes.backend == "c10d" and nodes.min_nodes != nodes.max_nodes:
        where += f" ({nodes.min_nodes} to {nodes.max_nodes} nodes)"
    return f"{where}, {nproc} worker(s) here, {nodes.backend} rendezvous at {nodes.endpoint}; {net.summary}"


@contextlib.contextmanager
def _worker_environment(nproc: int, variables: Mapping[str, str]) -> Iterator[None]:
    """``OMP_NUM_THREADS``, the network variables and the hang records' folder for the agent's
    workers while it runs.

    Elastic's agent gives its workers a copy of this process's environment, so they are set
    here for the agent's run only and removed afterwards.
    """
    threads = hardware.omp_threads(nproc)
    added = {**variables, **({"OMP_NUM_THREADS": threads} if threads is not None else {})}
    added = {name: value for name, value in added.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def describe_failure(error: Any, world_size: int) -> str:
    """One line naming the first failed rank of elastic's ``ChildFailedError``."""
    rank, failure = error.get_first_failure()
    code = failure.exitcode
    how = (
        f"was killed by {failure.signal_name()}"
        if code is not None and code < 0
        else f"exited with code {code}"
    )
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
    detail = f": {message.splitlines()[0]}" if message else ""
    return f"rank {rank} of {world_size} (pid {failure.pid}) {how}{detail}"


def launch_nodes(
    job: Job,
    *,
    plan: Nodes,
    nproc: int,
    max_restarts: int = 0,
    hang_report: float = hang_record.DEFAULT_SECONDS,
) -> Any:
    """This machine's share of a multi-node run of ``job`` (fresh interpreters, elastic's agent).

    Returns rank 0's result on the machine that runs rank 0, None on the others.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    payload = transport.dumps_job(job, job.fn, job.args, job.kwargs)
    with transport.run_folder() as folder:
        transport.save_job(folder, payload)
        try:
            with caller_signal_handlers_kept():
                run_agent(
                    plan,
                    nproc,
                    ["-m", "autoddp._worker_main", folder],
                    max_restarts=max_restarts,
                    hang_report=hang_report,
                )
        except ChildFailedError as error:
            reports = transport.load_errors(folder)
            if reports:
                report = min(reports.values(), key=lambda r: (r.is_consequence, r.time))
                lead = report.rebuild(nproc * plan.max_nodes)
                announce_exit(lead, nproc * plan.max_nodes)
                raise lead from None
            raise WorkerError(
                describe_failure(error, nproc * plan.max_nodes),
                rank=error.get_first_failure()[0],
                exitcode=None,
            ) from None
        except SignalException as error:
            say(f"{error.sigval.name} received: stopped all workers on this node")
            if error.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            signal.raise_signal(error.sigval)
            raise
        return transport.load_result(folder)
