"""The one patch engine (``autoddp.core._patches``): units install and restore exactly, nest in any order,
leave someone else's replacement alone; and after every kind of run torch is exactly as before.

The attributes checked after the runs come from the engine's own registry of everything it ever
patched, so a patch added later is covered without touching these tests.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os

import pytest
import torch
from helpers import defining_value, fork_or_skip, free_port, inspected, reports, signature_faults

import autoddp
from autoddp.core import _patches
from conftest import needs_fsdp, run_python, write


class Owner:
    """A namespace to patch (a class, as torch's are)."""

    def method(self) -> str:
        return "original"

    @staticmethod
    def helper() -> str:
        return "original"


class Child(Owner):
    """Inherits ``method``: patching it on the child must not copy the parent's onto it."""


def replacement(text: str):
    def method(self=None) -> str:
        return text

    return method


@pytest.mark.unit
def test_a_unit_restores_exactly_and_only_once():
    own, static = vars(Owner)["method"], vars(Owner)["helper"]
    unit = _patches.install([(Owner, "method", replacement("a")), (Owner, "helper", replacement("b"))])
    assert Owner().method() == "a" and Owner.helper() == "b"
    unit.restore()
    assert vars(Owner)["method"] is own and vars(Owner)["helper"] is static  # the staticmethod itself
    unit.restore()  # idempotent
    assert vars(Owner)["method"] is own
    with _patches.Patches([(Child, "method", replacement("c"))]):
        assert Child().method() == "c"
    assert "method" not in vars(Child) and Child().method() == "original"  # inherited again


@pytest.mark.unit
@pytest.mark.parametrize("first", ["inner", "outer"])
def test_nested_units_restored_in_either_order_leave_the_original(first):
    own = vars(Owner)["method"]
    outer = _patches.install([(Owner, "method", replacement("outer"))])
    inner = _patches.install([(Owner, "method", replacement("inner"))])
    assert Owner().method() == "inner"
    (inner if first == "inner" else outer).restore()
    assert Owner().method() == ("outer" if first == "inner" else "inner")  # the other still stands
    (outer if first == "inner" else inner).restore()
    assert vars(Owner)["method"] is own


@pytest.mark.unit
def test_an_inner_unit_restored_first_gives_the_outer_replacement_back_exactly():
    outer_method = replacement("outer")
    with _patches.Patches([(Owner, "method", outer_method)]):
        with _patches.Patches([(Owner, "method", replacement("inner"))]):
            pass
        assert vars(Owner)["method"] is outer_method


@pytest.mark.unit
def test_someone_elses_replacement_is_kept():
    own = vars(Owner)["method"]
    theirs = replacement("theirs")
    try:
        unit = _patches.install([(Owner, "method", replacement("ours"))])
        Owner.method = theirs  # the user's code, or another library, while ours stands
        unit.restore()
        assert vars(Owner)["method"] is theirs
        # an outer unit of ours under theirs, restored first: theirs still stands at the end
        outer = _patches.install([(Owner, "method", replacement("outer"))])
        Owner.method = theirs
        inner = _patches.install([(Owner, "method", replacement("inner"))])
        outer.restore()
        inner.restore()
        assert vars(Owner)["method"] is theirs
    finally:
        Owner.method = own


@pytest.mark.unit
def test_an_install_that_fails_halfway_leaves_nothing():
    own = vars(Owner)["method"]

    def patches():
        yield Owner, "method", replacement("half")
        raise RuntimeError("made while installing")

    with pytest.raises(RuntimeError):
        _patches.install(patches())
    assert vars(Owner)["method"] is own
    assert (Owner, "method") not in _patches.active()


@pytest.mark.unit
def test_capture_device_habits_leave_torch_as_it_was():
    # (their patches are made on a machine with GPUs; installing them touches no GPU)
    from autoddp.core.state import World
    from autoddp.in_rank.capture.devices import Devices

    devices = Devices(World(world_size=2, local_world_size=2), lambda: None)
    devices.own = 0
    devices.install()
    replaced = _patches.active()
    assert (torch.Tensor, "to") in replaced and (torch.cuda, "set_device") in replaced
    assert "to" in vars(torch.Tensor)  # on the class itself while installed
    devices.uninstall()
    assert "to" not in vars(torch.Tensor)  # inherited from torch._C.TensorBase again, not copied
    assert _patches.active() == [] and _patches.unrestored() == []


# --- after every kind of run, torch is exactly as it was ----------------------------------------

seen: set[str] = set()  # what some unit replaced while the user's code ran (in an in-place process)


def _note() -> None:
    seen.update(_patches.label(owner, name) for owner, name in _patches.active())


def _train() -> None:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 2)).sum().backward()
    opt.step()
    _note()


