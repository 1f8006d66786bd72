"""Every private torch internal autoddp uses (``autoddp.core._compat``), checked against this torch.

A torch release that renames or changes one of them fails here, with the piece named, before
it can fail a user's run. Nothing is mocked: each internal is used the way autoddp uses it.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import pathlib
import re
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import autoddp
from autoddp.core import _compat
from autoddp.core._compat import gloo_lines
from autoddp.core.errors import TorchCompatibilityError
from conftest import run_python

pytestmark = pytest.mark.smoke  # CI runs these on the lowest and the newest torch too (-m smoke)


@pytest.mark.unit
def test_a_missing_internal_is_a_loud_error_naming_it():
    with pytest.raises(TorchCompatibilityError, match=r"autoddp needs object.nope \(for a test\).*torch"):
        _compat._need(object(), "nope", "for a test")


#: A fresh interpreter's forks, before and after it asks for the GPU count.
BAD_FORKS = """
import os, torch
from autoddp.core._compat import forks

def fork_is_bad():
    pid = os.fork()
    if pid == 0:
        os._exit(1 if forks.cuda_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1

untouched = fork_is_bad()
torch.cuda.device_count()
print(forks.cuda_in_bad_fork(), untouched, fork_is_bad())
"""


def test_bad_fork_check_answers_in_this_process_and_in_a_fork(tmp_path):
    script = tmp_path / "forks.py"
    script.write_text(BAD_FORKS)
    done = run_python([str(script)])
    assert done.returncode == 0, done.stderr
    # A CUDA build (even without a driver) marks every later fork bad once the GPUs are counted.
    assert done.stdout.split() == ["False", "False", str(torch.backends.cuda.is_built())]


#: A fresh interpreter's forks, before and after a compiled layer and a backward ran in it.
AUTOGRAD_FORKS = """
import os, torch
from autoddp.core._compat import forks
from torch._dynamo.testing import CompileCounter

def answers():
    pid = os.fork()
    if pid == 0:
        said = forks.autograd_in_bad_fork()
        try:
            torch.ones(2, requires_grad=True).sum().backward()
            raised = False
        except RuntimeError:
            raised = True
        os._exit(said * 2 + raised)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

before = answers()
torch.compile(torch.nn.Linear(3, 2), backend=CompileCounter())(torch.randn(4, 3))
torch.nn.Linear(2, 1)(torch.ones(3, 2)).sum().backward()
print(forks.autograd_in_bad_fork(), before, answers())
"""


def test_autograd_bad_fork_check_says_what_a_backward_in_the_fork_does(tmp_path):
    """The check's answer is whether a backward raises there (3: both; 0: neither), in the
    process itself, in a fork of a fresh one, and in a fork after autograd ran."""
    script = tmp_path / "forks.py"
    script.write_text(AUTOGRAD_FORKS)
    done = run_python([str(script)], timeout=120)
    assert done.returncode == 0, done.stderr
    here, before, after = done.stdout.split()
    assert (here, before) == ("False", "0")
    # torch 2.10-2.15's CUDA builds start device threads there, even with no driver; CPU builds never
    assert after in ("0", "3"), "the check and a real backward disagree in the fork"
    if not torch.backends.cuda.is_built():
        assert after == "0"


def test_default_store_is_the_groups_key_value_store():
    @autoddp.distributed(nproc=2)
    def share():
        store = _compat.default_store()
        if autoddp.rank() == 0:
            store.set("compat-key", b"from rank 0")
        dist.barrier()
        return store.get("compat-key"), store.timeout.total_seconds() > 0

    assert share() == (b"from rank 0", True)


@pytest.mark.unit
def test_ddp_buffer_broadcast_is_still_a_torch_distributed_function():
    # tests/in_rank/test_rank0.py shows DDP's forward reaching it (refused inside a rank0() body).
    assert _compat.ddp_buffer_broadcast() is getattr(dist, _compat.DDP_BUFFER_BROADCAST)
    assert callable(_compat.ddp_buffer_broadcast())


def _exit_with(code: int) -> None:
    os._exit(code)


def test_forked_exit_codes_of_an_elastic_context(tmp_path):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    context = start_processes(
        name="compat",
        entrypoint=_exit_with,
        args={0: (0,), 1: (3,)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
        start_method="fork",
    )
    try:
        while context.wait(timeout=0.05) is None:
            pass
        deadline = 50
        while None in _compat.forked_exit_codes(context).values() and deadline:
            context.wait(timeout=0.1)
            deadline -= 1
        assert _compat.forked_exit_codes(context) == {0: 0, 1: 3}
    finally:
        context.close()


def test_loader_iterator_appears_once_persistent_workers_start():
    loader = DataLoader(list(range(4)), batch_size=2, num_workers=1, persistent_workers=True)
    assert _compat.loader_iterator(loader) is None
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3]]
    assert _compat.loader_iterator(loader) is not None
    del loader
    gc.collect()  # shuts the persistent worker down


@pytest.mark.unit
def test_a_backward_callback_queued_as_the_pass_begins_runs_after_its_gradients_before_later_ones():
    """The step report's clock: queued from the pass's first node, the callback runs once every
    gradient is computed and before a callback queued later in the pass (DDP's, at its last bucket)."""
    from autoddp.core._compat import timing

    queue, order = timing.backward_callbacks(), []
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).sum()
    weight.register_hook(lambda grad: (order.append("gradient"), queue(lambda: order.append("later")))[0])
    loss.grad_fn.register_prehook(lambda grads: queue(lambda: order.append("first")))
    loss.backward()
    assert order == ["gradient", "first", "later"]


def test_every_dataloader_iterator_hands_out_its_batches_through_the_base_class_next():
    from autoddp.core._compat import timing

    base = timing.loader_iterator_class()
    assert "__next__" in vars(base)
    for workers in (0, 1):
        iterator = iter(DataLoader(list(range(4)), batch_size=2, num_workers=workers))
        assert isinstance(iterator, base) and type(iterator).__next__ is base.__next__
        assert next(iterator).tolist() == [0, 1]
        del iterator


@pytest.mark.unit
def test_compiled_parts_and_compiling_the_module_in_place():
    from torch._dynamo.testing import CompileCounter

    plain = torch.nn.Linear(3, 2)  # a built-in layer (torch 2.4 recursed forever on its bound call)
    assert _compat.compiled_parts(plain) is None
    counter = CompileCounter()
    compiled = torch.compile(plain, backend=counter)
    inner, context = _compat.compiled_parts(compiled)
    assert inner is plain
    _compat.compile_in_place(inner, context)
    assert inner._compiled_call_impl is not None
    x = torch.randn(4, 3)
    assert torch.equal(inner(x), torch.nn.functional.linear(x, plain.weight, plain.bias))
    assert torch.equal(inner(x), inner(x)) and counter.frame_count == 1  # one graph, reused


@pytest.mark.unit
def test_the_compile_result_calling_a_module_is_found_from_inside_its_call():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(untraced(self))  # (as autoddp asks: from outside the traced code)
            return x

    untraced = torch.compiler.disable(_compat.compile_result_calling)
    probe = Probe()
    assert _compat.compile_result_calling(probe) is None
    compiled = torch.compile(probe, backend="eager")
    compiled(torch.ones(2))
    assert seen[-1] is compiled and _compat.compiled_parts(compiled)[0] is probe


@pytest.mark.unit
def test_calls_of_a_module_are_routed_and_left_out_of_pickles():
    import pickle

    layer = torch.nn.Linear(3, 2)
    assert _compat.routed_call(layer) is None
    unrouted = pickle.dumps(layer, 2)
    own = _compat.own_call(layer)
    calls = []
    _compat.route_calls(layer, lambda *args: calls.append(args) or own(*args))
    x = torch.randn(4, 3)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)) and len(calls) == 1
    assert _compat.routed_call(layer) is not None
    assert pickle.dumps(layer, 2) == unrouted  # nothing of the routing in it
    copy = pickle.loads(pickle.dumps(layer, 2))
    assert _compat.routed_call(copy) is None
    _compat.route_calls(layer, None)
    assert _compat.routed_call(layer) is None


