"""Launching: start and supervise workers through torch.distributed.elastic, on one machine or many.

Modules, in dependency order: ``output`` (console routing, messages), ``plan`` (the multi-node
options), ``start_method`` (fork or fresh interpreters), ``store`` (the loopback rendezvous
store), ``supervise`` (elastic's multiprocessing, signals), ``failures`` (root-cause triage),
``local`` (one machine, restarts), ``nodes`` (several machines, elastic's agent), ``in_place``
(the command inside a launched world). Import the module you need: this package imports nothing,
so that checking options never loads the launch machinery.
"""
