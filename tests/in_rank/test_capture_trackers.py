"""Experiment trackers make one run, rank 0's, under capture: the other ranks' make nothing.

Real 2-process gloo runs with the real packages (wandb offline, torch's and tensorboardX's
SummaryWriter, MLflow's file store; each test skips, named, where its package is missing): an
unchanged script under ``autoddp -n 2`` (the tracker imported while capture runs) and a decorated
function (imported before, in the caller), each making exactly one wandb run folder, one event
file, one MLflow run, with the values the notice says: rank 0's own batch's loss by default, the
whole batch's (one process's, step for step) under ``split_batches``.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autoddp
from autoddp.in_rank.capture._imports import Watch
from conftest import run_python, write

pytestmark = pytest.mark.timeout(150)

#: Each tracker: the module its test needs (skipped without it).
TRACKERS = {
    "wandb": "wandb",
    "tensorboard": "torch.utils.tensorboard",
    "tensorboardX": "tensorboardX",
    "mlflow": "mlflow",
}

#: Opens the tracker ``name`` in ``folder``: returns ``(log(step, value), close(), the run object)``.
#: wandb is asked for ``mode="offline"`` in the call itself (which outranks ``WANDB_MODE``).
OPEN = """
def open_tracker(name, folder):
    os.environ.update(WANDB_SILENT="true", MLFLOW_ALLOW_FILE_STORE="true")
    if name == "wandb":
        import wandb
        run = wandb.init(project="autoddp-test", dir=folder, mode="offline")
        return (lambda step, value: wandb.log({"loss": value}, step=step)), run.finish, run
    if name in ("tensorboard", "tensorboardX"):
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
        else:
            from tensorboardX import SummaryWriter
        writer = SummaryWriter(os.path.join(folder, "tb"))
        return (lambda step, value: writer.add_scalar("loss", value, step)), writer.close, writer
    import mlflow
    mlflow.set_tracking_uri("file:" + os.path.join(folder, "mlruns"))
    run = mlflow.start_run()
    run.__enter__()
    log = lambda step, value: (mlflow.log_metric("loss", value, step=step), mlflow.set_tag("t", "v"))
    return log, lambda: run.__exit__(None, None, None), run
"""

TRAIN = """
def train(log, size=32, batch=8):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(size, 4, generator=g), torch.randn(size, 1, generator=g))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, (x, y) in enumerate(DataLoader(data, batch_size=batch, shuffle=True)):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log(step, loss.item())
        losses.append(loss.item())
    return losses
"""

SCRIPT = (
    """
import json, os, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
sys.path.insert(0, TESTS)
from helpers import defining_value, signature_faults
from autoddp.core import _patches
"""
    + OPEN
    + TRAIN
    + """
folder, name = sys.argv[1], sys.argv[2]
log, close, run = open_tracker(name, folder)
losses = train(log)
close()
rank = os.environ["RANK"]
model_logged = "not asked"
if name == "mlflow" and rank != "0":  # every flavour's log_model goes through Model.log
    from mlflow.models import Model

    model_logged = Model.log(None, None, name="m")
libraries = ("wandb.", "mlflow.", "tensorboardX.", "torch.utils.tensorboard.")
faults = [  # autoddp's wrappers of the tracker take each call as the original does
    fault
    for owner, attribute, replacement, before in _patches.replacements()
    if _patches.label(owner, attribute).startswith(libraries)
    for fault in signature_faults(owner, attribute, replacement, defining_value(owner, attribute, before))
]
imported = [m for m in ("wandb", "mlflow", "tensorboardX", "torch.utils.tensorboard") if m in sys.modules]
with open(os.path.join(folder, f"rank{rank}.json"), "w") as file:
    kept = dict(losses=losses, run=type(run).__name__, faults=faults, imported=imported)
    json.dump(dict(kept, model_logged=model_logged), file)
