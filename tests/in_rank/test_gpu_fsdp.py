"""Issue 20, FSDP: models larger than one GPU, rank 0's weights, fp16, results gathered on rank 0.

CPU stand-ins for the GPU conditions, in real 2-process gloo runs: memory is the process's own
(``/proc/self/status``: peak resident set since ``clear_refs``, anonymous resident memory), so a
rank that never holds the whole model shows it; rank 1's host copies at the end of a run are
recorded where ``.cpu()`` / ``.to("cpu")`` are called.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from test_fsdp import LR, Net, _batch, _close, _reference, _steps
from torch import nn

import autoddp
from autoddp import ConfigurationError
from autoddp.in_rank.models import _start

WIDTH, DEPTH = 1024, 16  # 16 units of 4 MiB: 64 MiB of float32 parameters
MIB = 2**20


def _big() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _status(field: str) -> int:
    """A /proc/self/status line in bytes (VmHWM: peak resident set; RssAnon: anonymous memory)."""
    with open("/proc/self/status") as file:
        return int(re.search(rf"{field}:\s+(\d+)", file.read()).group(1)) * 1024


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")  # the peak resident set starts again from the current one
    return _status("VmHWM")


def _bytes_moved_to_a_device(fn) -> int:
    """Bytes of plain tensors that ``fn`` asks ``Tensor.to`` to put on a device (each rank's own)."""
    from torch.distributed.tensor import DTensor

    to, asked = torch.Tensor.to, []

    def moved(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and not isinstance(self, DTensor):
            asked.append(self.numel() * self.element_size())
        return to(self, *args, **kwargs)

    torch.Tensor.to = moved
    try:
        fn()
    finally:
        torch.Tensor.to = to
    return sum(asked)


@autoddp.distributed(nproc=2, strategy="fsdp")
def _meta_run(path: str) -> tuple:
    import torch.distributed.checkpoint.state_dict  # (its code pages are not measured)

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=LR)  # capture shards it, rank 0 makes the weights
    _steps(model, opt, *_batch(autoddp.rank()), 3)

    autoddp.save({"optimizer": opt}, f"{path}.opt")
    full_state = torch.load(f"{path}.opt")["optimizer"]["state"]
    full_bytes = sum(v.numel() * v.element_size() for s in full_state.values() for v in s.values() if v.dim())
    saved = autoddp.load(f"{path}.opt")
    moved = _bytes_moved_to_a_device(lambda: opt.load_state_dict(saved["optimizer"]))
    _steps(model, opt, *_batch(autoddp.rank()), 1)  # Adam goes on from the loaded state

    torch.manual_seed(autoddp.rank() + 5)  # ranks seeded differently build different weights
    other = autoddp.prepare(Net())
    other_state = {k: v.full_tensor() for k, v in other.state_dict().items()}
    torch.manual_seed(2)
    with torch.device("cpu" if autoddp.rank() == 0 else "meta"):  # built on rank 0 only
        alone = autoddp.prepare(Net())
    alone_state = {k: v.full_tensor() for k, v in alone.state_dict().items()}

    base = _reset_peak()
    torch.manual_seed(1)
    with torch.device("meta"):
        big = _big()
    big = autoddp.prepare(big)
    built = _status("VmHWM") - base
    local = sum(p.to_local().numel() * p.element_size() for p in big.parameters())

    anon, base = _status("RssAnon"), _reset_peak()
    state = autoddp.load(path)
    mapped = _status("RssAnon") - anon  # the checkpoint, held but not read
    big.load_state_dict(state["model"])
    loaded = _status("VmHWM") - base
    same = all(torch.equal(v.full_tensor(), state["model"][k]) for k, v in big.state_dict().items())
    try:  # a key too many: the same error on every rank, not on rank 0 alone
        big.load_state_dict({**state["model"], "extra": torch.ones(1)})
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    facts = [None, None]
    dist.all_gather_object(
        facts,
        {"built": built, "local": local, "mapped": mapped, "loaded": loaded, "refused": refused}
        | {"optimizer moved": moved / full_bytes},
    )
    return model, (other_state, alone_state), facts, same


def test_a_meta_built_model_shards_first_trains_like_one_process_and_loads_a_full_checkpoint(tmp_path):
    torch.manual_seed(1)
    full = _big().state_dict()
    total = sum(v.numel() * v.element_size() for v in full.values())
    path = str(tmp_path / "big.pt")
    torch.save({"model": full}, path)

    model, (other_state, alone_state), facts, same = _meta_run(path)

    torch.manual_seed(0)
    _close(model.state_dict(), _reference(Net().state_dict(), 4))  # meta-built: one process's weights
    torch.manual_seed(5)
    _close(other_state, Net().state_dict())  # every rank starts from rank 0's weights
    torch.manual_seed(2)
    _close(alone_state, Net().state_dict())  # built on rank 0 alone, shards sent to the others
    assert same  # the full checkpoint landed in the shards
    for rank, fact in enumerate(facts):
        assert "unexpected keys ['extra']" in fact.pop("refused"), rank
        assert fact["optimizer moved"] <= 0.55, rank  # a full optimizer state: only its shards move
        assert fact["local"] == pytest.approx(total / 2, rel=0.01), rank  # half of every parameter
    one = facts[1]  # rank 1 never holds the whole model: its shards plus about one tensor
    assert one["built"] < 0.75 * total, one
    assert one["mapped"] < 0.1 * total, one
    assert one["loaded"] < 0.25 * total, one


@pytest.mark.unit
def test_a_meta_built_module_without_reset_parameters_is_refused():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    assert _start.is_meta(model) and not _start.is_meta(nn.Linear(2, 2))
    with pytest.raises(ConfigurationError, match="Scale has no reset_parameters"):
        _start.check_initialisable(model)

    def layers() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.MultiheadAttention(4, 2))

    torch.manual_seed(3)
    with torch.device("meta"):
        meta = layers()
    built = _start.initialise_on_cpu(meta)
    torch.manual_seed(3)
    _close(built.state_dict(), layers().state_dict())  # one process's weights, same seed


