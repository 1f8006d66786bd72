"""What torch says when the CPU runs out of memory, read for ``strategy="auto"``'s restart.

On a GPU torch raises ``torch.cuda.OutOfMemoryError``. On the CPU its allocator raises a plain
``RuntimeError`` when the system refuses an allocation (a process under ``ulimit -v``, a machine
that does not overcommit): "DefaultCPUAllocator: can't allocate memory: you tried to allocate N
bytes" (``posix_memalign`` failed, torch 2.4 to 2.15), or "DefaultCPUAllocator: not enough
memory". The text is torch's, not an API: ``tests/core/test_compat.py`` makes torch raise it and
checks that it still reads. (Where the kernel stops the process instead, nothing is raised.)
"""

from __future__ import annotations

_SAYS = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def cpu_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is torch's CPU allocator running out of memory."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(said in text for said in _SAYS)