"""
)

namespace: dict = {}
exec(
    OPEN + TRAIN,
    {"os": os, "torch": torch, "nn": nn, "DataLoader": DataLoader, "TensorDataset": TensorDataset},
    namespace,
)
open_tracker, train = namespace["open_tracker"], namespace["train"]


def _need(name: str) -> None:
    pytest.importorskip(TRACKERS[name])
    if name == "mlflow":
        pytest.importorskip("mlflow.tracking.fluent")


def runs_made(name: str, folder: Path) -> list[Path]:
    """What the tracker left in ``folder``: its run folders, event files or runs."""
    if name == "wandb":
        return sorted(p for p in (folder / "wandb").glob("*run-*") if p.is_dir())
    if name in ("tensorboard", "tensorboardX"):
        return sorted(p for p in folder.rglob("*") if "tfevents" in p.name)
    return sorted(p.parent for p in (folder / "mlruns").glob("*/*/meta.yaml"))


def logged(name: str, made: Path) -> list[float] | None:
    """The loss values the tracker recorded (None where this test does not read its files: wandb's)."""
    if name == "mlflow":
        lines = (made / "metrics" / "loss").read_text().split("\n")
        return [float(line.split()[1]) for line in lines if line.strip()]
    if name == "wandb":
        return None
    values = []
    for event in _events(made.read_bytes()):
        values += [value.simple_value for value in event.summary.value if value.tag == "loss"]
    return values


def _events(data: bytes):
    """The events of a TensorBoard event file (TFRecord frames: length, its CRC, data, its CRC)."""
    try:
        from tensorboard.compat.proto.event_pb2 import Event
    except ImportError:
        from tensorboardX.proto.event_pb2 import Event
    at = 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = Event()
        event.ParseFromString(data[at + 12 : at + 12 + length])
        yield event
        at += 12 + length + 4


def _notice_line(err: str, name: str) -> str:
    start = {"wandb": "wandb.init", "tensorboard": "SummaryWriter(", "tensorboardX": "tensorboardX.Summary"}
    lines = [line for line in err.splitlines() if line.startswith("autoddp:   " + start.get(name, "mlflow."))]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.parametrize("name", list(TRACKERS))
def test_an_unchanged_script_makes_one_run_with_rank_0s_values(tmp_path, name):
    _need(name)
    tests = os.path.dirname(os.path.dirname(__file__))  # helpers.py, at the top of tests/
    script = write(tmp_path / "train.py", SCRIPT.replace("TESTS", repr(tests), 1))
    run = run_python(
        ["-m", "autoddp.cli", "-n", "2", str(script), str(tmp_path), name], cwd=tmp_path, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    made = runs_made(name, tmp_path)
    assert len(made) == 1, made  # one process makes one run: so does the distributed run
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["faults"] == [], rank["faults"]
        assert [
            m for m in rank["imported"] if m not in (name, TRACKERS[name])
        ] == []  # none imported by autoddp
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank trained on its own batches
    values = logged(name, made[0])
    if values is not None:  # rank 0's own batch's loss, as the notice says
        assert values == pytest.approx(ranks[0]["losses"], rel=1e-6)
    line = _notice_line(run.stderr, name)
    assert "train.py:" in line and "rank 0's; the other process" in line, line
    assert "a training loss is rank 0's own batch's (one of the 2 processed at each step)" in line, line
    if name == "wandb":
        assert ranks[1]["run"] != ranks[0]["run"]  # wandb's own disabled run
    if name == "mlflow":
        assert (ranks[0]["run"], ranks[1]["run"]) == ("ActiveRun", "NoRun")
        assert ranks[1]["model_logged"] is None and not list(tmp_path.glob("mlruns/*/models/*"))


def _distributed_split(name: str, folder: str):
    @autoddp.distributed(nproc=2, split_batches=True)
    def run():
        log, close, _ = open_tracker(name, folder)
        try:
            return train(log)
        finally:
            close()

    return run()


@pytest.mark.parametrize("name", list(TRACKERS))
def test_a_decorated_function_under_split_batches_logs_the_whole_batchs_values(
    tmp_path, name, capfd, monkeypatch
):
    _need(name)
    importlib.import_module(TRACKERS[name])  # imported in the caller: before capture, in every worker
    monkeypatch.chdir(tmp_path)
    losses = _distributed_split(name, str(tmp_path))
    reference = train(lambda step, value: None)  # one process, the whole batch
    assert losses == pytest.approx(reference, rel=1e-5)
    made = runs_made(name, tmp_path)
    assert len(made) == 1, made
    values = logged(name, made[0])
    if values is not None:
        assert values == pytest.approx(reference, rel=1e-5)
    line = _notice_line(capfd.readouterr().err, name)
    assert "a loss read after its backward is the whole batch's (as one process logs it)" in line, line


@pytest.mark.unit
def test_a_watched_module_is_handed_over_once_imported_and_nothing_else_is_imported(tmp_path, monkeypatch):
    (tmp_path / "watched_pkg").mkdir()
    (tmp_path / "watched_pkg" / "__init__.py").write_text("VALUE = 1\n")
    (tmp_path / "already.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("watched_pkg", "already", "never"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    import already  # noqa: F401  (imported before the watch: handed over at its start)

    seen: list[types.ModuleType] = []
    watch = Watch(["watched_pkg", "already", "never"], seen.append)
    watch.start()
    try:
        assert [m.__name__ for m in seen] == ["already"]
        import watched_pkg

        assert seen[-1] is watched_pkg and watched_pkg.VALUE == 1
        assert type(watched_pkg.__spec__.loader).__name__ == "SourceFileLoader"  # as without the watch
        assert watched_pkg.__loader__ is watched_pkg.__spec__.loader
        watch.start()  # (again: nothing handed over twice)
        assert [m.__name__ for m in seen] == ["already", "watched_pkg"]
        assert "never" not in sys.modules
    finally:
        watch.stop()
    assert not any(type(finder).__module__ == Watch.__module__ for finder in sys.meta_path)