@autoddp.distributed(nproc=2, strategy="fsdp", mixed_precision="fp16")
def _fp16_run() -> list:
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = autoddp.prepare(Net())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = _batch(autoddp.rank())
    seen = []
    for step in range(2):
        before = [p.to_local().clone() for p in model.parameters()]
        loss = (model(x).float() - y).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step == 0 and autoddp.rank() == 1:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")  # on rank 1's shard only
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters(), strict=True))
        seen.append((moved, scaler.get_scale()))
    facts = [None, None]
    dist.all_gather_object(facts, (seen, [str(w.message) for w in caught]))
    return facts


def test_fp16_says_to_scale_and_grad_scaler_skips_the_same_steps_on_every_rank():
    facts = _fp16_run()
    for seen, notes in facts:
        # the step with an inf on one rank's shard is skipped on both, the scale halved on both
        assert seen == [(False, 512.0), (True, 512.0)]
        assert any("torch.amp.GradScaler" in n and "mixed_precision='bf16'" in n for n in notes), notes


def _recording_host_copies(portable, folder):
    """``running.portable`` that writes down, per rank, the bytes asked to go to host memory."""

    from torch.distributed.tensor import DTensor

    def record(value):
        asked = []
        cpu, to = torch.Tensor.cpu, torch.Tensor.to

        def count(tensor):  # a host copy is of a plain tensor (a DTensor moved stays sharded)
            if not isinstance(tensor, DTensor):
                asked.append(tensor.numel() * tensor.element_size())

        def to_host(self, *args, **kwargs):
            count(self)
            return cpu(self, *args, **kwargs)

        def moved(self, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
                count(self)
            return to(self, *args, **kwargs)

        torch.Tensor.cpu, torch.Tensor.to = to_host, moved
        try:
            return portable(value)
        finally:
            torch.Tensor.cpu, torch.Tensor.to = cpu, to
            (folder / f"host-copies-{autoddp.rank()}").write_text(str(sum(asked)))

    return record


def _train_and_return(start: dict) -> tuple:
    model = Net()
    model.load_state_dict(start)
    model = autoddp.prepare(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    _steps(model, opt, *_batch(autoddp.rank()), 3)
    weight = next(iter(model.state_dict().values()))  # a DTensor with FSDP
    return model, {"weight": weight, "loss": torch.ones(256, 256)}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_only_rank_0_copies_the_result_to_host_memory(tmp_path, monkeypatch, strategy):
    import autoddp.in_rank.worker.process

    recording = _recording_host_copies(autoddp.in_rank.worker.process.portable, tmp_path)
    monkeypatch.setattr(autoddp.in_rank.worker.process, "portable", recording)
    torch.manual_seed(0)
    start = Net().state_dict()
    model, extra = autoddp.distributed(nproc=2, strategy=strategy)(_train_and_return)(start)

    reference = _reference(start, 3)
    _close(model.state_dict(), reference)  # rank 0's model is the whole, trained one
    torch.testing.assert_close(extra["weight"], next(iter(reference.values())), rtol=1e-5, atol=1e-5)
    assert int((tmp_path / "host-copies-0").read_text()) >= 256 * 256 * 4
    assert (tmp_path / "host-copies-1").read_text() == "0"  # rank 1 keeps nothing
