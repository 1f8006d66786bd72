"""Capture of models beyond the plain optimizer over ``model.parameters()`` (issue 19).

Real 2-process gloo runs; each test checks what a user checks: weights identical on every rank
and equal to one process with the global batch, values read from the weights, the warning said.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

import autoddp
from conftest import needs_fsdp

N = 16  # samples: each rank takes its half, one process the whole (mean losses: the same step)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=generator)
    return x, x @ torch.randn(4, 2, generator=generator)


def _share(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _data()
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _identical(*modules: nn.Module) -> bool:
    flat = torch.cat([p.detach().flatten() for m in modules for p in m.parameters()])
    parts = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return all(torch.equal(parts[0], part) for part in parts)


def _state(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# --- 5: optimizer.add_param_group ------------------------------------------------------------


def _head_added_later(rank: int, world: int) -> tuple[list[torch.Tensor], bool]:
    x, y = _share(rank, world)
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    opt = torch.optim.SGD(backbone.parameters(), lr=0.1)
    head = None
    for step in range(5):
        if step == 2:  # a head added later (progressive training), with its own learning rate
            torch.manual_seed(1)
            head = nn.Linear(4, 2)
            opt.add_param_group({"params": head.parameters(), "lr": 0.05})
        out = backbone(x)
        loss = out.pow(2).mean() if head is None else (head(out) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert head is not None
    identical = _identical(backbone, head) if world > 1 else True
    return _state(backbone, head), identical


def test_a_param_group_added_later_is_wrapped_and_averaged():
    @autoddp.distributed(nproc=2)
    def train():
        return _head_added_later(autoddp.rank(), autoddp.world_size())

    state, identical = train()
    assert identical
    _close(state, _head_added_later(0, 1)[0])


# --- 14: a model reached only through a container --------------------------------------------


class Trainer:
    """A trainer object built before the call, its models in a dict (and a list inside it)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.models = {"net": nn.Linear(4, 2), "more": [nn.Linear(2, 2)]}
        hidden = nn.Linear(2, 2)
        self.hidden = lambda: hidden  # reached only through a closure: not walked

    def fit(self, rank: int, world: int) -> list[torch.Tensor]:
        x, y = _share(rank, world)
        models = self.models  # the modules themselves are in no frame's locals
        opt = torch.optim.SGD([*models["net"].parameters(), *models["more"][0].parameters()], lr=0.1)
        for _ in range(3):
            loss = (models["more"][0](models["net"](x)) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return _state(models["net"], models["more"][0])


def test_a_model_reached_only_through_a_dict_or_list_is_found_and_averaged():
    @autoddp.distributed(nproc=2)
    def train(trainer):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = trainer.fit(autoddp.rank(), autoddp.world_size())
            found = [str(w.message) for w in caught]
            torch.optim.SGD(trainer.hidden().parameters(), lr=0.1)
        models = trainer.models
        hint = [str(w.message) for w in caught][len(found) :]
        return state, _identical(models["net"], models["more"][0]), found, hint

    state, identical, messages, hint = train(Trainer())
    assert messages == []
    assert len(hint) == 1 and "built before the call" in hint[0] and "autoddp.prepare(model)" in hint[0]
    assert identical
    _close(state, Trainer().fit(0, 1))


# --- 6: an auxiliary loss through a submodule, beside the DDP forward -------------------------


class EncoderHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def _aux_training(rank: int, world: int) -> tuple[list[torch.Tensor], bool]:
    x, y = _share(rank, world)
    x2 = x.flip(0) * 2  # the auxiliary batch: this rank's share too
    torch.manual_seed(0)
    model = EncoderHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        if step % 3 == 0:  # a second backward through a submodule, after DDP's
            loss.backward()
            model.encoder(x2).pow(2).mean().backward()
        elif step % 3 == 1:  # one backward of both, the auxiliary part through a nested submodule
            (loss + model.encoder[0](x2).pow(2).mean()).backward()
        else:  # a plain step, and a value logged on one rank with gradients on, never trained with
            loss.backward()
            if rank == 0:
                model.encoder(x).norm().item()
        opt.step()
    return _state(model), _identical(model) if world > 1 else True


def test_an_auxiliary_loss_through_a_submodule_is_averaged_and_said_once():
    @autoddp.distributed(nproc=2)
    def train():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, identical = _aux_training(autoddp.rank(), autoddp.world_size())
        return state, identical, [(str(w.message), w.filename) for w in caught]

    state, identical, messages = train()
    assert identical
    _close(state, _aux_training(0, 1)[0])
    assert len(messages) == 1, messages
    text, filename = messages[0]
    assert "EncoderHead" in text and "submodules" in text and filename == __file__


# --- 11: strategy="fsdp": what a script reads from its (sharded) weights ----------------------


def _read_weights(rank: int, world: int) -> dict:
    x, y = _share(rank, world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    w = model[0].weight
    return {
        "norm": w.norm().item(),
        "sum": w.sum().item(),
        "float": float(w.detach().sum()),
        "max": w.max().item(),
        "tolist": w.tolist(),
        "numpy": w.detach().numpy().tolist(),
        "data.norm": w.data.norm().item(),
        "state_dict": model.state_dict()["0.weight"].norm().item(),
        "print": str(w),
        "positive": bool((w > 0).any()),
        "format": f"{w.sum():.4f}",
    }


@needs_fsdp
def test_values_read_from_fsdp_weights_are_the_full_tensors_on_every_rank():
    @autoddp.distributed(nproc=2, strategy="fsdp")
    def train():
        reads = _read_weights(autoddp.rank(), autoddp.world_size())
        everyone = [None, None]
        dist.all_gather_object(everyone, reads)
        return everyone

    one = _read_weights(0, 1)
    for reads in train():
        assert reads["print"] == one["print"]
        assert reads["format"] == one["format"] and reads["positive"] == one["positive"]
        for name in ("norm", "sum", "float", "max", "data.norm", "state_dict"):
            assert abs(reads[name] - one[name]) < 1e-5, (name, reads[name], one[name])
        for name in ("tolist", "numpy"):
            torch.testing.assert_close(
                torch.tensor(reads[name]), torch.tensor(one[name]), rtol=1e-5, atol=1e-5
            )
