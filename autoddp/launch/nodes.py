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

from autoddp.core import _variables
from autoddp.core._leftovers import private_folder
from autoddp.core._warn import one_line, say
from autoddp.core.environment import hardware, network
from autoddp.core.errors import NodesError, WorkerError
from autoddp.in_rank.hang import record as hang_record
from autoddp.in_rank.run_folder import transport
from autoddp.in_rank.worker.running import Job
from autoddp.launch import diagnostics, failures, meeting
from autoddp.launch.contract import DEFAULT_ROLE, GROUP_BARRIER
from autoddp.launch.hang.combine import Exchange
from autoddp.launch.hang.watch import Watch
from autoddp.launch.output import Output, announce_exit, show_hidden_output
from autoddp.launch.plan import Nodes, split_endpoint
from autoddp.launch.request import Request, Script
from autoddp.launch.side_gloo import side_gloo_variables
from autoddp.launch.supervise import (
    Stopped,
    acting_on_signals,
    caller_signal_handlers_kept,
    elastic_logs_quiet,
)


def run_agent(
    nodes: Nodes,
    nproc: int,
    args: list[str],
    *,
    folder: str,
    output: Output | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    hang_report: float = hang_record.DEFAULT_SECONDS,
    role: str = DEFAULT_ROLE,
) -> None:
    """Run ``python ARGS`` in ``nproc`` workers on this node as part of a multi-node world.

    The workers reach the other machines through the interface that routes to node 0 (unless
    the user named one, see ``core.environment.network``); one start-up line says which. Their output is
    routed as on one machine (``output``: ``ranks`` are this node's local ranks, ``[rank N]``
    names the global rank, ``log_dir`` keeps every rank's files, by global rank). Errors are
    reported into the run folder ``folder``. This node's ranks are watched for the hang report
    (node 0 combines every node's view when it can). A worker's failure is raised as the root
    cause among this node's ranks (``launch.failures``, as on one machine); elastic's
    ``SignalException`` when this launcher is stopped; elastic has then stopped the local workers.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    output = output or Output()
    host, port = split_endpoint(nodes.endpoint or "")
    net = network.choose(host, os.environ)
    backend, rdzv_configs, met = _rendezvous(nodes, host, port, net, folder=folder, max_restarts=max_restarts)
    route = net.route
    # elastic keeps its error files (and the hidden ranks' output, without log_dir) in a folder
    # of its own (a new one in /tmp when none is given, never removed): one of autoddp's, which
    # goes with the run (after a SIGKILL, at a later start)
    with private_folder("autoddp-elastic-") as logs:
        logs_specs, prefix = output.agent_logs(logs, nproc)
        config = LaunchConfig(
            min_nodes=nodes.min_nodes,
            max_nodes=nodes.max_nodes,
            nproc_per_node=nproc,
            run_id=nodes.run_id,
            rdzv_backend=backend,
            rdzv_endpoint=nodes.endpoint or "",
            rdzv_configs=rdzv_configs,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method="spawn",
            logs_specs=logs_specs,
            log_line_prefix_template=prefix,
            # The address the other nodes' workers are given for this node (else its host name).
            local_addr=nodes.local_addr or (route.local_address if route and route.interface else None),
            role=role,  # the workers' ROLE_NAME (elastic's own default is "default_role")
        )
        say(_start_line(nodes, nproc, net))
        gpus = hardware.gpu_count()
        with hang_record.folder() as records, diagnostics.node_traces(os.environ, nodes.run_id, gpus) as nccl:
            variables = {**net.variables, **nccl, **side_gloo_variables(os.environ, gpus), **GROUP_BARRIER}
            if hang_report > 0:
                variables[_variables.HANG_FOLDER] = records
            # where a worker reports its error, and whether the launcher prefixes its lines
            own = {_variables.RUN_FOLDER: folder, _variables.LINE_PREFIX: "1" if output.prefixed else "0"}
            exchange = _exchange(nodes, nproc, met)
            watch = Watch(records, nproc, hang_report, node=_node_name(nodes), exchange=exchange)
            failure: BaseException | None = None
            try:
                with elastic_logs_quiet(), _worker_environment(nproc, variables, own), watch:
                    elastic_launch(config, entrypoint=sys.executable)(*args)
            except ChildFailedError as failed:
                kept = records if hang_report > 0 else ""
                failure = _root_cause(failed, nproc, nodes.max_nodes, folder, kept, output, logs_specs)
            except NodesError as error:  # another node ended its run, or never joined
                failure = error
            except SignalException as stop:  # (Ctrl-C, SIGTERM): the other nodes are told at once
                if met is not None:
                    met.tell_stopped(signal.Signals(stop.sigval).name)
                raise
            if failure is not None:  # raised here, not in the except: it keeps its own cause (a traceback)
                raise _began_elsewhere(failure, met, nproc * nodes.max_nodes)


def _rendezvous(
    nodes: Nodes, host: str, port: int, net: network.Choice, *, folder: str, max_restarts: int
) -> tuple[str, dict[str, Any], meeting.Meeting | None]:
    """Elastic's rendezvous backend and configuration for this node, and the static meeting
    where the backend is "static" (elastic's, with a fresh store per attempt and no silent waits)."""
    rdzv_configs: dict[str, Any] = dict(nodes.conf)  # --rdzv-conf, as torchrun passes it
    backend = nodes.backend
    met = None
    if backend == "static":
        meeting.register()
        backend = meeting.BACKEND
        met = rdzv_configs["autoddp_meeting"] = meeting.Meeting(
            host,
            port,
            nodes.node_rank or 0,
            nodes.max_nodes,
            nodes.run_id,
            join_timeout=nodes.join_timeout,
            max_restarts=max_restarts,
            folder=folder,
        )
    else:
        rdzv_configs["join_timeout"] = int(nodes.join_timeout)
    route = net.route
    if nodes.backend == "c10d" and route is not None and route.owns_address:
        # This machine owns the endpoint's address; torch recognises it only by the host name.
        rdzv_configs["is_host"] = True
    return backend, rdzv_configs, met


def _root_cause(
    failed: Any, nproc: int, nnodes: int, folder: str, records: str, output: Output, logs_specs: Any
) -> BaseException:
    """The root cause among this node's ranks (the rules of one machine, ``launch.failures``), after
    the lines one machine's launcher prints with it (a hidden rank's last lines, a rank's sys.exit)."""
    world_size = nproc * nnodes
    error = failures.agent_failure(failed, nproc, folder, world_size, records)
    rank, first = failed.get_first_failure()
    shown = output.shown(nproc)
    show_hidden_output(error, getattr(logs_specs, "dest", None), shown, rank - first.local_rank)
    announce_exit(error, world_size)
    return error


def _began_elsewhere(lead: BaseException, met: meeting.Meeting | None, world_size: int) -> BaseException:
    """``lead``, or the root cause another node published when this node's ranks only lost their
    peers (or this node stopped because another ended): the original exception of the rank that
    failed first there, with its traceback, as on one machine."""
    if met is None:
        return lead
    met.tell(lead)
    notes = getattr(lead, "__notes__", [])
    if not isinstance(lead, NodesError) and failures.ELSEWHERE_NOTE not in notes:
        return lead  # the cause is here
    lost = met.lost()
    if lost and hasattr(lead, "add_note"):  # it never tells: say so instead of waiting for it
        if failures.ELSEWHERE_NOTE in notes:
            notes.remove(failures.ELSEWHERE_NOTE)
        lead.add_note(
            f"autoddp: {lost}: its ranks could not reach this node's (a network partition, or that machine "
            "stalls), and the collective timed out"
        )
        return lead
    told = met.causes_elsewhere()
    # a raised exception first, by time; a timeout elsewhere is that node's own business (its hang
    # report and triage name the late rank); else a worker that died there
    raised = {n: r for n, r in told.items() if isinstance(r, transport.ErrorReport)}
    causes = {n: r for n, r in raised.items() if not (r.is_consequence or r.is_timeout)}
    deaths = {n: e for n, e in told.items() if isinstance(e, WorkerError)}
    stops = {n: e for n, e in told.items() if isinstance(e, NodesError)}
    if causes:
        node, cause = min(causes.items(), key=lambda item: failures.triage_order(item[1]))
        error, rank = cause.rebuild(world_size), cause.rank
    elif deaths:
        node, error = min(deaths.items())
        rank = error.rank
    elif stops:  # another node's launcher was stopped (Ctrl-C): no worker of either failed first
        node, error = min(stops.items())
        if hasattr(error, "add_note"):
            error.add_note(f"autoddp: this node's ranks then lost their peers: {one_line(lead)}")
        return error
    else:
        return lead
    with contextlib.suppress(AttributeError, TypeError):
        error.autoddp_node = node  # type: ignore[attr-defined]
    if hasattr(error, "add_note"):
        error.add_note(
            f"autoddp: rank {rank} runs on node {node} of {met.nnodes}: the failure began there "
            + (
                f"(this node stopped when node {node} ended its run)"
                if isinstance(lead, NodesError)
                else f"(this node's ranks then lost their peers: {one_line(lead)})"
            )
        )
    announce_exit(error, world_size)
    return error


def _exchange(nodes: Nodes, nproc: int, met: meeting.Meeting | None) -> Exchange | None:
    """How this node's hang report reaches node 0's combined view (static rendezvous: its store,
    through the heartbeat's bounded calls, which also tell the nodes unreachable now)."""
    if met is None or nodes.node_rank is None:
        return None
    beat = met.beat
    return Exchange(beat.call, nodes.run_id, nodes.node_rank, nodes.max_nodes, nproc, beat.unreachable)


def _node_name(nodes: Nodes) -> str:
    return f"node {nodes.node_rank} of {nodes.max_nodes}" if nodes.backend == "static" else "this node"


def _start_line(nodes: Nodes, nproc: int, net: network.Choice) -> str:
    where = _node_name(nodes)
    if nodes.backend == "c10d" and nodes.min_nodes != nodes.max_nodes:
        where += f" ({nodes.min_nodes} to {nodes.max_nodes} nodes)"
    return f"{where}, {nproc} worker(s) here, {nodes.backend} rendezvous at {nodes.endpoint}; {net.summary}"


@contextlib.contextmanager
def _worker_environment(nproc: int, variables: Mapping[str, str], own: Mapping[str, str]) -> Iterator[None]:
    """``OMP_NUM_THREADS``, the network variables and the hang records' folder (where the user set
    none) and autoddp's own ``own`` variables for the agent's workers while it runs.

    Elastic's agent gives its workers a copy of this process's environment, so they are set
    here for the agent's run only and restored afterwards.
    """
    threads = hardware.omp_threads(nproc)
    added = {**variables, **({"OMP_NUM_THREADS": threads} if threads is not None else {})}
    added = {name: value for name, value in added.items() if name not in os.environ}
    added.update(own)
    before = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_function(job: Job, nproc: int, request: Request) -> Any:
    """This machine's share of a multi-node run of ``job`` (fresh interpreters, elastic's agent).

    Returns rank 0's result on the machine that runs rank 0, None on the others; raises the
    root-cause failure among this machine's ranks as the original exception.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    payload = transport.dumps_job(job, job.fn, job.args, job.kwargs)
    with acting_on_signals(" on this node"), transport.run_folder() as folder:
        transport.save_job(folder, payload)
        try:
            with caller_signal_handlers_kept():
                _agent(request, nproc, ["-m", "autoddp.in_rank.worker", folder], folder)
        except SignalException as error:  # the run folder goes first, then the signal is acted on
            raise Stopped(signal.Signals(error.sigval)) from None
        return transport.load_result(folder)


def run_script(script: Script, nproc: int, request: Request) -> None:
    """This machine's share of a multi-node run of a script (``python -m autoddp.in_rank.worker.script
    ARGV``); raises as ``run_agent`` does (elastic's ``SignalException`` when this launcher is stopped,
    its ``RendezvousTimeoutError`` when the other machines did not all join)."""
    with transport.run_folder() as folder:
        _agent(request, nproc, ["-m", "autoddp.in_rank.worker.script", *script.argv], folder)


def _agent(request: Request, nproc: int, args: list[str], folder: str) -> None:
    """``run_agent`` with the request's settings (its own check interval where the request names none)."""
    interval = {} if request.monitor_interval is None else {"monitor_interval": request.monitor_interval}
    run_agent(
        request.nodes,
        nproc,
        args,
        folder=folder,
        output=request.output,
        max_restarts=request.max_restarts,
        hang_report=request.hang_report,
        role=request.role,
        **interval,
    )