def test_inherited_atexit_hooks_can_be_dropped():
    code = (
        "import atexit, os\n"
        "from autoddp.core import _compat\n"
        "atexit.register(lambda: print('parent hook', flush=True))\n"
        "_compat.clear_atexit_hooks()\n"
        "atexit.register(lambda: print('own hook', flush=True))\n"
    )
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "own hook\n"


def test_atexit_hooks_run_before_a_fast_exit():
    code = (
        "import atexit, os\n"
        "from autoddp.core import _compat\n"
        "atexit.register(lambda: print('hook ran', flush=True))\n"
        "_compat.run_atexit_hooks()\n"
        "os._exit(0)\n"
    )
    result = run_python(["-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout == "hook ran\n"


def test_collectives_issued_counts_the_default_groups_collectives_alike_on_every_rank():
    @autoddp.distributed(nproc=2)
    def count():
        before = _compat.collectives_issued()
        if dist.get_rank() == 0:
            _compat.default_store().set("compat/count", "1")  # store traffic is not a collective
        dist.all_reduce(torch.ones(1))
        dist.barrier()
        counts = [None, None]
        dist.all_gather_object(counts, (before, _compat.collectives_issued()))
        return counts

    (before0, after0), (before1, after1) = count()
    assert before0 == before1 and after0 == after1 and after0 - before0 == 2


@pytest.mark.unit
def test_batches_drawn_is_the_count_a_loaders_iterator_has_yielded_this_pass():
    iterator = iter(DataLoader(list(range(10)), batch_size=2))
    assert _compat.batches_drawn(iterator) == 0
    next(iterator), next(iterator)
    assert _compat.batches_drawn(iterator) == 2


@pytest.mark.unit
def test_version_moves_when_a_gradient_accumulates_in_place():
    grad = torch.zeros(3)
    before = _compat.version(grad)
    grad.add_(1.0)
    assert _compat.version(grad) == before + 1


def test_a_persistent_iterator_takes_the_order_of_its_next_pass():
    data = list(range(6))
    loader = torch.utils.data.DataLoader(data, batch_size=3, num_workers=1, persistent_workers=True)
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5]]
    iterator = _compat.loader_iterator(loader)
    reversed_order = torch.utils.data.BatchSampler([5, 4, 3, 2, 1, 0], 3, False)
    object.__setattr__(loader, "batch_sampler", reversed_order)
    _compat.set_iterator_order(iterator, reversed_order)
    assert [b.tolist() for b in loader] == [[5, 4, 3], [2, 1, 0]]
    assert _compat.loader_iterator(loader) is iterator  # the same workers, the new order
    del loader, iterator