@autoddp.distributed
def succeeds():
    _train()


@autoddp.distributed
def raises():
    _train()
    raise KeyError("planned")


@autoddp.distributed
def inner():
    _train()


@autoddp.distributed
def nested():
    _train()
    inner()


@autoddp.distributed
def rank0_raises():
    _train()
    with autoddp.rank0():
        _note()
        raise KeyError("planned in rank0")


def _in_place_kinds(rank: int, port: int, folder: str) -> None:
    """One process of a torchrun-style world, watched by a hang folder: every kind of in-place call."""
    code = 1
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), AUTODDP_HANG_FOLDER=folder)
        left = {}
        for kind in (succeeds, raises, nested, rank0_raises):
            with contextlib.suppress(Exception):
                kind()
            left[kind.__name__] = _patches.unrestored()
        report = {"left": left, "seen": sorted(seen), "patched": len(_patches.ever_patched())}
        with open(os.path.join(folder, f"in_place{rank}.json"), "w") as file:
            json.dump(report, file)
        code = 0
    finally:
        os._exit(code)  # (a fork of pytest: none of its exit handlers)


@autoddp.distributed(nproc=2, start_method="fork")
def _forked_training(folder: str):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 2)).sum().backward()
    opt.step()
    inner()  # a nested decorated call, in place in the worker
    with open(os.path.join(folder, f"during{os.environ['RANK']}.json"), "w") as file:
        json.dump(sorted(_patches.label(o, n) for o, n in _patches.active()), file)
    return inspected(folder)


@pytest.mark.timeout(120)
def test_after_every_kind_of_run_every_patched_attribute_is_the_original(tmp_path):
    fork_or_skip()  # (a CUDA build after an in-process compile: autoddp refuses fork, said)
    # Two processes forked from this one make a torchrun-style world of in-place calls, while
    # a decorated call beside them forks its own two workers.
    in_place = [
        multiprocessing.get_context("fork").Process(target=_in_place_kinds, args=(rank, port, str(tmp_path)))
        for port in [free_port()]
        for rank in (0, 1)
    ]
    for process in in_place:
        process.start()
    try:
        forked = tmp_path / "forked"
        forked.mkdir()
        assert torch.equal(_forked_training(str(forked)), torch.zeros(1))
        assert _patches.unrestored() == []  # in the caller
        for rank, report in enumerate(reports(str(forked))):
            during = json.loads((forked / f"during{rank}.json").read_text())
            assert "torch.save" in during and "torch.distributed.all_reduce" in during  # capture, marks
            assert report["active"] == [] and report["unrestored"] == [], report
            assert set(during) <= set(report["patched"])
        for process in in_place:
            process.join(timeout=90)
    finally:
        for process in in_place:
            process.kill()
            process.join()
    assert [process.exitcode for process in in_place] == [0, 0]
    results = [json.loads((tmp_path / f"in_place{rank}.json").read_text()) for rank in (0, 1)]
    kinds = ("succeeds", "raises", "nested", "rank0_raises")
    for result in results:
        assert result["left"] == {kind: [] for kind in kinds}, result
        seen = set(result["seen"])
        assert {"torch.save", "torch.utils.data.dataloader.DataLoader.__iter__"} <= seen  # capture's
        assert {"torch.autograd.backward", "torch.distributed.all_reduce"} <= seen  # the hang marks'
        assert result["patched"] >= len(seen)
    # rank 0 ran the rank0() block, with the collectives refused (autoddp.barrier only there)
    assert "autoddp.barrier" in results[0]["seen"] and "autoddp.barrier" not in results[1]["seen"]


# --- every wrapper takes the call exactly as the original does ----------------------------------

#: Run under ``autoddp -n 2``: note every replacement autoddp has in place when the script starts
#: (capture, the hang marks, the kept groups) and every one a unit installs later (rank0()'s
#: refusals, FSDP's whole reads), train through the paths that install them, make a DDP by
#: keyword as Lightning does, then check each against the original (``signature_faults``).
SIGNATURES = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
import autoddp
from autoddp.core import _compat, _patches
from autoddp.core._compat import names
from helpers import defining_value, signature_faults

