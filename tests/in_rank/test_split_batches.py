"""``split_batches``: the distributed run is the single-process run, step for step.

Real 2- and 3-process gloo runs of an unchanged script under ``autoddp --split-batches`` and of
decorated functions, each compared with the same code in one process: the loss the script prints
at every step (after its backward, the global batch's), the indices each rank drew (its part of
one process's batch), ``len(loader)`` and the final weights.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import autoddp
from autoddp import ConfigurationError
from autoddp.in_rank.data.split import part_bounds
from conftest import run_python, write

pytestmark = pytest.mark.timeout(150)

SCRIPT = """
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    torch.manual_seed(0)
    out, size, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    bn, accumulate = "--bn" in sys.argv, 2 if "--accumulate" in sys.argv else 1
    if "--double" in sys.argv:  # BatchNorm over 2 samples is ill-conditioned: float32 rounding grows
        torch.set_default_dtype(torch.float64)


    class Data(Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(1)
            self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], self.y[i], i


    layers = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + [nn.ReLU(), nn.Linear(16, 3)]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    workers = 2 if "--workers" in sys.argv else 0
    loader = DataLoader(
        Data(size), batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )
    rows = [{"len": len(loader)}]
    for epoch in range(3):
        for k, (x, y, i) in enumerate(loader):
            loss = nn.functional.cross_entropy(model(x), y) / accumulate
            loss.backward()
            print(f"step loss {loss.item():.6f}")
            rows.append({"loss": loss.item(), "indices": i.tolist()})
            if (k + 1) % accumulate == 0 or k + 1 == len(loader):
                opt.step()
                opt.zero_grad()
        schedule.step()
    rows.append({k: v.tolist() for k, v in model.state_dict().items()})
    with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(rows, f)
