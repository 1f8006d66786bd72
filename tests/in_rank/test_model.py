"""The model wrapper: transparent for the user, gradients synchronised by DDP. Real 2-process runs."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoddp
from autoddp.in_rank.models.ddp import ddp_of, is_wrapped


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))

    def predict(self, x):  # a user method that calls the model itself: synchronised
        return self(x)

    def encode_only(self, x):  # computes through submodules only: DDP cannot see it
        return self.fc(x).sum()


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _same_on_all_ranks(tensor):
    gathered = [torch.zeros_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return all(torch.equal(gathered[0], t) for t in gathered)


def _rank_data():
    torch.manual_seed(100 + autoddp.rank())  # different data on each rank
    return torch.randn(8, 4)


@autoddp.distributed(nproc=2)
def _transparency(model):
    # the argument arrives wrapped; seeds differ per rank before wrapping, equal after
    checks = {
        "wrapped": is_wrapped(model),
        "isinstance": isinstance(model, Net),
        "name": type(model).__name__,
        "fc_is_linear": type(model.fc) is nn.Linear,
        "keys": list(model.state_dict()),
        "identity": all(
            r is model
            for r in (model.to("cpu"), model.train(), model.eval(), model.float(), model.requires_grad_(True))
        ),
        "apply": model.apply(lambda m: None) is model,
        "params_equal": _same_on_all_ranks(torch.cat([p.detach().flatten() for p in model.parameters()])),
        "unwrap_is_self": autoddp.unwrap(model) is model,
        "device": str(next(model.parameters()).device),
    }
    model.my_flag = 5
    checks["flag"] = model.__dict__["my_flag"] == 5 and model.my_flag == 5
    model.train()
    return checks


def test_wrapped_model_is_transparent():
    torch.manual_seed(0)
    checks = _transparency(Net())
    assert checks == {
        "wrapped": True,
        "isinstance": True,
        "name": "Net",
        "fc_is_linear": True,
        "keys": list(Net().state_dict()),
        "identity": True,
        "apply": True,
        "params_equal": True,
        "unwrap_is_self": True,
        "device": "cpu",
        "flag": True,
    }


@autoddp.distributed(nproc=2)
def _gradient_sync():
    torch.manual_seed(autoddp.rank())  # different initial weights: DDP must broadcast rank 0's
    plain = Net()
    opt_before = torch.optim.SGD(plain.parameters(), lr=0.1)  # optimizer made before prepare
    model = autoddp.prepare(plain)
    assert model is plain
    out = {
        "params_equal_after_wrap": _same_on_all_ranks(
            torch.cat([p.detach().flatten() for p in model.parameters()])
        )
    }

    x = _rank_data()
    model(x).sum().backward()
    out["call_synced"] = _same_on_all_ranks(_grads(model))
    opt_before.step()
    opt_before.zero_grad()

    model.predict(x).sum().backward()
    out["method_synced"] = _same_on_all_ranks(_grads(model))
    model.zero_grad()

    with model.no_sync():
        model(x).sum().backward()
    out["no_sync_unsynced"] = not _same_on_all_ranks(_grads(model))
    model.zero_grad()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.encode_only(x)
    out["bypass_warns"] = any(
        "encode_only() computed a result with gradients" in str(w.message) for w in caught
    )

    calls = model.__dict__["_autoddp_ddp"]
    with torch.no_grad():
        model(x)  # no gradients: the plain module runs, no collective (safe on one rank)
    out["ddp_still_there"] = ddp_of(model) is calls

    opt_after = torch.optim.SGD(model.parameters(), lr=0.1)  # optimizer made after prepare
    model(x).sum().backward()
    opt_after.step()
    out["weights_equal_after_step"] = _same_on_all_ranks(
        torch.cat([p.detach().flatten() for p in model.parameters()])
    )
    return out


def test_gradients_are_synchronised_through_every_call_path():
    assert _gradient_sync() == {
        "params_equal_after_wrap": True,
        "call_synced": True,
        "method_synced": True,
        "no_sync_unsynced": True,
        "bypass_warns": True,
        "ddp_still_there": True,
        "weights_equal_after_step": True,
    }


@autoddp.distributed(nproc=2)
def _copies():
    model = autoddp.prepare(Net())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    pickled = pickle.loads(pickle.dumps(model))
    deep = copy.deepcopy(model)
    shallow = copy.copy(model)
    with torch.no_grad():
        deep.fc.weight.add_(1.0)
    state = io.BytesIO()
    torch.save(model.state_dict(), state)
    state.seek(0)
    fresh = Net()
    fresh.load_state_dict(torch.load(state))
    return {
        "types": [type(m) is Net for m in (saved, pickled, deep, shallow)],
        "deep_independent": not torch.equal(deep.fc.weight, model.fc.weight),
        "state_loads_into_plain": all(
            torch.equal(a, b)
            for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
        ),
        "still_wrapped": is_wrapped(model) and not is_wrapped(deep),
    }


def test_pickle_save_and_copies_give_the_plain_class():
    assert _copies() == {
        "types": [True, True, True, True],
        "deep_independent": True,
        "state_loads_into_plain": True,
        "still_wrapped": True,
    }


def test_returned_model_reaches_the_caller_plain():
    @autoddp.distributed(nproc=2)
    def train():
        torch.manual_seed(0)
        model = autoddp.prepare(Net())
        model(torch.ones(2, 4)).sum().backward()
        return model

    model = train()
    assert type(model) is Net and not is_wrapped(model)
    assert model.fc.weight.shape == (3, 4) and model.fc.weight.device.type == "cpu"


def test_decorated_builder_returns_a_wrapped_model():
    @autoddp.distributed
    def build():
        return Net()

    @autoddp.distributed(nproc=2)
    def train():
        model = build()
        return is_wrapped(model), isinstance(model, Net)

    assert train() == (True, True)
    assert not is_wrapped(build())  # one process: moved to the device only


def test_ddp_keyword_arguments_and_untrainable_models():
    @autoddp.distributed(nproc=2, ddp={"find_unused_parameters": True, "bucket_cap_mb": 1})
    def train(model, frozen):
        ddp = ddp_of(model)
        return ddp.find_unused_parameters, is_wrapped(frozen)

    frozen = nn.Linear(2, 2).requires_grad_(False)
    assert train(Net(), frozen) == (True, False)


@pytest.mark.unit
def test_ddp_options_are_checked():
    with pytest.raises(autoddp.ConfigurationError, match="device_ids"):
        autoddp.distributed(ddp={"device_ids": [0]})
    with pytest.raises(autoddp.ConfigurationError, match="must be a dict"):
        autoddp.distributed(ddp=["find_unused_parameters"])


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def test_sync_batchnorm_option_and_hint():
    @autoddp.distributed(nproc=2, sync_batchnorm=True)
    def synced(model):
        return type(model.bn).__name__

    @autoddp.distributed(nproc=2)
    def unsynced():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = autoddp.prepare(BNNet())
        return type(model.bn).__name__, [str(w.message) for w in caught]

    with pytest.raises(autoddp.ConfigurationError, match="sync_batchnorm=True needs CUDA"):
        synced(BNNet())  # torch's SyncBatchNorm is GPU-only: a clear error on CPU
    name, messages = unsynced()
    assert name == "BatchNorm1d"
    (hint,) = [m for m in messages if "BatchNorm layers" in m]
    # on CPU the hint must not recommend sync_batchnorm=True, which fails there
    assert "sync_batchnorm=True" not in hint and "CUDA only" in hint
    from autoddp.in_rank.models.statistics import batchnorm_hint as _batchnorm_hint

    assert "sync_batchnorm=True" in _batchnorm_hint("BNNet", "cuda:0")


@pytest.mark.unit
def test_single_process_prepare_only_moves():
    model = Net()
    assert autoddp.prepare(model) is model and not is_wrapped(model)
    nested = autoddp.prepare({"a": [model, 3], "b": (model,)})
    assert nested["a"][0] is model and nested["b"][0] is model


@pytest.mark.unit
def test_prepare_can_be_extended_for_new_types():
    class Box:
        def __init__(self, value):
            self.value = value

    @autoddp.prepare.register(Box)
    def _(box):
        return Box(box.value * autoddp.world_size() + 1)

    assert autoddp.prepare([Box(2)])[0].value == 3


def test_torch_compile_through_the_wrapper():
    @autoddp.distributed(nproc=2)
    def train():
        torch.manual_seed(0)
        compiled = torch.compile(Net(), backend="eager")
        model = autoddp.prepare(compiled)
        model(_rank_data()).sum().backward()
        return list(model.state_dict()), _same_on_all_ranks(_grads(model)), is_wrapped(model)

    keys, synced, wrapped = train()
    assert keys == list(Net().state_dict()) and synced and wrapped
