"""The command's flags as one launch: the decorator's ``Options`` built from them (the same checks,
the same defaults), the ``launch.request.Request`` they ask for and the script runner's target.

Every problem found here is one usage line that names the flag (``arguments.fail``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from autoddp import options
from autoddp.command import arguments
from autoddp.core.errors import ConfigurationError
from autoddp.launch import plan as launch_plan
from autoddp.launch.request import Request, Script


def master_of(flags: dict[str, Any]) -> str | None:
    """Where node 0 (or one machine's store) is: ``--master``, else torchrun's
    ``--master-addr``/``--master-port`` as one address."""
    master, address, port = flags["master"], flags["master_addr"], flags["master_port"]
    if master is None and address is not None:
        return f"{address}:{port or 29500}"
    return master


def launch_of(flags: dict[str, Any], script: str, script_args: tuple[str, ...]) -> tuple[Request, Script]:
    """The request and the target the command's flags ask for, or a usage line and exit 2."""
    master, endpoint = master_of(flags), flags["rdzv_endpoint"]
    given = (  # one machine: its store's place, and the option that named it
        flags["master"] or endpoint,
        flags["master_addr"],
        flags["master_port"],
        "master" if flags["master"] else "rdzv_endpoint",
    )
    count = arguments.process_count(flags["nproc"])
    try:
        plan = launch_plan.plan(
            flags["nnodes"],
            flags["node_rank"],
            master,
            endpoint,
            flags["rdzv_backend"],
            flags["rdzv_id"],
            flags["rdzv_conf"],
            flags["local_addr"],
            flags["join_timeout"],
        )
        store = launch_plan.one_node_store(*given)  # (before the options: it names --rdzv-endpoint)
        settings = _options(flags, count, master)  # (after the plan: it names --rdzv-endpoint)
        settings.output.shown(count)  # local ranks: the same on one machine and on each of several
    except ConfigurationError as error:
        arguments.fail(arguments.as_flags(str(error)))
    request = settings.request(
        nodes=plan, store=store, monitor_interval=flags["monitor_interval"], role=flags["role"]
    )
    argv = [*_runner_flags(settings), *(["--module"] if flags["as_module"] else []), script, *script_args]
    return request, Script(tuple(argv))


def _options(flags: dict[str, Any], count: int, master: str | None) -> options.Options:
    """The decorator's ``Options`` from the command's flags: the same checks, the same defaults."""
    shared = {f.name for f in dataclasses.fields(options.Options)} & set(flags)
    values = {name: flags[name] for name in shared}
    endpoint = flags["rdzv_endpoint"]
    values.update(
        nproc=count,
        fsdp_blocks=tuple(b.strip() for b in (flags["fsdp_blocks"] or "").split(",") if b.strip()),
        ddp={"find_unused_parameters": True} if flags["find_unused_parameters"] else None,
        master=master or endpoint,
        rdzv_backend=flags["rdzv_backend"] or ("c10d" if endpoint and not master else None),
    )
    return options.Options(**values)


def _runner_flags(settings: options.Options) -> list[str]:
    """What the workers' script runner (``in_rank.worker.script``) is told: capture, the run's options."""
    run = dataclasses.asdict(dataclasses.replace(settings.run_options, capture=True))
    default = dataclasses.asdict(options.Options().run_options)
    return [
        *([] if settings.capture else ["--no-capture"]),
        *(["--run-options", json.dumps(run)] if run != default else []),
        *(["--timeout", repr(settings.timeout)] if settings.timeout is not None else []),
    ]