@pytest.mark.unit
def test_device_context_is_what_set_default_device_and_a_device_block_make():
    made = []
    context = _compat.device_context()
    original = context.__init__

    def record(self, device):
        made.append(str(device))
        original(self, device)

    context.__init__ = record
    try:
        with torch.device("meta"):
            assert torch.empty(1).device.type == "meta"
        torch.set_default_device("meta")
        try:
            assert torch.empty(1).device.type == "meta"
        finally:
            torch.set_default_device(None)
    finally:
        context.__init__ = original
    assert made == ["meta", "meta"]


@pytest.mark.unit
def test_loss_reduction_reads_a_losss_graph_through_scalings():
    import torch.nn.functional as F

    out, y = torch.randn(4, 3, requires_grad=True), torch.tensor([0, 1, 2, 0])
    assert _compat.losses.loss_reduction(F.cross_entropy(out, y)) == "mean"
    assert _compat.losses.loss_reduction(F.cross_entropy(out, y, reduction="sum") / 2) == "sum"
    assert _compat.losses.loss_reduction(F.mse_loss(out, torch.zeros(4, 3), reduction="sum")) == "sum"
    assert _compat.losses.loss_reduction((out**2).sum()) == "sum"
    assert _compat.losses.loss_reduction((out**2).mean() * 0.5) == "mean"
    assert _compat.losses.loss_reduction(out.sum() + out.mean()) is None  # (not said: no warning)
    assert (
        _compat.losses.loss_reduction(F.cross_entropy(out, y, reduction="sum") + (out**2).sum() * 0.5)
        == "sum"
    )
    assert _compat.losses.loss_reduction(F.cross_entropy(out, y) + (out**2).mean()) == "mean"
    weights = torch.tensor([1.0, 2.0, 3.0])
    assert _compat.losses.loss_reduction(F.cross_entropy(out, y, weight=weights)) == "weighted mean"
    assert (
        _compat.losses.loss_reduction(F.cross_entropy(out, torch.tensor([0, 1, -100, 0]))) == "weighted mean"
    )
    assert _compat.losses.loss_reduction(F.cross_entropy(out, y, ignore_index=7)) == "mean"  # none ignored
    assert _compat.losses.loss_reduction(torch.tensor(1.0)) is None


#: A torchrun-style script whose rank 0 prints from a thread while gloo connects a new group.
GROUPS = """
import threading, time
import torch.distributed as dist

dist.init_process_group("gloo")
print("before", flush=True)
if dist.get_rank() == 0:  # printed while new_group waits for rank 1 (gloo connects inside it)
    threading.Timer(0.5, print, ("from a thread",), {"flush": True}).start()
else:
    time.sleep(1.5)
dist.barrier(group=dist.new_group([0, 1]))
print("after", flush=True)
"""


