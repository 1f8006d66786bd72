"""The memory estimate (``autoddp.core.memory``): sizes as options take them, each part of the
estimate against numbers computed by hand, tied weights once, and the activations measured
without memory equal to what the real forward saves. Starts no process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autoddp.core.errors import ConfigurationError
from autoddp.core.memory import activations, optimizers
from autoddp.core.memory.estimate import estimate
from autoddp.core.memory.sizes import format_bytes, parse_bytes

pytestmark = pytest.mark.unit

# --- sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("24GiB", 24 * 2**30),
        ("1200MiB", 1200 * 2**20),
        ("1.5GB", 1_500_000_000),
        (123456, 123456),
        ("123456", 123456),
        (" 2 kib ", 2048),
        ("512B", 512),
        (0, 0),
    ],
)
def test_sizes_are_read_in_every_accepted_form(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("-1GB", "never negative"),
        (-5, "0 or more"),
        ("12XB", "unknown unit 'XB'"),
        ("lots", "not a size"),
        ("", "not a size"),
        (True, "not a size"),
        (float("nan"), "0 or more"),
        ([1], "not a size"),
    ],
)
def test_a_bad_size_is_refused_naming_the_accepted_forms(value, says):
    with pytest.raises(ConfigurationError, match=says) as caught:
        parse_bytes(value, name="device_memory")
    assert "device_memory=" in str(caught.value) and "'24GiB', '1200MiB', '1.5GB'" in str(caught.value)


def test_sizes_print_in_the_largest_binary_unit():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1.6 * 2**30) == "1.6 GiB"
    assert format_bytes(1200 * 2**20) == "1.2 GiB"
    assert format_bytes(3 * 2**40) == "3.0 TiB"


# --- the parts, by hand -------------------------------------------------------------------

LINEAR = 1000 * 1000 * 4 + 1000 * 4  # Linear(1000, 1000): weight and bias, float32: 4,004,000 B
OUTPUT = 32 * 1000 * 4  # its output for a batch of 32: what it keeps (its input is the data's)


def _linear() -> tuple[nn.Module, tuple]:
    return nn.Linear(1000, 1000), (torch.randn(32, 1000),)


def test_linear_with_adam_under_ddp_by_hand():
    model, batch = _linear()
    found = estimate(model, batch, optimizer=torch.optim.Adam, plan="ddp")
    assert (found.params, found.grads, found.optimizer) == (4_004_000, 4_004_000, 8_008_000)
    # the output, the loss's log-softmax, its class-0 targets (32 int64), the loss and nll's weight sum
    assert found.gathered == 0 and found.activations == 2 * OUTPUT + 32 * 8 + 4 + 4
    # the peak is in Adam's step on CPU (one tensor at a time): the state, its two step counters
    # (float32), sqrt(exp_avg_sq) and its quotient for the weight, and the loop's output and loss,
    # alive until the next forward returns
    assert found.total == 2 * LINEAR + 2 * LINEAR + 2 * 4 + 2 * 4_000_000 + OUTPUT + 4 == 24_144_012
    assert found.notes == ()
    assert (
        "ddp: 23.0 MiB at the peak per process (parameters 3.8 MiB, gradients 3.8 MiB, optimizer 7.6 MiB"
        in found.describe()
    )


def test_the_tracked_peak_of_an_mlp_whose_peak_is_in_the_backward_by_hand():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100))
    found = estimate(
        model, (torch.randn(1000, 100),), optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}
    )
    held = 2 * (2 * (100 * 100 + 100) * 4)  # parameters and DDP's gradients: 161,600
    tensor = 1000 * 100 * 4  # each activation and gradient of the batch: 400,000
    # after the forward and the loss: ReLU's output (saved), the output, the log-softmax (saved),
    # the targets (saved by nll), the loss and nll's weight sum
    assert found.activations == 3 * tensor + 1000 * 8 + 4 + 4
    # the peak, in log-softmax's backward: ReLU's output, the output, the log-softmax, the gradient
    # nll gave it and the one it makes (nll's targets and weight sum released once it ran), the loss
    # and the gradient of the loss that starts the backward
    assert found.total == held + 5 * tensor + 4 + 4 == 2_161_608
    assert found.notes == ()


class Reads(nn.Module):
    """A forward that reads a value back (``.item()``): fake tensors cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(10, 10), nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * float(x.sum().item() > 0)


def test_a_step_that_cannot_run_on_fake_tensors_takes_the_rule_and_says_so():
    found = estimate(Reads(), (torch.randn(4, 10),), optimizer=torch.optim.Adam, device_type="cuda")
    assert "could not be tracked on fake tensors" in found.notes[0] and "per layer" in found.notes[1]
    state = 4 * 220 * 4  # parameters, gradients, Adam's two copies
    saved = activations.FALLBACK_PER_LAYER * 2 * 4 * 10 * 4  # the rule: 2 batches per layer
    # the rule's transient: the largest activation's gradient in and out, the largest parameter's
    # fresh gradient (more than foreach Adam's one sqrt of the whole group less the activations)
    assert found.activations == saved and found.total == state + saved + 2 * 160 + 400


def test_ddp_without_bucket_views_keeps_a_second_copy_of_the_gradients():
    model, batch = _linear()
    assert estimate(model, batch, optimizer=torch.optim.SGD, bucket_view=False).grads == 2 * LINEAR