seen = {{}}

def note(owner, name, replacement, before):
    seen.setdefault(_patches.label(owner, name), []).append((owner, name, replacement, before))

for owner, name, replacement, before in _patches.replacements():
    note(owner, name, replacement, before)
install = _patches.Patches.install

def recording(self, patches):
    patches = list(patches)
    for owner, name, replacement in patches:
        note(owner, name, replacement, vars(owner).get(name, _patches.MISSING))
    return install(self, patches)

_patches.Patches.install = recording
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(params=model.parameters(), lr=0.1)  # (capture distributes it here)
model(torch.ones(2, 4)).mean().backward()
opt.step()
print(model[0].weight.sum().item())  # (FSDP: a whole read)
with autoddp.rank0():
    pass
torch.save(obj=model.state_dict(), f=sys.argv[1] + ".pt")
if sys.argv[2] == "ddp":  # the user's own DDP, by keyword (Lightning's strategy writes it so)
    own = torch.nn.parallel.DistributedDataParallel(module=torch.nn.Linear(2, 1), device_ids=None)
    own(torch.ones(2, 2)).mean().backward()
_patches.Patches.install = install
faults = []
package = os.path.dirname(autoddp.__file__) + os.sep  # (not "autoddp" in a path: CI's venv has it)
for label, entries in seen.items():
    for owner, name, replacement, before in entries:
        faults += signature_faults(owner, name, replacement, defining_value(owner, name, before))
for dotted in names.REPLACED_FOR_THE_PROCESS:  # replaced outside the engine, for the process's life
    path, name = dotted.rsplit(".", 1)
    owner = eval(path)
    value = vars(owner).get(name)
    if getattr(value, "__wrapped__", None) is not None:
        faults += signature_faults(owner, name, value, value.__wrapped__)
    elif getattr(getattr(value, "__code__", None), "co_filename", "").startswith(package):
        faults.append(f"{{dotted}}: autoddp's replacement keeps no __wrapped__ (its original)")
    seen.setdefault(dotted, [])
patched = sorted(_patches.label(o, n) for o, n, _ in _patches.ever_patched())
report = dict(faults=faults, checked=sorted(seen), unseen=sorted(set(patched) - set(seen)))
with open(f"{{sys.argv[1]}}{{os.environ['RANK']}}.json", "w") as file:
    json.dump(report, file)
"""


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=needs_fsdp)])
def test_every_wrapper_takes_the_call_as_the_original_does(tmp_path, strategy):
    tests = os.path.dirname(os.path.dirname(__file__))  # helpers.py, at the top of tests/
    script = write(tmp_path / "signatures.py", SIGNATURES.format(tests=tests))
    out = tmp_path / "report"
    run = run_python(
        ["-m", "autoddp.cli", "-n", "2", "--strategy", strategy, str(script), str(out), strategy]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report{rank}.json").read_text())
        assert report["faults"] == [], "\n".join(report["faults"])
        assert report["unseen"] == [], f"patched, yet not checked here: {report['unseen']}"
        checked = set(report["checked"])
        assert {
            "torch.nn.parallel.distributed.DistributedDataParallel.__init__",  # marks, capture, kept groups
            "torch.optim.optimizer.Optimizer.__init__",
            "torch.save",
            "torch.distributed.all_reduce",
            "torch.utils.data.dataloader.DataLoader.__iter__",
            "torch.utils.data.dataloader._BaseDataLoaderIter.__next__",  # the step report's clock
            "torch.nn.Module._apply",  # replaced for the process's life
        } <= checked
        assert ("autoddp.barrier" in checked) == (rank == 0)  # rank0()'s refusals, on rank 0
        if strategy == "fsdp":
            assert any(label.endswith("DTensor.tolist") for label in checked)


@pytest.mark.unit
def test_device_habit_wrappers_take_the_call_as_the_original_does():
    # (installed only with GPUs: here as on a machine with one, touching no GPU)
    from autoddp.core.state import World
    from autoddp.in_rank.capture.devices import Devices

    devices = Devices(World(world_size=2, local_world_size=2), lambda: None)
    devices.own = 0
    devices.install()
    try:
        faults = [
            fault
            for owner, name, replacement, before in _patches.replacements()
            for fault in signature_faults(owner, name, replacement, defining_value(owner, name, before))
        ]
        assert len(_patches.replacements()) > 15
    finally:
        devices.uninstall()
    assert faults == [], "\n".join(faults)