def test_gloo_connection_lines_stay_out_of_the_users_stdout(tmp_path):
    assert _compat.releases.release("2.10.0+cu128") == (2, 10) and _compat.releases.release("2.8.0") == (2, 8)
    low, high = gloo_lines.GLOO_PRINTS_CONNECTIONS
    assert low == (2, 8) and high == (2, 11)  # torch 2.11's gloo logs the line at INFO, unseen
    assert gloo_lines.GLOO_LINE.match(b"[Gloo] Rank 1 is NOT connected to: [0]\n")
    script = tmp_path / "groups.py"
    script.write_text(GROUPS)
    done = run_python(["-m", "autoddp.cli", "-n", "2", "-q", str(script)], cwd=tmp_path, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["before", "from a thread", "after"], done.stdout  # (2.8-2.10: 2 more)


def test_the_supported_range_starts_at_the_floor_and_says_what_each_range_lacks():
    from click.testing import CliRunner

    from autoddp.cli import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "setup.cfg")) as file:
        assert "torch>=2.4\n" in file.read() and _compat.releases.SUPPORTED[0][0] == (2, 4)
    with open(os.path.join(root, "README.md")) as file:
        assert 'Supported torch: 2.4 and newer; `strategy="fsdp"` (FSDP2) needs 2.6' in file.read()
    assert (
        _compat.releases.support_verdict("2.3.1") == "unsupported: autoddp needs torch >= 2.4; upgrade torch"
    )
    assert "without strategy='fsdp' (FSDP2 needs torch >= 2.6 on GPUs" in _compat.releases.support_verdict(
        "2.4.1"
    )
    assert "without strategy='fsdp' on CPU/gloo" in _compat.releases.support_verdict("2.6.0+cu124")
    assert (
        _compat.releases.support_verdict("2.7.0")
        == _compat.releases.support_verdict("2.15.0")
        == "supported, every feature"
    )
    assert _compat.releases.support_verdict("2.16.0").endswith("newer than 2.15, the newest tested")
    report = CliRunner().invoke(main, ["env"]).output
    said = f"torch {torch.__version__} ({_compat.releases.support_verdict()})"
    assert said in " ".join(report.split()), report  # (a long verdict wraps onto the next line)


# --- the torch releases that changed something: each line checked on the side this torch is -------


@pytest.mark.unit
def test_torch_at_least_reads_the_installed_release():
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    assert _compat.releases.torch_at_least((major, minor)) and _compat.releases.torch_at_least((2, 4))
    assert not _compat.releases.torch_at_least((major, minor + 1)) and not _compat.releases.torch_at_least(
        (major + 1, 0)
    )


@pytest.mark.unit
def test_a_store_takes_over_a_bound_socket_with_what_this_torch_needs():
    import socket

    def store_on(listener, **extra):
        port = listener.getsockname()[1]
        return dist.TCPStore(
            "127.0.0.1", port, 1, True, wait_for_workers=False, master_listen_fd=listener.fileno(), **extra
        )

    listener = socket.create_server(("127.0.0.1", 0))
    store = store_on(listener, **_compat.store_listening_on_socket())
    listener.detach()  # (the store owns the socket now)
    store.set("k", "v")
    assert store.get("k") == b"v"
    del store
    if not _compat.releases.torch_at_least(
        _compat.releases.LIBUV_LISTEN_FD
    ):  # the default backend refuses one here
        assert _compat.store_listening_on_socket() == {"use_libuv": False}
        with socket.create_server(("127.0.0.1", 0)) as listener, pytest.raises(NotImplementedError):
            store_on(listener)
    else:
        assert _compat.store_listening_on_socket() == {}


@pytest.mark.unit
def test_a_taken_port_is_the_error_this_torch_raises_for_it():
    import datetime
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        url = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="EADDRINUSE") as raised:
            next(dist.rendezvous(url, 0, 2, timeout=datetime.timedelta(seconds=5)))
    assert isinstance(raised.value, _compat.store_address_in_use())
    if _compat.releases.torch_at_least(_compat.releases.STORE_ERRORS_TYPED):
        assert _compat.store_address_in_use() is dist.DistNetworkError
    elif not _compat.releases.torch_at_least((2, 7)):  # (2.7 to 2.9 unchecked: RuntimeError is its base)
        assert type(raised.value) is RuntimeError


