"""Gradient accumulation: one gradient synchronisation per optimizer step, results unchanged.

The collectives each rank issues are counted by its process group (the backend's sequence
number), never timed (torch 2.4's profiler drops some of gloo's events). The weights, and the
norms ``clip_grad_norm_`` returns before each step, equal one process's with the global batch.
"""

from __future__ import annotations

import itertools
import json
import re
import textwrap

import pytest
import torch
from torch import nn

import autoddp
from conftest import run_python

pytestmark = pytest.mark.smoke  # CI runs these on the lowest and the newest torch too (-m smoke)

#: Micro-batches per optimizer step, for each run.
WINDOWS = {
    "1": [1] * 4,
    "2": [2] * 4,
    "4": [4] * 4,
    "8": [8] * 3,
    "irregular": [3, 1, 5, 2, 2, 8, 1, 4],
}
_WORLD, _ROWS = 2, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _data(steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[micro-step, rank, rows, ...]: each rank's micro-batches."""
    generator = torch.Generator().manual_seed(1)
    total = sum(steps)
    return torch.randn(total, _WORLD, _ROWS, 8, generator=generator), torch.randn(
        total, _WORLD, _ROWS, 1, generator=generator
    )


def _issued() -> int:
    """The collectives this rank issued so far (none in one process)."""
    import torch.distributed as dist

    from autoddp.core import _compat

    return _compat.collectives_issued() if dist.is_initialized() else 0


def _train(
    steps: list[int],
    rank: int | None,
    *,
    scaler: bool = False,
    own_no_sync: bool = False,
    retain: bool = False,
    syncs: list[int] | None = None,
):
    """Train on ``steps`` windows; ``rank`` None: one process with the global batch.

    Returns per step the collectives issued and the norms ``clip_grad_norm_`` and a reading by hand
    saw, then the weights. ``retain``: the last micro-step's loss goes backward twice. ``syncs``:
    count those instead of every collective (``_counting_syncs``).
    """
    issued = _issued if syncs is None else lambda: syncs[0]
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    inputs, targets = _data(steps)
    counts, norms, micro, before = [], [], 0, None
    for k in steps:
        for j in range(k):
            x = inputs[micro].reshape(-1, 8) if rank is None else inputs[micro, rank]
            y = targets[micro].reshape(-1, 1) if rank is None else targets[micro, rank]
            micro += 1
            last = j == k - 1
            with model.no_sync() if own_no_sync and rank is not None and not last else _nothing():
                loss = nn.functional.mse_loss(model(x), y) / k
                before = issued() if before is None else before  # (after the first forward's broadcast)
                if retain and last:
                    loss.backward(retain_graph=True)
                (grad_scaler.scale(loss) if scaler else loss).backward()
        grads = [p.grad for p in model.parameters()]  # (None where FSDP2's wait for a step's averaging)
        hand = (
            float(sum(_full(g).pow(2).sum() for g in grads) ** 0.5)
            if all(g is not None for g in grads)
            else 0.0
        )
        if scaler:
            grad_scaler.unscale_(optimizer)
        norms.append((float(torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)), hand))
        if scaler:
            grad_scaler.step(optimizer)
            grad_scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        counts.append(issued() - before)
        before = issued()
    return counts, norms, [_full(p).detach().clone() for p in model.parameters()]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, also of a sharded parameter or gradient (a collective then)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _train_gan(rank: int | None, iterations: int = 6, syncs: list[int] | None = None):
    """A DCGAN-style loop: D sees real and fake, then G's loss passes through D again (D's window
    is 3 forwards, G's 1). Returns per iteration the all-reduces issued, then both models' weights."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 1))
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (g, d))
    real, noise = _data([iterations * 2])[0][:, :, :, :8], _data([iterations * 2])[0][:, :, :, :4]
    counts = []
    for i in range(iterations):
        x = real[i].reshape(-1, 8) if rank is None else real[i, rank]
        z = noise[i].reshape(-1, 4) if rank is None else noise[i, rank]
        before = _issued() if syncs is None else syncs[0]
        opt_d.zero_grad()
        fake = g(z)
        loss_d = d(x).mean() - d(fake.detach()).mean()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = -d(fake).mean()
        loss_g.backward()
        opt_g.step()
        counts.append((_issued() if syncs is None else syncs[0]) - before)
    return counts, [_full(p).detach().clone() for m in (g, d) for p in m.parameters()]


class _Critic(nn.Module):
    """Two blocks and a parameter of the root's own (FSDP2 keeps the root unsharded from its
    forward to its backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Parameter(torch.randn(8, 1) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.tanh(self.a(x)))) @ self.head


