"""This process's resident memory and its peak, which can be reset (Linux's ``/proc/self``).

On the CPU nothing counts what torch allocates, as ``torch.cuda.max_memory_allocated`` does on a
GPU: the resident set (``VmRSS``) and its peak (``VmHWM``) stand in for it. Writing ``5`` to
``/proc/self/clear_refs`` sets the peak to the resident set of now, so a peak can be read from a
point on (the kernel's interface since Linux 4.0). Elsewhere each reading is None. Knows no run.
"""

from __future__ import annotations

#: The files read and written (one place, so that a test can point them elsewhere).
STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


def resident(status: str = STATUS) -> int | None:
    """The bytes resident now (``VmRSS``), or None where unknown."""
    return _field("VmRSS:", status)


def peak(status: str = STATUS) -> int | None:
    """The most bytes resident since the process started or the last ``reset_peak`` (``VmHWM``)."""
    return _field("VmHWM:", status)


def reset_peak(clear_refs: str = CLEAR_REFS) -> bool:
    """Make the peak the resident set of now; whether it took (False where the file is missing or
    not writable: no Linux, an old kernel, a sandbox that hides it)."""
    try:
        with open(clear_refs, "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def _field(name: str, status: str) -> int | None:
    try:
        with open(status) as lines:
            for line in lines:
                if line.startswith(name):
                    return int(line.split()[1]) * 1024  # (in kB)
    except (OSError, ValueError, IndexError):
        return None
    return None