@pytest.mark.unit
def test_the_accelerator_module_where_torch_has_one():
    if _compat.releases.torch_at_least(_compat.releases.ACCELERATOR):
        assert _compat.accelerator() is torch.accelerator
    else:
        assert _compat.accelerator() is None and not hasattr(torch, "accelerator")


@pytest.mark.unit
def test_fsdp2_is_said_missing_exactly_where_torch_lacks_it():
    from torch.distributed import fsdp

    has_fully_shard = hasattr(fsdp, "fully_shard")
    stream_records = hasattr(torch.cpu.Stream, "record_event")
    assert _compat.releases.torch_at_least(_compat.releases.FSDP2) == has_fully_shard
    assert _compat.releases.torch_at_least(_compat.releases.FSDP2_ON_CPU) == stream_records
    if not has_fully_shard:
        assert _compat.fsdp2_release(None) == _compat.fsdp2_release("cpu") == _compat.releases.FSDP2
    elif not stream_records:
        assert (
            _compat.fsdp2_release(None) is None
            and _compat.fsdp2_release("cpu") == _compat.releases.FSDP2_ON_CPU
        )
    else:
        assert _compat.fsdp2_release(None) is _compat.fsdp2_release("cpu") is None
    needed = _compat.fsdp2_release(None if torch.cuda.device_count() else "cpu")
    if needed is not None:  # the user's error names the release
        release = re.escape(".".join(map(str, needed)))
        with pytest.raises(autoddp.ConfigurationError, match=f"from torch {release};.*'torch>={release}'"):
            autoddp.distributed(nproc=2, strategy="fsdp")


def test_a_groups_backends_outlive_it_where_dropping_it_holds_the_gil():
    @autoddp.distributed(nproc=2)
    def backends():
        group = dist.group.WORLD
        return [type(backend).__name__ for backend in _compat.backends_to_outlive(group)]

    if _compat.releases.torch_at_least(_compat.releases.GROUP_FREED_WITHOUT_GIL):
        assert backends() == []
    else:
        assert backends() == ["ProcessGroupGloo"]


@pytest.mark.unit
def test_torchrun_gives_the_signals_variable_from_its_release():
    import inspect

    from torch.distributed.launcher import api

    # (tests/launch/test_torchrun_contract.py compares the variables themselves; GLOO_LAZY_INIT's line is
    # checked by tests/in_rank/test_gpu_group.py, through the connections a lazy group holds)
    given = "TORCHELASTIC_SIGNALS_TO_HANDLE" in inspect.getsource(api)
    assert given == _compat.releases.torch_at_least(_compat.releases.TORCHRUN_SIGNALS)


@pytest.mark.unit
def test_dtensor_is_looked_for_where_this_torch_defines_it():
    import importlib

    module = importlib.import_module(_compat.DTENSOR_MODULE)
    assert module.DTensor.__module__.startswith(_compat.DTENSOR_MODULE)
    if not _compat.releases.torch_at_least((2, 5)):  # (the public module exists, without DTensor)
        assert not hasattr(importlib.import_module("torch.distributed.tensor"), "DTensor")


@pytest.mark.unit
def test_weights_only_loading_takes_a_set_from_its_release():
    import io

    buffer = io.BytesIO()
    torch.save({"kept": {1, 2}}, buffer)
    buffer.seek(0)
    if _compat.releases.torch_at_least(_compat.releases.WEIGHTS_ONLY_SETS):
        assert torch.load(buffer, weights_only=True) == {"kept": {1, 2}}
    else:
        with pytest.raises(Exception, match="builtins.set"):
            torch.load(buffer, weights_only=True)


@pytest.mark.unit
def test_fake_tensors_hold_no_memory_and_the_watch_sees_each_operations_results():
    from autoddp.core._compat import fake

    mode = fake.fake_tensor_mode()
    weight = mode.from_tensor(torch.ones(1000, 1000))
    seen: list[tuple[str, list]] = []
    with mode, fake.new_tensors_watch(lambda name, tensors: seen.append((name, tensors))):
        product = weight @ weight
        pair = torch.ones(3).chunk(2)
    assert type(product) is not torch.Tensor and product.untyped_storage().nbytes() == 4_000_000
    names = [name for name, _ in seen]
    assert names[:2] == ["aten.mm.default", "aten.ones.default"] and "aten.split.Tensor" in names
    split = seen[names.index("aten.split.Tensor")][1]
    assert seen[0][1][0] is product and len(split) == 2 and split[0] is pair[0]


