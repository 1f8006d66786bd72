"""Rank-0 work: ``with autoddp.rank0():`` blocks that nobody hangs on.

``skip`` (skipping a ``with`` body on the other ranks), ``refusals`` (collectives refused inside
the block) and ``block`` (the ``rank0()`` block itself). Named ``rank_zero`` so that the public
``autoddp.rank0`` stays the function. Import the module you need: this package imports nothing.
"""