def _train_gan_zeroing_late(rank: int | None, iterations: int = 6):
    """``_train_gan`` with D's ``zero_grad()`` between its forwards and its backward (where G's
    loss left D's gradients, deferred under FSDP): the weights of both models."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), _Critic()
    opt_g, opt_d = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (g, d))
    real, noise = _data([iterations * 2])[0][:, :, :, :8], _data([iterations * 2])[0][:, :, :, :4]
    for i in range(iterations):
        x = real[i].reshape(-1, 8) if rank is None else real[i, rank]
        z = noise[i].reshape(-1, 4) if rank is None else noise[i, rank]
        fake = g(z)
        loss_d = d(x).mean() - d(fake.detach()).mean()
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        (-d(fake).mean()).backward()
        opt_g.step()
    return [_full(p).detach().clone() for m in (g, d) for p in m.parameters()]


def _train_logging_a_loss(rank: int | None, steps: int = 5, k: int = 4):
    """K micro-batches, then a forward with gradients whose loss is only printed, then the step
    (FSDP2 leaves the root's parameters gathered after that forward): the weights."""
    torch.manual_seed(0)
    model = _Critic()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = _data([steps * (k + 1)])
    micro = 0
    for _ in range(steps):
        for j in range(k + 1):
            x = inputs[micro].reshape(-1, 8) if rank is None else inputs[micro, rank]
            y = targets[micro].reshape(-1, 1) if rank is None else targets[micro, rank]
            micro += 1
            loss = nn.functional.mse_loss(model(x), y) / k
            if j < k:  # (the last: printed only)
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [_full(p).detach().clone() for p in model.parameters()]


def _train_sam(rank: int | None, steps: int = 5, rho: float = 0.05):
    """Sharpness-aware minimisation (two backward passes per step, the first one's gradients read
    by hand to move the weights): per step the gradient norm it read, then the weights."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = _data([steps])
    norms = []
    for i in range(steps):
        x = inputs[i].reshape(-1, 8) if rank is None else inputs[i, rank]
        y = targets[i].reshape(-1, 1) if rank is None else targets[i, rank]
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            moves = [rho * p.grad / (norm + 1e-12) for p in model.parameters()]
            for p, move in zip(model.parameters(), moves, strict=True):
                p.add_(move)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p, move in zip(model.parameters(), moves, strict=True):
                p.sub_(move)
        optimizer.step()
        optimizer.zero_grad()
        norms.append(float(norm))
    return norms, [_full(p).detach().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


RUNS = {
    **{name: (steps, {}) for name, steps in WINDOWS.items()},
    "scaler": (WINDOWS["irregular"], {"scaler": True}),
    "own no_sync": ([4] * 4, {"own_no_sync": True}),
    "second backward": ([2] * 4, {"retain": True}),
}


@autoddp.distributed(nproc=_WORLD)
def _runs(runs: dict[str, tuple[list[int], dict]]):
    found = {name: _train(steps, autoddp.rank(), **extra) for name, (steps, extra) in runs.items()}
    return found, _train_gan(autoddp.rank()), _train_sam(autoddp.rank())


@pytest.fixture(scope="module")
def both():
    return _runs(RUNS)


# --- strategy="fsdp": FSDP2's reduce-scatters deferred the same way (``models._deferral``) -------------

#: The reduce-scatters and all-reduces the FSDP runs issued: gradient synchronisations only (FSDP2's
#: all-gathers come with every forward, accumulating or not).
_SYNCS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")


def _counting_syncs() -> list[int]:
    """Count this rank's calls of ``_SYNCS`` from here on (they still run: nothing is replaced)."""
    import torch.distributed as dist

    count = [0]
    for name in _SYNCS:
        original = getattr(dist, name, None)
        if original is not None:

            def counted(*args, _original=original, **kwargs):
                count[0] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
    return count


FSDP_RUNS = {
    name: RUNS[name] for name in ("1", "2", "4", "8", "irregular", "own no_sync", "scaler", "second backward")
}


def _runs_fsdp(runs: dict[str, tuple[list[int], dict]]):
    """Run under ``strategy="fsdp"`` (decorated in the fixture: a torch without FSDP2 refuses it)."""
    count = _counting_syncs()
    found = {}
    for name, (steps, extra) in runs.items():
        found[name] = _train(steps, autoddp.rank(), syncs=count, **extra)
    gan = _train_gan(autoddp.rank(), syncs=count)
    late = _train_gan_zeroing_late(autoddp.rank())
    return found, gan, _train_sam(autoddp.rank()), late, _train_logging_a_loss(autoddp.rank())


@pytest.fixture(scope="module")
def sharded():
    missing = _fsdp_missing()
    if missing:
        pytest.skip(missing)
    return autoddp.distributed(nproc=_WORLD, strategy="fsdp")(_runs_fsdp)(FSDP_RUNS)


def _fsdp_missing() -> str:
    from autoddp.core import _compat

    needed = _compat.fsdp2_release("cpu")
    return f"FSDP2 on CPU needs torch {needed}" if needed else ""


@pytest.fixture(scope="module")
def results(both):
    return both[0]


def _equal_to_sam_alone(found: tuple) -> None:
    """``_train_sam``'s norms and weights (``found``) are one process's."""
    norms, weights = found
    reference_norms, reference = _train_sam(None)
    assert norms == pytest.approx(reference_norms, rel=1e-5)
    for ours, theirs in zip(weights, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_sharpness_aware_minimisation_reads_averaged_gradients(both):
    """Two backward passes per step whose first one's gradients move the weights: no accumulation,
    so nothing is deferred (the weights change inside the window), and every norm is one process's."""
    _equal_to_sam_alone(both[2])


def test_two_models_with_two_optimizers_keep_one_process_weights(both):
    """D trained by its optimizer and reached again by G's loss: one all-reduce per model a step."""
    counts, weights = both[1]
    _, reference = _train_gan(None)
    for ours, theirs in zip(weights, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    # D's and G's one each once D's window (3 forwards: G's loss reaches D too) is learned
    assert counts[3:] == [2] * (len(counts) - 3), counts


@pytest.mark.parametrize("name", sorted(RUNS))
def test_weights_and_clipped_norms_equal_one_process(results, name):
    steps, extra = RUNS[name]
    _, norms, weights = results[name]
    _, reference_norms, reference = _train(steps, None, **extra)
    clipped, theirs = [n[0] for n in norms], [n[0] for n in reference_norms]
    assert clipped == pytest.approx(theirs, rel=1e-5)  # clip_grad_norm_ averages what is still local
    if len(set(steps)) == 1 and not extra:  # (a window the steps foretell; DDP's own averaging)
        by_hand, theirs = [n[1] for n in norms], [n[1] for n in reference_norms]
        assert by_hand == pytest.approx(theirs, rel=1e-5)  # gradients read by hand before step()
    for ours, theirs in zip(weights, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def _without_rebuild(counts: list[int]) -> list[int]:
    """``counts`` less DDP's own two broadcasts, once, after its first synchronised backward (it
    rebuilds its buckets in the order the gradients came: torch's, hand-written DDP's too)."""
    found = next((i for i, c in enumerate(counts) if c >= 3), None)
    return counts if found is None else [*counts[:found], counts[found] - 2, *counts[found + 1 :]]


@pytest.mark.parametrize("name", ["1", "2", "4", "8", "own no_sync"])
def test_one_all_reduce_per_optimizer_step(results, name):
    counts = results[name][0]
    # (the first step also holds capture's first-step agreement: the window is learned there)
    assert _without_rebuild(counts[1:]) == [1] * (len(counts) - 1), counts


@pytest.mark.parametrize("name", ["irregular", "scaler"])
def test_an_irregular_window_costs_at_most_one_more_per_change(results, name):
    steps = RUNS[name][0]
    counts = results[name][0]
    changes = sum(1 for a, b in itertools.pairwise(steps) if a != b)
    later = _without_rebuild(counts[1:])
    assert all(1 <= c <= 2 for c in later), counts
    assert sum(later) <= len(later) + changes, counts


SCRIPT = """
    import json
    import torch
    import torch.distributed as dist
    from torch import nn

    gathers = [0]  # all-gathers: the model's call split between the ranks (issue 41), not DDP's
    original_all_gather = dist.all_gather

    def all_gather(*args, **kwargs):
        gathers[0] += 1
        return original_all_gather(*args, **kwargs)

    dist.all_gather = all_gather
    syncs = [0]  # FSDP2's reduce-scatters and autoddp's all-reduces (Python's; DDP's run in C++)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce"):
        if hasattr(dist, name):
            def counted(*args, _original=getattr(dist, name), **kwargs):
                syncs[0] += 1
                return _original(*args, **kwargs)
            setattr(dist, name, counted)

    def issued():  # the collectives other than those all-gathers this rank issued so far
        from autoddp.core import _compat
        return _compat.collectives_issued() - gathers[0] if dist.is_initialized() else 0

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)  # 10 batches: windows of 4, 4, 2
    K = 4
    counts, before, per_step, at = [], None, [], 0
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x), y) / K
            before = issued() if before is None else before  # (after the first forward's broadcast)
            loss.backward()
            if (i + 1) % K == 0 or i == len(loader) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                counts.append(issued() - before)
                before = issued()
                per_step.append(syncs[0] - at)
                at = syncs[0]
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    weights = [p.detach().flatten().tolist() for p in full]
    print("RESULT", json.dumps({"counts": counts, "syncs": per_step, "weights": weights}))
"""


#: Under "auto", a budget that DDP's state (5.0 KiB) does not fit and FSDP's (4.9 KiB) nearly does:
#: sharded, with no room for the unsharded gradients accumulation would keep (``models._deferral``).
_NO_ROOM = ["--device-memory", "4700"]
#: FSDP2 keeps mixed precision's unsharded gradients in fields of its own: nothing is deferred.
_MIXED = ["--strategy", "fsdp", "--mixed-precision", "bf16"]


@pytest.mark.parametrize(
    "flags",
    [[], ["--split-batches"], ["--strategy", "fsdp"], _NO_ROOM, _MIXED],
    ids=["default", "split-batches", "fsdp", "fsdp-without-room", "fsdp-mixed-precision"],
)
def test_an_unchanged_script_under_the_command_synchronises_once_per_step(tmp_path, flags):
    """A DataLoader whose epoch ends in a shorter window: the last batch synchronises too. (In order,
    the loader is whole on every rank, and the model splits each batch at its call: its all-gathers
    are not counted here, only DDP's synchronisations.)"""
    if ("fsdp" in flags or flags == _NO_ROOM) and _fsdp_missing():
        pytest.skip(_fsdp_missing())
    script = tmp_path / "accumulate.py"
    script.write_text(textwrap.dedent(SCRIPT))
    alone = run_python([str(script)], timeout=60)
    assert alone.returncode == 0, alone.stderr
    ran = run_python(["-m", "autoddp.cli", "-n", "2", *flags, str(script)], timeout=90)
    assert ran.returncode == 0, ran.stderr
    theirs = json.loads(alone.stdout.split("RESULT ", 1)[1])
    ours = json.loads(ran.stdout.split("RESULT ", 1)[1])
    said = " ".join(ran.stderr.split())
    if flags in (_NO_ROOM, _MIXED):  # every backward reduce-scatters (windows of 4, 4, 2 batches an epoch)
        assert "FSDP across 2 processes" in ran.stderr, ran.stderr
        assert ours["syncs"][1:] == [2 * k for k in (4, 2, 4, 4, 2)], ours["syncs"]
        assert "4 backward passes per optimizer.step() at accumulate.py:" in said, said
        assert "under FSDP each one reduce-scatters its gradients" in said and "synchronised once" not in said
        why = r"twice [0-9.]+ \w*B, more than the [0-9.]+ \w*B this process has left"
        assert re.search(why if flags == _NO_ROOM else "mixed precision's unsharded gradients", said), said
    elif "fsdp" in flags:  # one synchronisation: a reduce-scatter per block (2 Linear layers), no more
        assert ours["syncs"][1:] == [2] * 5, ours["syncs"]
        assert "the gradients are synchronised once per step" in said, said
    else:  # (the first step also holds capture's own first-step agreement between the ranks)
        assert ours["counts"][1:] == [1] * 5, ours["counts"]
    if flags == _MIXED:
        return  # (bfloat16's forward trains to other weights than one float32 process: the counts tell)
    for a, b in zip(ours["weights"], theirs["weights"], strict=True):
        assert a == pytest.approx(b, abs=1e-6)


@pytest.mark.parametrize("name", sorted(FSDP_RUNS))
def test_fsdp_weights_and_clipped_norms_equal_one_process(sharded, name):
    """Deferred reduce-scatters (and a wrong guess's gradients averaged at clip or step) give the
    weights and the clipped norms of one process with the global batch."""
    steps, extra = FSDP_RUNS[name]
    _, norms, weights = sharded[0][name]
    _, reference_norms, reference = _train(steps, None, **extra)
    assert [n[0] for n in norms] == pytest.approx([n[0] for n in reference_norms], rel=1e-5)
    for ours, theirs in zip(weights, reference, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_fsdp_synchronises_once_per_optimizer_step(sharded):
    """A synchronisation is one backward's reduce-scatters (one per unit): K = 2 and 4 cost what
    K = 1 costs, once the window is learned; the user's own no_sync changes nothing."""
    found = sharded[0]
    one = found["1"][0]
    assert len(set(one)) == 1 and one[0] > 0, one
    for name in ("2", "4", "8", "own no_sync"):
        assert found[name][0][1:] == one[1 : len(found[name][0])], (name, found[name][0], one)


def test_fsdp_irregular_window_costs_at_most_one_more_per_change(sharded):
    """A wrong guess costs one more synchronisation: the all-reduce of what was left unsharded."""
    steps = FSDP_RUNS["irregular"][0]
    counts, per_sync = sharded[0]["irregular"][0][1:], sharded[0]["1"][0][0]
    changes = sum(1 for a, b in itertools.pairwise(steps) if a != b)
    assert all(c <= 2 * per_sync for c in counts), counts
    assert sum(counts) <= (len(counts) + changes) * per_sync, counts


def test_fsdp_two_models_and_zero_grad_drop_what_was_deferred(sharded):
    """D's window holds G's loss through D, whose gradients opt_d.zero_grad() drops: deferred
    unsharded, they must go too. Then sharpness-aware minimisation (weights moved inside a window:
    nothing deferred)."""
    counts, weights = sharded[1]
    assert counts == [3] * len(counts), counts  # one synchronisation each: G's 2 blocks, D's 1
    for ours, theirs in zip(weights, _train_gan(None)[1], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    for ours, theirs in zip(sharded[3], _train_gan_zeroing_late(None), strict=True):  # (zero_grad late)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    _equal_to_sam_alone(sharded[2])


def test_fsdp_a_forward_no_backward_follows_before_the_step_keeps_one_process_weights(sharded):
    """FSDP2 keeps its root's parameters gathered from a forward to its backward; a forward whose
    loss is only printed leaves them so across the step, and the next forward would compute with
    the weights from before it: autoddp reshards the root before the step."""
    for ours, theirs in zip(sharded[4], _train_logging_a_loss(None), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