@pytest.mark.unit
def test_bare_forward_is_the_forward_only_where_module_call_would_run_it_alone():
    from autoddp.core._compat.calls import bare_forward

    class OwnCall(torch.nn.Linear):
        def __call__(self, *args, **kwargs):
            return super().__call__(*args, **kwargs)

    layer = torch.nn.Linear(2, 2)
    assert bare_forward(layer, type(layer)) == layer.forward
    assert bare_forward(OwnCall(2, 2), OwnCall) is None  # a class with its own __call__
    for register in ("register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook"):
        handle = getattr(layer, register)(lambda *args: None)
        assert bare_forward(layer, type(layer)) is None, register
        handle.remove()
    for register in (
        "register_module_forward_pre_hook",
        "register_module_forward_hook",
        "register_module_full_backward_hook",
        "register_module_full_backward_pre_hook",
    ):
        handle = getattr(torch.nn.modules.module, register)(lambda *args: None)
        assert bare_forward(layer, type(layer)) is None, register
        handle.remove()
    assert bare_forward(layer, type(layer)) == layer.forward
    layer.compile(backend="eager")  # (Module.compile(): its compiled call, lazily built, is what runs)
    assert bare_forward(layer, type(layer)) is None
    plain = torch.nn.Linear(2, 2)
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = plain

        def forward(self, x):
            seen.append(bare_forward(self.inner, type(self.inner)))
            return self.inner(x)

    torch.jit.trace(Probe(), torch.ones(1, 2), check_trace=False)  # traced: torch's call records it
    assert seen == [None]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_names_used(path) -> dict[str, int]:
    """The private names a module reaches: attributes, getattr/setattr/_need strings, and dotted
    module names (imported, or spelled in a string), each with a line it is on."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Attribute) and _private(node.attr):
            names = [node.attr]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "_need")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            names = [node.args[1].value]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            names = [node.value] if node.value.startswith("torch.") else []
        for name in names:
            if (name.startswith(("torch", "atexit")) and any(_private(part) for part in name.split("."))) or (
                "." not in name and _private(name)
            ):
                found.setdefault(name, node.lineno)
    return found


def _defined_by_autoddp(package) -> set[str]:
    """Private names autoddp defines itself: its functions, classes, variables, arguments and
    ``self._x`` attributes (an attribute set on another object is not a definition)."""
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[-1])
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
            ):
                names.add(node.attr)
    return {n for n in names if _private(n)}


@pytest.mark.unit
def test_the_engine_call_runs_every_backward_and_grad_whatever_name_reached_them(monkeypatch):
    """``engine.engine_call``: ``backward`` and ``grad`` both run their pass through it, also under a
    name bound before it was replaced, saying whether the pass accumulates into ``.grad`` and the
    ``inputs`` it was given."""
    from torch.autograd import backward as bound_backward
    from torch.autograd import grad as bound_grad

    from autoddp.core._compat import engine

    owner, name = engine.engine_call()
    original, seen = getattr(owner, name), []

    def recording(outputs, *args, **kwargs):
        seen.append((engine.accumulates(kwargs), engine.inputs(args)))
        return original(outputs, *args, **kwargs)

    monkeypatch.setattr(owner, name, recording)
    x = torch.ones(2, requires_grad=True)
    (x * 2).sum().backward()
    bound_grad((x * 3).sum(), x)
    bound_backward((x * 4).sum(), retain_graph=True)
    torch.autograd.grad((x * 5).sum(), x, create_graph=True)
    torch.autograd.grad((x * 6).sum(), x, retain_graph=True)
    assert seen == [(True, ()), (False, (x,)), (True, ()), (False, (x,)), (False, (x,))]
    (x * 7).sum().backward(inputs=[x])
    assert seen[-1] == (True, (x,))
    monkeypatch.setattr(owner, name, original)
    monkeypatch.delattr(owner, name)
    with pytest.raises(TorchCompatibilityError, match="_engine_run_backward"):
        engine.engine_call()


def test_an_output_hooked_without_a_handle_is_called_once_per_pass_beside_the_users_hooks():
    """``tensor_hooks.hook_output``: the hook runs once for each backward or ``grad`` pass reaching the
    tensor, whatever else hooks it later (the user's ``register_hook``, removable, changing the
    gradient); a leaf or a tensor hooked before takes ``register_hook``."""
    from autoddp.core._compat import tensor_hooks

    weight = torch.ones(3, requires_grad=True)
    seen = []
    out = weight * 2
    tensor_hooks.hook_output(out, lambda grad: seen.append(grad.clone()))
    assert out._backward_hooks is not None and tensor_hooks.KEY in out._backward_hooks
    removed = out.register_hook(lambda grad: grad * 100)
    out.register_hook(lambda grad: grad * 3)
    removed.remove()
    out.sum().backward(retain_graph=True)
    assert len(seen) == 1 and torch.equal(weight.grad, torch.full((3,), 6.0))
    (grad,) = torch.autograd.grad(out.sum(), weight)
    assert len(seen) == 2 and torch.equal(grad, torch.full((3,), 6.0))
    assert all(torch.equal(g, torch.ones(3)) for g in seen)  # before the user's hooks changed it
    leaf, hooked = torch.ones(2, requires_grad=True), weight * 5
    hooked.register_hook(lambda grad: seen.append("user's first"))
    tensor_hooks.hook_output(leaf, lambda grad: seen.append("leaf"))
    tensor_hooks.hook_output(hooked, lambda grad: seen.append("hooked"))
    (leaf.sum() + hooked.sum()).backward()
    assert sorted(map(str, seen[2:])) == ["hooked", "leaf", "user's first"]


UNUSED = """
import torch, torch.distributed as dist
from autoddp.core._compat import ddp_errors

