"""The one list of autoddp's run options: each with its default, type, check and help, written once.

``Options`` holds the options of a run. ``@distributed``'s signature is made from its fields, the
``autoddp`` command's flags from the same fields (those with flags) plus ``COMMAND_ONLY``, the
flags that only a command line has, and the option table of README.md and docs/command.md from
both (``command.option_table``; ``tests/unit/test_options.py`` checks all three against this
list). Both fronts build an ``Options``, so a value is checked by the same rule whichever way it came.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import inspect
import operator
from collections.abc import Mapping
from typing import Any

from autoddp.core import backends
from autoddp.core.environment import hardware
from autoddp.core.errors import ConfigurationError
from autoddp.core.state import RunOptions
from autoddp.in_rank import models
from autoddp.in_rank.hang import record as hang_record
from autoddp.launch import output as launch_output
from autoddp.launch import plan as launch_plan
from autoddp.launch import request as launch_request
from autoddp.launch import start_method as launch_start


def option(default: Any, help: str, *flags: str, **click: Any) -> Any:
    """A field of ``Options``: its default, its help, and the command's flags for it (none: the
    decorator's only), with how click parses it (``type=``, ``metavar=``, ``is_flag=``...)."""
    return dataclasses.field(default=default, metadata={"help": help, "flags": flags, "click": click})


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of a run, checked when they are made (when the function is decorated, or when
    the command reads its flags)."""

    nproc: int | None = option(
        None,
        "Processes on this machine: a number (the command: also gpu, cpu, auto).  "
        "[default: one per visible GPU, 1 without GPUs]",
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        "--nproc",
        metavar="N",
        type=str,
    )
    backend: str | None = option(None, "auto (NCCL on GPUs, gloo on CPU), nccl or gloo.  [default: auto]")
    start_method: str = option(
        "auto",
        "How workers start on one machine: fork where safe, else fresh interpreters; fork or spawn.",
        "--start-method",
        "--start_method",
        metavar="auto|fork|spawn",
    )
    timeout: float | datetime.timedelta | None = option(
        None,
        "Seconds a collective may wait before the run fails; inf: no timeout (torch's longest, 10 years).  "
        "[default: 10 minutes on GPUs, 30 on CPU]",
        "--timeout",
        metavar="SECONDS",
        type=float,
    )
    ddp: Mapping[str, Any] | None = option(
        None, "Keyword arguments for DistributedDataParallel (the command: --find-unused-parameters)."
    )
    sync_batchnorm: bool = option(
        False, "Convert BatchNorm layers to SyncBatchNorm.", "--sync-batchnorm", is_flag=True
    )
    max_restarts: int = option(
        0,
        "Restart all workers this many times after a failure.",
        "--max-restarts",
        "--max_restarts",
        type=int,
    )
    nnodes: int | str | None = option(
        None, "Machines taking part: N or MIN:MAX.  [default: 1]", "--nnodes", metavar="N|MIN:MAX"
    )
    node_rank: int | None = option(
        None,
        "This machine's rank, 0 to nnodes-1 (static rendezvous).  [default: 0]",
        "--node-rank",
        "--node_rank",
        type=int,
    )
    master: str | None = option(
        None,
        "Node 0's HOST:PORT, where the rendezvous store is (one machine: where its store listens).",
        "--master",
        metavar="HOST:PORT",
    )
    rdzv_backend: str | None = option(
        None,
        "static, or c10d (torchrun's dynamic rendezvous).  [default: static with a node rank, else c10d]",
        "--rdzv-backend",
        "--rdzv_backend",
        metavar="static|c10d",
    )
    join_timeout: float | None = option(
        None,
        "Several machines: seconds the machines wait for each other to join, at the start and at each "
        f"restart, before the run fails.  [default: {launch_plan.DEFAULT_JOIN_TIMEOUT:g}]",
        "--join-timeout",
        "--join_timeout",
        metavar="SECONDS",
        type=float,
    )
    ranks: str = option(
        "0",
        "Whose output reaches the console: 0, all (lines prefixed [rank N]) or local ranks like 0,1.",
        "--ranks",
        "--local-ranks-filter",
        "--local_ranks_filter",
    )
    log_dir: str | None = option(
        None,
        "Keep every rank's stdout/stderr in files under this folder.  [default: a private temporary folder]",
        "--log-dir",
        "--log_dir",
    )
    capture: bool = option(
        True,
        "Distribute the models, shuffled loaders and torch.save calls the code makes.",
        "--capture/--no-capture",
    )
    strategy: str = option(
        "auto",
        "How models are distributed: auto (DDP where a model's state fits --device-memory, else FSDP2), "
        "ddp (replicated) or fsdp (FSDP2, sharded).",
        "--strategy",
        metavar="auto|ddp|fsdp",
    )
    device_memory: int | str | None = option(
        None,
        "strategy auto: the memory one process may use, as 24GiB or 1200MiB.  [default: the GPU's free "
        "memory less 10% of its size; on CPU the machine's available memory over its processes]",
        "--device-memory",
        metavar="SIZE",
        type=str,
    )
    fsdp_blocks: tuple[type | str, ...] = option(
        (),
        "FSDP: module classes that get their own shard unit.  [default: autoddp chooses]",
        "--fsdp-blocks",
        metavar="CLASS,...",
    )
    mixed_precision: str | None = option(
        None,
        "FSDP: compute in bf16 or fp16, reduce gradients in float32.  [default: off]",
        "--mixed-precision",
        metavar="bf16|fp16",
    )
    cpu_offload: bool = option(
        False, "FSDP: keep parameter shards on the CPU.", "--cpu-offload", is_flag=True
    )
    split_batches: bool = option(
        False,
        "The script's batch is the global batch: each process takes its part of every batch, so the "
        "run takes the steps one process would, with the same samples in each.",
        "--split-batches",
        is_flag=True,
    )
    step_report: bool = option(
        True,
        "At the end of a run on this machine (and on SIGUSR1 to it while it runs), say where a step's "
        "time goes: steps and samples per second, each rank's share waiting for data, computing and "
        "waiting for the others, and the rank they wait for.",
        "--step-report/--no-step-report",
    )
    hang_report: float = option(
        hang_record.DEFAULT_SECONDS,
        "When ranks have waited this long in a collective for others, say which rank is late and where "
        "(its stack); the run goes on. 0 (or inf) turns it off.",
        "--hang-report",
        "--hang_report",
        metavar="SECONDS",
        type=float,
    )

    def __post_init__(self) -> None:
        for name in ("nproc", "max_restarts", "node_rank", "nnodes"):  # numpy.int64(2) is 2
            object.__setattr__(self, name, _whole(getattr(self, name)))
        self.nodes  # noqa: B018 - checks the multi-node options at decoration time
        if self.nproc is not None and not _at_least(self.nproc, 1):
            raise ConfigurationError(
                f"nproc={self.nproc!r} is not a positive whole number of processes; pass e.g. "
                "nproc=2, or leave it unset for one process per visible GPU (1 without GPUs)"
            )
        backends.resolve_backend(self.backend, gpus=1)  # the name only; GPUs are checked per call
        if self.start_method not in launch_start.START_METHODS:
            raise ConfigurationError(
                f"unknown start_method={self.start_method!r}: use 'auto' (default), 'fork' or 'spawn'"
            )
        backends.as_timeout(self.timeout)
        if not _at_least(self.max_restarts, 0):
            raise ConfigurationError(
                f"max_restarts={self.max_restarts!r} must be a whole number >= 0 (restarts after a failure)"
            )
        models.check_options(
            self.strategy, self.ddp, self.fsdp_blocks, self.mixed_precision, self.cpu_offload
        )
        if self.device_memory is not None:
            object.__setattr__(
                self, "device_memory", models.check_device_memory(self.device_memory, self.strategy)
            )
        object.__setattr__(self, "hang_report", hang_record.checked_seconds(self.hang_report))
        fsdp_asked = self.strategy == "fsdp" or self.fsdp_blocks or self.mixed_precision or self.cpu_offload
        if self.split_batches is True and fsdp_asked:
            raise ConfigurationError(
                "split_batches works with DDP only so far, and strategy='fsdp' or one of FSDP's options "
                "(fsdp_blocks, mixed_precision, cpu_offload) asks for FSDP: leave one of them out"
            )
        for name in ("sync_batchnorm", "capture", "cpu_offload", "split_batches", "step_report"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name}={getattr(self, name)!r} must be True or False")
        models.check_available(self.strategy)
        self.output.shown(self.nproc or max(hardware.gpu_count(), 1))  # ranks=, log_dir= as well

    @classmethod
    def from_keywords(cls, options: Mapping[str, Any]) -> Options:
        """Options from ``@distributed(**options)``; an unknown name is a ConfigurationError."""
        names = [field.name for field in dataclasses.fields(cls)]
        for name in options:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]}=?" if close else ""
                raise ConfigurationError(
                    f"@distributed has no option {name!r}{hint} Its options are: {', '.join(names)}"
                )
        return cls(**options)

    @property
    def nodes(self) -> launch_plan.Nodes:
        return launch_plan.plan(
            self.nnodes,
            self.node_rank,
            self.master,
            rdzv_backend=self.rdzv_backend,
            join_timeout=self.join_timeout,
        )

    @property
    def output(self) -> launch_output.Output:
        return launch_output.Output(self.ranks, self.log_dir)

    @property
    def run_options(self) -> RunOptions:
        # derived by name (a field added to RunOptions is read from the option of its name; those
        # only a plan of strategy="auto" sets have none)
        fields = dataclasses.fields(RunOptions)
        names = [f.name for f in fields if f.name != "ddp_kwargs" and not f.metadata.get("planned")]
        same = {name: getattr(self, name) for name in names}
        same.update(ddp_kwargs=dict(self.ddp or {}), fsdp_blocks=tuple(self.fsdp_blocks))
        return RunOptions(**same)

    def request(self, **command: Any) -> launch_request.Request:
        """What a launch of these options asks for (``autoddp.launch.run``); ``command``: what only the
        command says (its plan from every rendezvous flag, its store's place, ``--role``...)."""
        names = ("nproc", "output", "max_restarts", "hang_report", "step_report")
        same = {name: getattr(self, name) for name in names}
        if "nodes" not in command:
            command["nodes"] = self.nodes
        if "store" not in command:  # one machine: master= is where its store listens (as --master-addr)
            command["store"] = launch_plan.one_node_store(self.master, None, None)
        return launch_request.Request(start_method=self.start_method, **same, **command)


def _whole(value: Any) -> Any:
    """``value`` as an ``int`` where ``operator.index`` takes it (not a bool), else unchanged."""
    indexable = hasattr(type(value), "__index__") and not isinstance(value, bool)
    return operator.index(value) if indexable else value


def _at_least(value: Any, least: int) -> bool:
    """Whether ``value`` is a whole number (not a bool) of at least ``least``."""
    return type(value) is int and value >= least


@dataclasses.dataclass(frozen=True)
class CommandOnly:
    """A flag only the command has: a command line's own business, or torchrun's spelling."""

    name: str
    default: Any
    help: str
    flags: tuple[str, ...]
    click: Mapping[str, Any] = dataclasses.field(default_factory=dict)


COMMAND_ONLY = (
    CommandOnly(
        "as_module",
        False,
        "Run SCRIPT as a module name, like python -m.",
        ("-m", "--module"),
        {"is_flag": True},
    ),
    CommandOnly(
        "monitor_interval",
        0.05,
        "Seconds between checks of the workers' health.",
        ("--monitor-interval", "--monitor_interval"),
        {"type": float},
    ),
    CommandOnly("role", "default", "The workers' ROLE_NAME, as torchrun's --role.", ("--role",)),
    CommandOnly(
        "standalone",
        False,
        "Accepted: one machine is always standalone.",
        ("--standalone",),
        {"is_flag": True},
    ),
    CommandOnly(
        "run_path",
        False,
        "Accepted: scripts always run with runpy.run_path.",
        ("--run-path", "--run_path"),
        {"is_flag": True},
    ),
    CommandOnly(
        "quiet",
        False,
        "No start-up line from autoddp (how many processes, why).",
        ("-q", "--quiet"),
        {"is_flag": True},
    ),
    CommandOnly(
        "master_addr", None, "torchrun's spelling of --master's HOST.", ("--master-addr", "--master_addr")
    ),
    CommandOnly(
        "master_port",
        None,
        "torchrun's spelling of --master's PORT.  [default: one machine: a free port; several: 29500]",
        ("--master-port", "--master_port"),
        {"type": int},
    ),
    CommandOnly(
        "rdzv_endpoint",
        None,
        "The c10d rendezvous's HOST:PORT (@distributed: master= with rdzv_backend='c10d').",
        ("--rdzv-endpoint", "--rdzv_endpoint"),
        {"metavar": "HOST:PORT"},
    ),
    CommandOnly(
        "rdzv_id",
        None,
        "Job id shared by all nodes.  [default: none, as torchrun]",
        ("--rdzv-id", "--rdzv_id"),
    ),
    CommandOnly(
        "rdzv_conf",
        None,
        "Several machines: the rendezvous's settings, e.g. join_timeout=600.",
        ("--rdzv-conf", "--rdzv_conf"),
        {"metavar": "KEY=VALUE,..."},
    ),
    CommandOnly(
        "local_addr",
        None,
        "Several machines: the address the others reach this one by.  [default: the route to node 0]",
        ("--local-addr", "--local_addr"),
    ),
    CommandOnly(
        "find_unused_parameters",
        False,
        "DDP: allow parameters that get no gradient in a step (slower; @distributed: ddp=).",
        ("--find-unused-parameters",),
        {"is_flag": True},
    ),
)


def signature() -> inspect.Signature:
    """``@distributed``'s signature: ``fn`` and every field of ``Options``, with its default."""
    return inspect.Signature(
        [inspect.Parameter("fn", inspect.Parameter.POSITIONAL_ONLY, default=None)]
        + [
            inspect.Parameter(
                field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default, annotation=field.type
            )
            for field in dataclasses.fields(Options)
        ]
    )


def command_flags() -> list[CommandOnly]:
    """Every flag of the command, in ``--help``'s order: the shared options first, then its own."""
    shared = [
        CommandOnly(f.name, f.default, f.metadata["help"], f.metadata["flags"], f.metadata["click"])
        for f in dataclasses.fields(Options)
        if f.metadata["flags"]
    ]
    return [*shared, *COMMAND_ONLY]