"""


def _read(folder, ranks):
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(ranks)]


def _flat(state):
    return torch.cat([torch.tensor(v, dtype=torch.float64).flatten() for v in state.values()])


def assert_same_run(single, ranks, *, tolerance):
    """``ranks`` (one list of rows per rank) is the run ``single`` is, step for step."""
    world = len(ranks)
    assert all(rows[0]["len"] == single[0]["len"] for rows in ranks)  # len(loader): one process's
    steps = single[1:-1]
    assert all(len(rows) == len(single) for rows in ranks)
    for step, one in enumerate(steps):
        batch = one["indices"]
        parts = [rows[1 + step] for rows in ranks]
        union, loss = set(), 0.0
        for rank, part in enumerate(parts):
            start, stop = part_bounds(len(batch), rank, world)
            if start < stop:
                assert part["indices"] == batch[start:stop], (step, rank)  # its contiguous part
                loss += part["loss"] * (stop - start) / len(batch)
            else:  # a batch smaller than the world: a stand-in sample that counts for nothing
                assert part["indices"] == batch[:1]
            union |= set(part["indices"])
        assert union == set(batch), step  # per step: together, one process's batch
        assert loss == pytest.approx(one["loss"], abs=tolerance), step  # the global batch's loss
    for rows in ranks:
        assert (_flat(rows[-1]) - _flat(single[-1])).abs().max().item() < tolerance


@pytest.mark.parametrize(
    ("nproc", "size", "batch", "flags", "tolerance"),
    [
        (2, 105, 64, [], 1e-5),  # batches of 64 and 41: parts 32, 32 and 21, 20
        (3, 105, 64, [], 1e-5),  # 64 over 3: 22, 21, 21; 41: 14, 14, 13
        (3, 101, 16, [], 1e-5),  # every batch uneven: 6, 5, 5
        (2, 101, 16, ["--bn", "--workers"], 1e-4),  # persistent DataLoader workers fetch the parts
        (3, 101, 16, ["--bn"], 1e-4),
        (2, 101, 16, ["--accumulate"], 1e-5),
        (3, 99, 16, ["--accumulate", "--bn"], 1e-4),  # the last batch 3: one sample each
        (3, 98, 16, ["--bn", "--double"], 1e-5),  # the last batch 2: parts 1, 1 and none
        (2, 97, 16, [], 1e-5),  # the last batch has 1 sample, for 2 ranks
    ],
)
def test_an_unchanged_script_under_split_batches_is_the_single_process_run(
    tmp_path, nproc, size, batch, flags, tolerance
):
    script = write(tmp_path / "train.py", SCRIPT)
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    args = [str(size), str(batch), *flags]
    alone = run_python([str(script), str(tmp_path / "one"), *args])
    assert alone.returncode == 0, alone.stderr
    many = run_python(
        ["-m", "autoddp.cli", "-n", str(nproc), "--split-batches", str(script), str(tmp_path / "many"), *args]
    )
    assert many.returncode == 0, many.stderr
    assert_same_run(_read(tmp_path / "one", 1)[0], _read(tmp_path / "many", nproc), tolerance=tolerance)
    # the loss the script prints after its backward is the global batch's, as one process prints it
    printed = [
        [float(line.split()[-1]) for line in p.stdout.splitlines() if line.startswith("step loss")]
        for p in (alone, many)
    ]
    assert len(printed[0]) == len(printed[1]) > 0
    assert max(abs(a - b) for a, b in zip(*printed, strict=True)) <= max(tolerance, 2e-6)  # 6 places


# -- decorated functions ------------------------------------------------------------------------


class Data(Dataset):
    def __init__(self, n, *, at_random=False):
        g = None if at_random else torch.Generator().manual_seed(1)  # at_random: torch's own stream
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def _build(at_random=False):
    layers = [nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)]
    data = Data(43 if at_random else 42, at_random=at_random)  # last batch: 3 (uneven), 2
    return nn.Sequential(*layers), DataLoader(data, batch_size=8, shuffle=True)


def _train(out, *, seed=True, prepared=False, given=None, plain=False):
    """Builds everything (or takes ``given``), trains 3 epochs and writes its rows (plain code).

    ``plain``: the data made from torch's own stream, and no ``len(loader)`` before the first
    pass (the loader is split at its first ``iter``, and that first pass is weighed too)."""
    if seed:
        torch.manual_seed(0)
    model, loader = given if given is not None else _build(at_random=plain)
    if prepared:
        model, loader = autoddp.prepare((model, loader), split_batches=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rows = [{"len": None if plain else len(loader)}]
    for _ in range(3):
        for x, y, i in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rows.append({"loss": loss.item(), "indices": i.tolist()})
        schedule.step()
    rows[0]["len"] = len(loader)
    rows.append({k: v.tolist() for k, v in autoddp.unwrap(model).state_dict().items()})
    with open(os.path.join(out, f"rank{autoddp.rank()}.json"), "w") as f:
        json.dump(rows, f)


_split_train = autoddp.distributed(nproc=2, split_batches=True)(_train)
_prepared_train = autoddp.distributed(nproc=2, capture=False)(_train)
_spawned_train = autoddp.distributed(nproc=2, split_batches=True, start_method="spawn")(_train)


@pytest.mark.parametrize(
    ("seed", "fn", "plain"),
    [
        (True, _split_train, False),
        (False, _split_train, False),
        (False, _spawned_train, False),
        (True, _split_train, True),
        (False, _split_train, True),
    ],
    ids=[
        "seeded-inside",
        "seeded-by-the-caller",
        "seeded-by-the-caller-spawned",
        "seeded-inside-random-data-no-len",
        "seeded-by-the-caller-random-data-no-len",
    ],
)
def test_a_decorated_function_that_builds_everything_is_the_single_process_run(tmp_path, seed, fn, plain):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    torch.manual_seed(0)
    _train(str(tmp_path / "one"), seed=seed, plain=plain)
    torch.manual_seed(0)  # every rank continues the caller's streams, as one process would
    fn(str(tmp_path / "many"), seed=seed, plain=plain)
    assert_same_run(_read(tmp_path / "one", 1)[0], _read(tmp_path / "many", 2), tolerance=1e-4)


def test_a_model_and_loader_passed_in_are_the_single_process_run(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    torch.manual_seed(0)
    _train(str(tmp_path / "one"), seed=False, given=_build())
    torch.manual_seed(0)  # the loader's first order comes from the caller's stream, as in one process
    _split_train(str(tmp_path / "many"), seed=False, given=_build())
    assert_same_run(_read(tmp_path / "one", 1)[0], _read(tmp_path / "many", 2), tolerance=1e-4)


def test_prepare_with_split_batches_is_the_single_process_run(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    _train(str(tmp_path / "one"))
    _prepared_train(str(tmp_path / "many"), prepared=True)  # capture off: prepare alone
    assert_same_run(_read(tmp_path / "one", 1)[0], _read(tmp_path / "many", 2), tolerance=1e-4)


# -- randomness inside the step stays each rank's own ---------------------------------------------


@autoddp.distributed(nproc=3, split_batches=True)
def _with_dropout():
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Data(43), batch_size=8, shuffle=True)
    epochs, masks = [], []
    for _ in range(2):
        seen = []
        for x, y, i in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, i.tolist())
            seen.append(everyone)
        epochs.append(seen)
    masks = [None] * dist.get_world_size()
    dist.all_gather_object(masks, torch.rand(4).tolist())
    return epochs, masks


def test_dropout_stays_per_rank_while_every_rank_splits_the_same_batches():
    epochs, masks = _with_dropout()
    assert len({tuple(m) for m in masks}) == 3  # each rank's own stream, as today
    for seen in epochs:
        assert len(seen) == 6  # ceil(43 / 8): one process's steps
        drawn = [index for step in seen for part in step for index in part]
        assert sorted(drawn) == list(range(43))  # one permutation, every sample once per epoch
        for step in seen:
            sizes = [len(part) for part in step]
            assert sizes == [b - a for a, b in (part_bounds(sum(sizes), r, 3) for r in range(3))]
    assert epochs[0] != epochs[1]  # a new order each epoch


#: A script seeded at its top (every rank alike): the dropout mask each rank draws at every step.
SEEDED = """
import json, os, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(48, 4), torch.randn(48, 1)), batch_size=12, shuffle=True)
masks = []
for x, y in loader:
    masks.append((nn.functional.dropout(torch.ones(16), 0.5) > 0).int().tolist())
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
with open(sys.argv[1] + os.environ.get("RANK", ""), "w") as file:
    json.dump(masks, file)