def test_fsdp_over_two_shards_the_state_and_gathers_the_blocks():
    model, batch = _linear()
    found = estimate(model, batch, optimizer=torch.optim.Adam, plan="fsdp", processes=2)
    assert (found.params, found.grads, found.optimizer) == (2_002_000, 2_002_000, 4_004_000)
    assert found.gathered == LINEAR  # no block: the root's own parameters, gathered whole
    blocks = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)], nn.Linear(100, 3))
    found = estimate(blocks, (torch.randn(8, 100),), plan="fsdp", processes=3, units=list(blocks)[:4])
    block = 100 * 100 * 4 + 100 * 4
    assert found.gathered == (100 * 3 + 3) * 4 + 2 * block  # the root's head, and two blocks
    assert found.params == 4 * (34 * 100 * 4 + 34 * 4) + (1 * 100 + 1) * 4  # rows padded to 3


@pytest.mark.parametrize(
    ("cls", "options", "copies"),
    [
        (torch.optim.SGD, {"lr": 0.1}, 0),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 1),
        (torch.optim.Adam, {}, 2),
        (torch.optim.AdamW, {"amsgrad": True}, 3),
        (torch.optim.Adagrad, {}, 1),
        (torch.optim.RMSprop, {}, 1),
        (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}, 3),
    ],
)
def test_each_rule_is_what_the_optimizer_keeps_after_a_step(cls, options, copies):
    model = nn.Linear(1000, 1000)
    assert estimate(model, (torch.randn(2, 1000),), optimizer=cls, optimizer_kwargs=options).optimizer == (
        copies * LINEAR
    )
    # the rule against the optimizer itself, stepped on meta copies (its 4-byte step counters aside)
    groups = optimizers.groups_of(cls, list(model.parameters()), options)[1]
    stepped = optimizers._stepped_on_meta(cls, groups)
    assert stepped is not None and copies * LINEAR <= stepped <= copies * LINEAR + 2 * 8


def test_an_optimizer_instance_counts_its_own_groups_and_settings():
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "momentum": 0.9}, {"params": model[1].parameters()}], lr=0.1
    )
    assert estimate(model, (torch.randn(2, 1000),), optimizer=optimizer).optimizer == LINEAR


def test_another_optimizer_is_counted_after_one_step_on_meta_copies():
    model, batch = _linear()
    found = estimate(model, batch, optimizer=torch.optim.Adamax)
    assert 2 * LINEAR <= found.optimizer <= 2 * LINEAR + 2 * 8 and found.notes == ()


class NeedsClosure(torch.optim.SGD):
    def step(self, closure):  # (no closure on the meta device: the step fails there)
        return super().step(closure)


def test_an_optimizer_that_cannot_step_on_meta_takes_the_documented_rule_and_says_so():
    model, batch = _linear()
    found = estimate(model, batch, optimizer=NeedsClosure, optimizer_kwargs={"lr": 0.1})
    assert found.optimizer == optimizers.FALLBACK_COPIES * LINEAR
    assert "NeedsClosure's state could not be counted" in found.notes[0]


def test_lbfgs_keeps_its_history_two_flat_copies_a_step():
    model, batch = _linear()
    found = estimate(model, batch, optimizer=torch.optim.LBFGS, optimizer_kwargs={"history_size": 5})
    assert found.optimizer == (2 * 5 + 2) * LINEAR  # (its step needs a closure: not tracked, said)
    assert found.notes == (
        "LBFGS could not step on fake tensors: its state and temporaries are added to "
        "the step's peak by rule",
    )


def test_tied_weights_count_once():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            self.out = nn.Linear(64, 1000, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.embed(ids))

    found = estimate(Tied(), (torch.randint(0, 1000, (4, 8)),), optimizer=torch.optim.Adam)
    assert found.params == found.grads == 1000 * 64 * 4 and found.optimizer == 2 * 1000 * 64 * 4
    fsdp = estimate(Tied(), (torch.randint(0, 1000, (4, 8)),), plan="fsdp", processes=2)
    assert fsdp.gathered == 2 * 1000 * 64 * 4  # the embedding's block twice; its tied twin adds none


# --- activations --------------------------------------------------------------------------


def _real_saved(model: nn.Module, args: tuple) -> int:
    """What the real forward saves for its backward, and its output: each storage once."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *args)}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pack(model(*args))
    return sum(seen.values())


def _models() -> list[tuple[str, nn.Module, tuple]]:
    layer = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.1, batch_first=True)
    convnet = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(1024, 10),
    )
    mlp = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4)
    )
    return [
        ("mlp", mlp, (torch.randn(16, 32),)),
        ("convnet", convnet, (torch.randn(8, 3, 16, 16),)),
        (
            "transformer",
            nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
            (torch.randn(4, 24, 64),),
        ),
        (
            "embedding",
            nn.Sequential(nn.Embedding(500, 32), nn.Flatten(), nn.Linear(192, 4)),
            (torch.randint(0, 500, (8, 6)),),
        ),
    ]


@pytest.mark.parametrize("index", range(4), ids=[name for name, _, _ in _models()])
def test_activations_measured_without_memory_equal_what_the_real_forward_saves(index):
    _, model, batch = _models()[index]
    found = activations.measure(model, batch)
    assert found.note is None
    assert found.saved == _real_saved(model, batch) > 0


def test_measuring_leaves_the_model_and_the_random_streams_as_they_were():
    (_, dropout, small), (_, model, batch) = _models()[:2]  # BatchNorm updates its statistics in training
    before = {name: value.clone() for name, value in model.state_dict().items()}
    torch.manual_seed(0)
    estimate(dropout, small)  # dropout draws from the random stream
    activations.measure(model, batch)
    drawn = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(3))
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())


def test_a_forward_that_reads_values_back_takes_the_documented_rule_and_says_so():
    found = activations.measure(Reads(), (torch.randn(4, 10),))
    assert found.saved == activations.FALLBACK_PER_LAYER * 2 * 4 * 10 * 4
    assert "could not run without memory" in found.note and "per layer" in found.note
