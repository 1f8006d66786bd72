"""The caller's half of the hang report: it reads each worker's hang record (``in_rank.hang.record``)
and says which rank waits for which, and where (``watch``, ``verdict``, ``message``, ``stacks``,
``combine`` across nodes)."""