"""


def test_ranks_of_a_script_seeded_alike_draw_their_own_dropout_masks(tmp_path):
    script = write(tmp_path / "seeded.py", SEEDED)
    one = run_python([str(script), str(tmp_path / "one")], cwd=tmp_path)
    split = ["-m", "autoddp.cli", "-q", "-n", "3", "--split-batches"]
    many = run_python([*split, str(script), str(tmp_path / "many")], cwd=tmp_path)
    assert one.returncode == 0 and many.returncode == 0, one.stderr + many.stderr
    masks = [json.loads((tmp_path / f"many{rank}").read_text()) for rank in range(3)]
    assert masks[0][0] == json.loads((tmp_path / "one").read_text())[0]  # rank 0: one process's stream
    assert masks[1] != masks[2] and masks[0] != masks[1] and masks[0] != masks[2]  # each rank its own


# -- what cannot be split ---------------------------------------------------------------------------


class _Slices(Sampler):
    """A batch sampler whose batches are slices, which no rank can take a part of."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return 2

    def __iter__(self):
        yield slice(0, self.n // 2)
        yield slice(self.n // 2, self.n)


class _Sliced(Data):
    def __getitem__(self, i):
        return self.x[i]


@autoddp.distributed(nproc=2, split_batches=True)
def _bad(case):
    model = nn.Linear(8, 3)
    torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "small":
        loader = DataLoader(Data(10), batch_size=1, shuffle=True)
    elif case == "slices":
        loader = DataLoader(_Sliced(10), batch_sampler=_Slices(10), collate_fn=lambda b: b)
    else:
        loader = DataLoader(Data(10), batch_size=None, shuffle=True)
    for _ in loader:
        pass


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("small", "batch_size=1 split over 2 processes leaves 1 of them without a sample"),
        ("slices", "cannot split this batch sampler's batches: it yields slice objects"),
        ("unbatched", "it was made with batch_size=None and no batch_sampler"),
    ],
)
def test_what_cannot_be_split_is_a_clear_error_with_the_fix(case, says):
    with pytest.raises(ConfigurationError, match=says) as error:
        _bad(case)
    assert "leave split_batches off" in str(error.value) or "fewer processes" in str(error.value)


