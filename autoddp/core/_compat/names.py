"""The list of every private torch (and CPython) name autoddp reaches, and of every torch attribute
it replaces for the life of a process: the inventory a torch upgrade is checked against.

Only ``autoddp.core._compat`` touches these names (``tests/core/test_compat.py`` reads the package's source:
a private name used anywhere else, or one used here and not listed, fails; so does a listed one
no longer used). The patch engine (``autoddp.core._patches``) replaces other attributes too, and puts
each back when its user is done; the ones below stay replaced until the process ends.
"""

from __future__ import annotations

#: Private names, each with what autoddp reads it for.
PRIVATE = {
    "torch._C": "TensorBase: the C descriptors nn.Parameter inherits (data, requires_grad)",
    "torch._dynamo": "torch.compile's engine: compiling a module in place, importing it once before forks",
    "torch.utils._device": "DeviceContext: the device set_default_device and `with torch.device()` make",
    "torch.distributed._tensor": "DTensor's module before torch 2.5",
    "torch.distributed._broadcast_coalesced": "DDP's buffer broadcast, refused inside rank0() bodies",
    "torch.distributed._functional_collectives": "DTensor's (so FSDP2's state dicts') collectives: refused "
    "inside rank0() bodies, marked for the hang report",
    "torch.distributed.distributed_c10d._get_default_store": "the group's key-value store",
    "torch.distributed.distributed_c10d._get_default_group": "the default group, to count its collectives",
    "torch.distributed.distributed_c10d._new_process_group_helper": "every group torch makes (gloo's lines)",
    "torch.distributed.ProcessGroup._get_backend": "a group's gloo and NCCL backends",
    "torch.distributed.Backend._get_sequence_number_for_group": "the collectives a backend issued",
    "torch.distributed.elastic.multiprocessing.api.MultiprocessContext._pc": "forked workers' exit codes",
    "torch.utils.data.DataLoader._iterator": "the iterator persistent workers keep between passes",
    "torch.utils.data.dataloader._BaseDataLoaderIter": "iterators' base: the step report times __next__",
    "torch.autograd._engine_run_backward": "the engine call of backward() and grad(): passes under names "
    "bound before capture, counted",
    "torch.autograd.Variable._execution_engine": "queue_callback: the step report sees a backward's work end",
    "torch.utils.data.dataloader._BaseDataLoaderIter._index_sampler": "the order of a kept iterator's pass",
    "torch.utils.data.dataloader._BaseDataLoaderIter._num_yielded": "the batches a pass has yielded",
    "torch.nn.Module._apply": "replaced (below): .to()/.half()/.cuda() seen",
    "torch.nn.Module._call_impl": "a module's own call, compiled in place",
    "torch.nn.Module._compiled_call_impl": "where a module's compiled (or routed) call is kept",
    "torch._C._get_tracing_state": "whether torch.jit.trace runs (a module's call then goes through torch)",
    "torch.nn.modules.module._global_forward_pre_hooks": "the global module hooks: a call without any runs "
    "forward alone",
    "torch.nn.modules.module._global_forward_hooks": "(as above)",
    "torch.nn.modules.module._global_backward_pre_hooks": "(as above)",
    "torch.nn.modules.module._global_backward_hooks": "(as above)",
    "torch.nn.Module._forward_pre_hooks": "a module's own hooks: a call without any runs forward alone",
    "torch.nn.Module._forward_hooks": "(as above)",
    "torch.nn.Module._backward_pre_hooks": "(as above)",
    "torch.nn.Module._backward_hooks": "(as above)",
    "torch.nn.Module._parameters": "whether a module owns parameters itself (None entries too)",
    "torch.nn.MultiheadAttention._reset_parameters": "torch's attention's initialiser",
    "torch._dynamo.eval_frame.OptimizedModule._orig_mod": "the module inside a torch.compile result",
    "torch.Tensor._version": "a tensor's in-place version counter",
    "torch.Tensor._backward_hooks": "a tensor's hooks dict, read by torch's C hook: outputs hooked cheaply",
    "torch.autograd.graph.Node._register_hook_dict": "a node's C hook on its output's hooks dict",
    "torch.cuda._is_in_bad_fork": "whether a forked worker can use CUDA",
    "torch.autograd.graph.Node._saved_reduction": "a loss's reduction, from its graph",
    "torch.autograd.graph.Node._saved_weight": "a weighted loss, from its graph",
    "torch.autograd.graph.Node._saved_ignore_index": "a loss's ignored targets, from its graph",
    "torch.autograd.graph.Node._saved_target": "a loss's targets, from its graph",
    "multiprocessing.process.BaseProcess._target": "what a process the user's code started runs",
    "multiprocessing.process.BaseProcess._args": "what a process the user's code started is given",
    "multiprocessing.process.BaseProcess._kwargs": "what a process the user's code started is given",
    "atexit._run_exitfuncs": "the process's exit hooks, run before a fast exit",
    "atexit._clear": "the exit hooks a forked worker inherited, dropped",
    "torch._subclasses.fake_tensor": "fake tensors' module",
    "torch._subclasses.fake_tensor.FakeTensorMode": "tensors without memory on the device's own kernels: "
    "the memory estimate's forward",
    "torch.utils._python_dispatch": "torch's dispatch modes' module",
    "torch.utils._python_dispatch.TorchDispatchMode": "each operation's results seen as it runs: the "
    "memory estimate's live bytes",
}

#: Private CPython names used across the package: documented, stable parts of the language.
CPYTHON_ANYWHERE = {
    "_getframe": "sys._getframe: the user's frame",
    "_exit": "os._exit: a forked child's exit",
    "_fields": "a named tuple's field names",
}

#: Torch attributes replaced for the life of the process, outside the patch engine: each with why.
REPLACED_FOR_THE_PROCESS = {
    "torch.nn.Parameter.data": "to see a parameter's data replaced",
    "torch.nn.Parameter.requires_grad": "to see a parameter frozen",
    "torch.nn.Parameter.requires_grad_": "to see a parameter frozen",
    "torch.nn.Parameter.detach_": "to see a parameter frozen",
    "torch.nn.Module._apply": "to see .to()/.half()/.cuda() put new parameters in",
    "torch.nn.Module.register_parameter": "to see a parameter removed",
    "torch.nn.Module.__delattr__": "to see parameters or submodules removed",
    "torch.utils.swap_tensors": "to see parameters swapped",
    "torch.distributed.distributed_c10d._new_process_group_helper": "gloo's lines off stdout (2.8-2.10)",
    "torch.autograd._engine_run_backward": "every backward pass counted, from the first guarded model on "
    "(``models.count_passes``)",
}