dist.init_process_group("gloo")
model = torch.nn.ModuleDict({"frozen": torch.nn.Linear(2, 2), "used": torch.nn.Linear(2, 2),
                             "unused": torch.nn.Linear(2, 1)})
model["frozen"].requires_grad_(False)
forward = lambda x: model["used"](model["frozen"](x))
ddp = torch.nn.parallel.DistributedDataParallel(model)
ddp.module.forward = forward
for _ in range(2):
    try:
        ddp(torch.ones(1, 2)).sum().backward()
    except RuntimeError as error:
        print(ddp_errors.unused_parameters(error, model))
"""


def test_the_parameters_ddp_says_got_no_gradient_are_read_from_its_message(tmp_path):
    """``ddp_errors.unused_parameters``: DDP's error lists them by index among the parameters that
    require a gradient; read back as names, frozen ones skipped."""
    from autoddp.core._compat import ddp_errors

    script = tmp_path / "unused.py"
    script.write_text(UNUSED)
    done = run_python(["-m", "torch.distributed.run", "--nproc-per-node", "1", str(script)], timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['unused.weight', 'unused.bias']", done.stdout
    assert ddp_errors.unused_parameters(RuntimeError("another error"), torch.nn.Linear(1, 1)) is None


def test_the_cpu_allocator_running_out_of_memory_is_read_from_its_message():
    """``memory_errors.cpu_out_of_memory``: torch's CPU allocator refusing an allocation (a
    petabyte here: no machine overcommits that) raises what ``strategy="auto"`` restarts on."""
    from autoddp.core._compat import memory_errors

    with pytest.raises(RuntimeError) as refused:
        torch.empty(2**50, dtype=torch.uint8)
    assert memory_errors.cpu_out_of_memory(refused.value), str(refused.value)
    assert not memory_errors.cpu_out_of_memory(RuntimeError("another error"))
    assert not memory_errors.cpu_out_of_memory(ValueError("DefaultCPUAllocator: not enough memory"))


def test_private_names_are_reached_from_compat_only_and_listed_there():
    """The inventory in ``_compat.names`` is the code's: every private torch (or CPython) name is
    used in ``autoddp/core/_compat`` only, each one used there is listed, and each listed is used."""
    from autoddp.core._compat import names

    package = pathlib.Path(autoddp.__file__).parent
    compat = package / "core" / "_compat"
    own = _defined_by_autoddp(package) - {n.rsplit(".", 1)[-1] for n in names.PRIVATE}
    listed = {n.rsplit(".", 1)[-1] for n in names.PRIVATE} | set(names.PRIVATE)
    outside, unlisted, used = [], [], set()
    for path in sorted(p for p in package.rglob("*.py") if p != compat / "names.py"):
        for name, line in _private_names_used(path).items():
            last = name.rsplit(".", 1)[-1]
            if last in own or last.startswith("_autoddp") or last in names.CPYTHON_ANYWHERE:
                continue
            where = f"{path.relative_to(package)}:{line}: {name}"
            if compat not in path.parents:
                outside.append(where)
            elif name in listed or last in listed:
                used.update({name, last})
            else:
                unlisted.append(where)
    assert outside == [], f"private names outside autoddp/core/_compat: {outside}"
    assert unlisted == [], f"private names used in _compat and missing from _compat.names.PRIVATE: {unlisted}"
    compat_text = "".join(p.read_text() for p in compat.glob("*.py") if p.name != "names.py")
    stale = [n for n in names.PRIVATE if n.rsplit(".", 1)[-1] not in compat_text]
    assert stale == [], f"listed in _compat.names.PRIVATE, used nowhere: {stale}"


REPLACED = """
import json, torch, torch.distributed.distributed_c10d as c10d
from autoddp.core._compat import gloo_lines, watch_parameter_changes
from autoddp.in_rank import models
from autoddp.in_rank.world import stdout

