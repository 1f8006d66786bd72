"""The rank's half of the hang report: each worker marks, in a small shared record, when it enters
and leaves a collective (``marks``, installed only while the user's code runs; ``pending`` keeps the
slot of a started collective that has not completed). The record's layout (``record``) is the one
format both sides share: the caller's half (``launch.hang``) reads it. This ``__init__`` imports
nothing."""
