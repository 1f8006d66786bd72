"""The memory one process may use for a model's state and its steps (``device_memory``), and the
plan (``ddp``, ``fsdp``, ``fsdp`` with activation checkpointing, ``fsdp`` with CPU offload) whose
bytes fit it.

The default budget, when the user gives none:

- **On a GPU:** what the process could hold on its device when autoddp first decides, that is
  what ``torch.cuda.mem_get_info`` reports free plus what torch's allocator in this process
  already reserved, less a margin of ``GPU_MARGIN`` of the device's total memory. The margin holds
  what no estimate sees: the allocator's fragmentation, cuBLAS/cuDNN workspaces, NCCL's buffers.
- **On the CPU:** the machine's available memory (``MemAvailable``), read when the worker starts,
  divided by the processes on the machine.

The plans, cheapest first (``LADDER``): the first whose bytes fit is taken. Activation
checkpointing saves activations, not state: its state weighs what FSDP's does, so weighing never
prefers it; it is the next plan after an out-of-memory error under FSDP (a restart), and the
offload plan keeps it. Nothing here runs a model: the bytes are the caller's (``estimate``);
nothing here knows the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from autoddp.core.memory.sizes import format_bytes

#: The share of a GPU's total memory left out of the default budget (module docstring).
GPU_MARGIN = 0.10
#: What a CPU process's first training step may hold beyond its budget before it counts as over:
#: the runtime's own growth at a first step (code paged in, threads' stacks and arenas: 7-11 MiB
#: for a small model on torch 2.13), which the resident peak counts and no model's state is.
CPU_RUNTIME = 32 * 2**20


class Rung(NamedTuple):
    """One plan: its name, its strategy, and what it does beside sharding."""

    name: str
    strategy: str
    cpu_offload: bool = False
    #: Each block's forward recomputed in the backward pass instead of keeping its activations.
    checkpoint_blocks: bool = False


#: The plans, cheapest first.
LADDER: tuple[Rung, ...] = (
    Rung("ddp", "ddp"),
    Rung("fsdp", "fsdp"),
    Rung("fsdp with activation checkpointing", "fsdp", checkpoint_blocks=True),
    Rung("fsdp with CPU offload", "fsdp", cpu_offload=True, checkpoint_blocks=True),
)


def rung(name: str) -> Rung:
    """The plan called ``name`` (ValueError for a name not in ``LADDER``)."""
    for plan in LADDER:
        if plan.name == name:
            return plan
    raise ValueError(f"no plan called {name!r}: one of {', '.join(plan.name for plan in LADDER)}")


def gpu_default(free: int, reserved: int, total: int) -> int:
    """The default budget of a GPU process: free plus this process's reserved, less the margin."""
    return max(int(free + reserved - GPU_MARGIN * total), 0)


def cpu_default(available: int, processes: int) -> int:
    """The default budget of a CPU process: the machine's available memory over its processes."""
    return available // max(processes, 1)


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """The machine's available memory in bytes (Linux's ``MemAvailable``); None where unknown."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class Choice:
    """The plan taken for a model: its strategy and offload, and the numbers that decided it."""

    name: str
    strategy: str
    cpu_offload: bool
    checkpoint_blocks: bool
    #: Each plan's bytes per process that were weighed, cheapest first (name -> bytes).
    needs: Mapping[str, int]
    budget: int
    #: Whether the plan fits the budget (False: the last plan was taken, and it does not fit).
    fits: bool

    def describe(self) -> str:
        """One clause for the notice: why this plan (``"state 1.6 GiB fits the 24.0 GiB ..."``)."""
        allowed = f"the {format_bytes(self.budget)} a process may use"
        need = format_bytes(self.needs[self.name])
        if self.fits and self.name == next(iter(self.needs)):
            return f"state {need} fits {allowed}"
        if self.fits:
            names = list(self.needs)  # (cheapest first: those before the plan taken did not fit)
            cheaper = ", ".join(
                f"{format_bytes(self.needs[name])} under {name}" for name in names[: names.index(self.name)]
            )
            return f"state {cheaper} does not fit {allowed}; {need} under {self.name} does"
        weighed = ", ".join(f"{format_bytes(bytes_)} under {name}" for name, bytes_ in self.needs.items())
        return f"no plan fits {allowed} (state {weighed}): {self.name} needs the fewest"


def choose(needs: Mapping[str, int], budget: int, allowed: Sequence[str] | None = None) -> Choice:
    """The cheapest plan of ``LADDER`` (only the ``allowed`` names, if given) whose need fits
    ``budget``; where none fits, the one that needs the fewest bytes (``fits`` False). ``needs``:
    bytes per plan name, for the plans the caller could weigh (a plan not in it is skipped)."""
    ladder = [plan for plan in LADDER if plan.name in needs and (allowed is None or plan.name in allowed)]
    if not ladder:
        raise ValueError(f"no plan to weigh: needs={dict(needs)!r}, allowed={allowed!r}")
    weighed = {plan.name: needs[plan.name] for plan in ladder}
    fitting = [plan for plan in ladder if needs[plan.name] <= budget]
    taken = fitting[0] if fitting else min(ladder, key=lambda plan: needs[plan.name])  # (cheaper on a tie)
    return Choice(*taken, weighed, budget, bool(fitting))