owners = {"torch.nn.Parameter": torch.nn.Parameter, "torch.nn.Module": torch.nn.Module,
          "torch.utils": torch.utils, "torch.distributed.distributed_c10d": c10d,
          "torch.Tensor": torch.Tensor, "torch._C.TensorBase": torch._C.TensorBase,
          "torch.autograd": torch.autograd}
before = {k: dict(vars(v)) for k, v in owners.items()}
watch_parameter_changes(lambda: None)
gloo_lines.quiet_gloo_connections(stdout.without_lines)
engine_call = torch.autograd._engine_run_backward
models.count_passes()
models.count_passes()  # (once only)
assert torch.autograd._engine_run_backward.__wrapped__ is engine_call
changed = sorted(f"{k}.{name}" for k, v in owners.items() for name, value in vars(v).items()
                 if not name.startswith("_autoddp") and before[k].get(name, None) is not value)
print(json.dumps(changed))
"""


def test_what_is_replaced_for_the_life_of_the_process_is_the_listed():
    """The three installers that never restore replace exactly what ``_compat.names`` lists
    (gloo's group helper only where that torch prints gloo's lines)."""
    from autoddp.core._compat import gloo_lines, names

    done = run_python(["-c", REPLACED])
    assert done.returncode == 0, done.stderr
    expected = set(names.REPLACED_FOR_THE_PROCESS)
    low, high = gloo_lines.GLOO_PRINTS_CONNECTIONS
    if not low <= _compat.releases.release() < high:
        expected.discard("torch.distributed.distributed_c10d._new_process_group_helper")
    assert set(json.loads(done.stdout)) == expected


@pytest.mark.unit
def test_every_binding_of_a_collective_is_a_site_and_dtensor_gathers_through_functional_ones():
    """``collectives.sites``: the functional collectives DTensor's full_tensor uses exist here, and a
    collective bound under a module of its own (DTensor's helpers import broadcast) is found."""
    import torch.distributed.tensor  # noqa: F401 (binds some collectives in its own modules)

    from autoddp.core._compat import collectives

    funcol = collectives.functional()
    assert callable(vars(funcol)[collectives.FUNCTIONAL_WAIT])
    sites = collectives.sites()
    functional = {name for module, _, name, is_functional in sites if is_functional and module is funcol}
    assert {"all_gather_tensor", "all_reduce", "reduce_scatter_tensor"} <= functional
    found = {(id(module), attribute) for module, attribute, _, _ in sites}
    c10d = dist.distributed_c10d
    originals = {id(getattr(c10d, name)) for name in _compat.COLLECTIVES if hasattr(c10d, name)}
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and module is not None:
            for attribute, value in vars(module).items():
                if id(value) in originals:
                    assert (id(module), attribute) in found, f"{name}.{attribute}"


@pytest.mark.unit
def test_weight_of_mean_reads_what_a_cross_entropy_divides_by():
    """``_compat.losses.weight_of_mean`` reads the NLL node's saved target, ignore_index and weight:
    a torch that renames them fails here (and the split at the model's call then weighs a model's
    loss by its rows, which the first call's check compares)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    out = torch.randn(6, 3, requires_grad=True)
    y = torch.tensor([0, 1, 2, -100, 1, -100])
    assert float(_compat.losses.weight_of_mean(F.cross_entropy(out, y))) == 4.0
    assert float(_compat.losses.weight_of_mean(F.cross_entropy(out, y.clamp(min=0)) / 2)) == 6.0
    weights = torch.tensor([1.0, 2.0, 3.0])
    assert float(_compat.losses.weight_of_mean(F.cross_entropy(out, y, weight=weights))) == 1 + 2 + 3 + 2
    assert float(_compat.losses.weight_of_mean(F.cross_entropy(out, y.clamp(min=0), ignore_index=1))) == 4.0
    assert _compat.losses.weight_of_mean(F.cross_entropy(out, y, reduction="sum")) is None
    assert _compat.losses.weight_of_mean((out**2).mean()) is None
