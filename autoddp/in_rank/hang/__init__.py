"""The hang report: a run that waits for a rank says which rank and where, long before any timeout.

Each worker marks, in a small shared record, when it enters and leaves a collective (``marks``,
installed only while the user's code runs); the launcher reads the records about once a second
beside elastic's supervision (``watch``). When some ranks have waited longer than ``hang_report``
seconds while others are elsewhere, it asks the ranks for their Python stacks (a signal that
faulthandler answers, ``stacks``), decides what the situation is (``verdict``) and prints one
report on the console (``message``). Nothing is stopped.

Modules: ``record`` (the shared record's layout, both sides), ``marks`` (worker side),
``stacks``, ``verdict``, ``message``, ``combine`` (node 0's view of every node) and ``watch``
(launcher side). Import the one you need: this package's ``__init__`` imports nothing, so a
worker never loads the launcher's side.
"""
