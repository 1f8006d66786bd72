"""Launching: start and supervise workers through torch.distributed.elastic, on one machine or many.

Modules, in dependency order: ``output`` (console routing, messages), ``start_method`` (fork or
fresh interpreters), ``store`` (the loopback rendezvous store), ``supervise`` (elastic's
multiprocessing, signals), ``failures`` (root-cause triage), ``local`` (one machine, restarts),
``nodes`` (several machines, elastic's agent), ``in_place`` (the command inside a launched world).
"""

from autoddp.launch.in_place import exec_script as exec_script
from autoddp.launch.local import launch_function as launch_function
from autoddp.launch.local import launch_script as launch_script
from autoddp.launch.nodes import Nodes as Nodes
from autoddp.launch.nodes import describe_failure as describe_failure
from autoddp.launch.nodes import launch_nodes as launch_nodes
from autoddp.launch.nodes import plan as plan
from autoddp.launch.nodes import run_agent as run_agent
from autoddp.launch.output import Output as Output
from autoddp.launch.output import one_line as one_line
from autoddp.launch.start_method import START_METHODS as START_METHODS
from autoddp.launch.start_method import choose_start_method as choose_start_method