@pytest.mark.unit
def test_bad_options_fail_when_decorating():
    with pytest.raises(ConfigurationError, match="split_batches='yes' must be True or False"):
        autoddp.distributed(split_batches="yes")(_train)
    with pytest.raises(ConfigurationError, match="split_batches works with DDP only"):
        autoddp.distributed(split_batches=True, strategy="fsdp")(_train)
    with pytest.raises(ConfigurationError, match="must be True or False"):
        autoddp.prepare(nn.Linear(1, 1), split_batches=1)


@pytest.mark.unit
def test_the_command_takes_the_flag():
    from click.testing import CliRunner

    from autoddp.cli import main

    done = CliRunner().invoke(main, ["--help"])
    assert "--split-batches" in done.output


def test_the_benchmark_runs_and_prints_its_ratios():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "split_batches.py"
    tiny = ["--pairs", "1", "--steps", "2", "--batch", "4", "--cpu"]
    result = subprocess.run([sys.executable, str(script), *tiny], capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.splitlines()[-1])
    for name in ("without_batchnorm", "with_batchnorm"):
        assert figures[name]["ratio_median"] > 0  # (read, never asserted: no timing in tests)
    assert figures["nproc"] == 2 and figures["batch_per_process"] == 4


def test_the_notice_says_the_batchnorm_cost_and_a_summed_loss_is_a_warning(tmp_path):
    script = write(
        tmp_path / "summed.py",
        """
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = TensorDataset(torch.randn(20, 4), torch.randint(0, 2, (20,)))
        for x, y in DataLoader(data, batch_size=10, shuffle=True):
            loss = nn.functional.cross_entropy(model(x), y, reduction="sum")
            opt.zero_grad()
            loss.backward()
            opt.step()
        """,
    )
    result = run_python(["-m", "autoddp.cli", "-n", "2", "--split-batches", str(script)])
    assert result.returncode == 0, result.stderr
    assert (
        "1 BatchNorm layer with the global batch's statistics (split_batches: two all-reduces"
        in result.stderr
    )
    assert "each process takes its part (1/2) of every batch" in result.stderr
    warning = "split_batches assumes a loss that is a mean over the batch"
    assert result.stderr.count(warning) == 1 and "about 1/2 of one process's" in result.stderr
    assert "summed.py:12" in result.stderr and "loss.backward()" in result.stderr  # the user's line


def test_a_class_weighted_mean_loss_is_a_warning_at_its_backward(tmp_path):
    script = write(
        tmp_path / "weighted.py",
        """
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset

        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
        for x, y in DataLoader(data, batch_size=10, shuffle=True):
            loss = nn.functional.cross_entropy(model(x), y, weight=torch.tensor([1.0, 2.0, 3.0]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        """,
    )
    result = run_python(["-m", "autoddp.cli", "-n", "2", "--split-batches", str(script)])
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("and this one is a weighted mean") == 1  # once, at the first backward
    assert "weighted.py:12" in result.stderr and "loss.backward()" in result.stderr  # the user's line


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor


class _ReturnsADataclass(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        return _Output(self.net(x))  # (as Hugging Face models return their outputs)


def _train_returning_a_dataclass(out):
    torch.manual_seed(0)
    model = _ReturnsADataclass()
    loader = DataLoader(Data(43), batch_size=8, shuffle=True)  # the last batch, 3, splits unevenly
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        for x, y, _i in loader:
            loss = nn.functional.cross_entropy(model(x).logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    state = {k: v.tolist() for k, v in autoddp.unwrap(model).state_dict().items()}
    with open(os.path.join(out, f"rank{autoddp.rank()}.json"), "w") as f:
        json.dump([state], f)


def test_a_model_returning_a_dataclass_splits_like_one_with_a_tensor(tmp_path):
    """Uneven parts weigh the tensors inside a model's output whatever holds them (a dataclass)."""
    (tmp_path / "one").mkdir()
    (tmp_path / "many").mkdir()
    _train_returning_a_dataclass(str(tmp_path / "one"))
    autoddp.distributed(nproc=2, split_batches=True)(_train_returning_a_dataclass)(str(tmp_path / "many"))
    one = _read(tmp_path / "one", 1)[0][-1]
    for rank in _read(tmp_path / "many", 2):
        assert (_flat(rank[-1]) - _flat(one)).abs().max().item() < 1e-5
