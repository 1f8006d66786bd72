"""strategy="fsdp" under a script's own plain code: what it reads of the sharded weights is one
process's, and the gathers a sharded model needs are refused inside ``rank0()`` and named by the
hang report under ``if autoddp.is_main():`` (issue 38).

Real 2-process gloo runs on CPU, each compared with the same function run in this one process.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import autoddp
from autoddp import CollectiveInRank0Error, Rank0Error
from conftest import FSDP_MISSING, run_python, write

if FSDP_MISSING:
    pytest.skip(FSDP_MISSING, allow_module_level=True)

pytestmark = pytest.mark.timeout(120)


def _trained() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A small model (3 rows: an uneven shard on 2 ranks) after one SGD step on one batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt, x


def reads_and_copies() -> dict:
    """The reads, comparisons, exports and EMA copies a plain script makes of its weights."""
    model, opt, x = _trained()
    ema = copy.deepcopy(model)  # an EMA model
    kept = [torch.zeros(p.shape) for p in model.parameters()]  # plain copies, updated in place
    for _ in range(3):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
            for k, p in zip(kept, model.parameters(), strict=True):
                k.copy_(p)
    w = model[0].weight
    return {
        "flatten": w.detach().flatten().tolist(),
        "rows": [row.tolist() for row in w],  # iteration
        "tolist": w.tolist(),
        "numpy": w.detach().numpy().tolist(),
        "equal": torch.equal(w, torch.tensor(w.tolist())),
        "close": torch.allclose(w.detach().flatten(), torch.tensor(w.tolist()).flatten()),
        "ema": [p.tolist() for p in ema.parameters()],
        "ema_class": type(ema).__name__,
        "ema_out": ema(x).tolist(),
        "kept": [k.tolist() for k in kept],
    }


def penalties_and_writes() -> dict:
    """A weight penalty added to the loss, gradients clipped, and weights written from plain tensors."""
    model, opt, x = _trained()
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(12.0).reshape(3, 4) / 10)
        model[0].bias.add_(torch.ones(3))
    norms = []
    for _ in range(2):
        penalty = sum(p.pow(2).sum() for p in model.parameters()) + model[0].weight.flatten().abs().sum()
        loss = model(x).pow(2).mean() + 0.01 * penalty
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    weights = [p.tolist() for p in model.parameters()]
    try:  # one process writes into the weight through the view; a gathered copy must not take it
        model[0].weight.detach().flatten()[0] = 5.0
        written = "written"
    except RuntimeError:
        written = "refused"
    return {"weights": weights, "norms": norms, "view_write": written}


def _flat(value) -> list:
    """Nested lists of numbers as one flat list (pytest.approx compares flat ones)."""
    if isinstance(value, list):
        return [item for each in value for item in _flat(each)]
    return [value]


_sharded_reads = autoddp.distributed(nproc=2, strategy="fsdp", backend="gloo", timeout=60)(reads_and_copies)
_sharded_writes = autoddp.distributed(nproc=2, strategy="fsdp", backend="gloo", timeout=60)(
    penalties_and_writes
)


def test_reads_iteration_comparisons_and_ema_copies_of_sharded_weights_are_one_processs():
    one, two = reads_and_copies(), _sharded_reads()
    assert one["ema_class"] == two["ema_class"] == "Sequential"  # a plain copy, as deepcopy gives
    for key in one:
        assert _flat(two[key]) == pytest.approx(_flat(one[key]), abs=1e-6), key


def test_a_weight_penalty_and_writes_from_plain_tensors_train_as_one_process():
    one, two = penalties_and_writes(), _sharded_writes()
    assert _flat(two["weights"]) == pytest.approx(_flat(one["weights"]), abs=1e-6)
    assert two["norms"] == pytest.approx(one["norms"], abs=1e-6)
    assert one["view_write"] == "written"
    # A write through a view of a gathered copy would be lost: it raises instead.
    assert two["view_write"] == "refused"


@autoddp.distributed(nproc=2, strategy="fsdp", backend="gloo", timeout=30)
def _gathers_in_rank0(folder: str) -> None:
    model, _, _ = _trained()
    calls = {
        "autoddp.save": lambda: autoddp.save(model, f"{folder}/m.pt"),
        "torch.save": lambda: torch.save(model.state_dict(), f"{folder}/sd.pt"),
        "flatten": lambda: print(model[0].weight.detach().flatten()),
        "deepcopy": lambda: copy.deepcopy(model),
    }
    outcomes = {}
    for name, call in calls.items():
        try:
            with autoddp.rank0():
                call()
            outcomes[name] = ["none", ""]
        except (CollectiveInRank0Error, Rank0Error) as exc:
            outcomes[name] = [type(exc).__name__, str(exc)]
    autoddp.save(model, f"{folder}/after.pt")  # outside the block: gathers on every rank
    with open(f"{folder}/rank{autoddp.rank()}.json", "w") as f:
        json.dump(outcomes, f)


def test_fsdp_gathers_inside_rank0_are_refused_at_once_with_the_fix(tmp_path):
    _gathers_in_rank0(str(tmp_path))  # within the 30 s timeout: no gather waited for rank 1
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    for name in ("autoddp.save", "torch.save", "flatten", "deepcopy"):
        kind, text = r0[name]
        assert kind == "CollectiveInRank0Error", (name, r0[name])
        assert "only rank 0 runs that body" in text
        assert "call autoddp.save(model, path) outside the block" in text, text
        assert r1[name][0] == "Rank0Error" and "CollectiveInRank0Error" in r1[name][1], r1[name]
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "sd.pt").exists()
    reference, _, _ = _trained()
    saved = torch.load(tmp_path / "after.pt")
    assert saved.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.allclose(saved[key], value, atol=1e-6), key


def test_an_fsdp_gather_on_rank_0_alone_is_named_by_the_hang_report_and_the_run_ends(tmp_path):
    script = write(
        tmp_path / "job.py",
        """
        import torch, torch.nn as nn
        import autoddp

        @autoddp.distributed(nproc=2, strategy="fsdp", backend="gloo", timeout=12, hang_report=3)
        def train():
            model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            if autoddp.is_main():
                autoddp.save(model, "model.pt")
            return "done"

        print("result", train())
        """,
    )
    run = run_python([str(script)], cwd=tmp_path, timeout=90)
    assert run.returncode != 0 and "result done" not in run.stdout
    line = next(
        n
        for n, text in enumerate(script.read_text().splitlines(), 1)
        if 'autoddp.save(model, "model.pt")' in text
    )
    reports = [text for text in run.stderr.splitlines() if "hang report" in text]
    assert reports, run.stderr
    assert f"rank 1 has not arrived; rank 0 waits in all_gather_single at job.py:{line}" in reports[0], (
        reports
    )
    assert "timed out" in run.stderr
