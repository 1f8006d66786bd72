"""``model.to("cuda")`` of a model too large for one GPU: it waits in host memory and is sharded
onto the GPUs when its optimizer is made, so no GPU holds it whole (issue 42, item 3).

No GPU here: the CUDA condition is imitated as in ``test_gpu_devices`` (fake GPUs whose moves are
recorded and answered with CPU tensors). Each rank counts the tensors its script sends to a GPU
at each line. The processes, their gloo group, FSDP2 and the training are real.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_gpu_devices import _fake_gpus, _run

from autoddp.in_rank.capture.too_large import _bytes_moved, _parse_to
from conftest import needs_fsdp, write

#: Nine linear layers of about 1 MiB each (8.0 MiB with their biases), trained with SGD on one
#: batch of 128 rows, twice; a frozen teacher of the same size that only evaluates; each rank writes how
#: many tensors went to a GPU at ``model.to("cuda")``, at the teacher's ``.cuda()`` and at its
#: first forward (of its first layer).
SCRIPT = """
    import json, os, sys, torch
    from torch import nn


    def moves():
        log = os.path.join(os.environ.get("FAKE_LOG", ""), f"rank{os.environ.get('RANK', '-')}.jsonl")
        if not os.path.exists(log):
            return 0
        records = [json.loads(line) for line in open(log)]
        return sum(kind == "cuda" or (kind == "to" and value.startswith("cuda")) for kind, value in records)


    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)], nn.Linear(512, 1))
    counted = moves()
    model = model.to("cuda")
    at_model = moves() - counted
    teacher = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).requires_grad_(False)
    counted = moves()
    teacher.cuda()
    teacher.to("cuda")  # (sent again: it waits still)
    at_teacher = moves() - counted
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = torch.Generator().manual_seed(5)
    inputs, targets = torch.randn(128, 512, generator=rows), torch.randn(128, 1, generator=rows)
    data = torch.utils.data.TensorDataset(inputs, targets)
    at_forward = None
    loader = torch.utils.data.DataLoader(data, batch_size=128, shuffle=True)  # (one batch: any order)
    for inputs, targets in [batch for epoch in range(2) for batch in loader]:
        inputs, targets = inputs.to("cuda"), targets.to("cuda")
        with torch.no_grad():
            counted = moves()
            hint = teacher[1:](teacher[0](inputs)).mean()  # (a module in it runs first)
            at_forward = moves() - counted if at_forward is None else at_forward
        opt.zero_grad()
        nn.functional.mse_loss(model(inputs) + 0 * hint, targets).backward()
        opt.step()
    torch.save(model.state_dict(), sys.argv[1])
    with open(sys.argv[1] + os.environ.get("RANK", "") + ".json", "w") as facts:
        json.dump({"model": at_model, "teacher": at_teacher, "teacher's forward": at_forward}, facts)
"""


@needs_fsdp
@pytest.mark.timeout(240)
def test_a_model_too_large_for_one_gpu_is_sharded_onto_the_gpus_never_moved_whole(tmp_path):
    env = _fake_gpus(tmp_path, gpus=4)
    write(tmp_path / "train.py", SCRIPT)
    one = _run(tmp_path, ["train.py", "one.pt"], {**env, "FAKE_LOG": str(tmp_path)})
    assert one.returncode == 0, one.stderr
    reference = torch.load(tmp_path / "one.pt")

    # 8.0 MiB of parameters; under DDP 16 MiB with SGD's gradients; sharded over 4, about 4 MiB
    command = ["-m", "autoddp.cli", "-n", "4", "--device-memory", "7MiB", "train.py", "four.pt"]
    four = _run(tmp_path, command, env)
    assert four.returncode == 0, four.stderr
    assert "Sequential to cuda" in four.stderr and "waits in host memory" in four.stderr, four.stderr
    assert "FSDP" in four.stderr, four.stderr
    for rank in range(4):
        facts = json.loads((tmp_path / f"four.pt{rank}.json").read_text())
        # the model never went to a GPU whole; the teacher, never trained, went whole at its
        # first forward (as without autoddp), not at its .cuda()
        assert facts == {"model": 0, "teacher": 0, "teacher's forward": 16}, (rank, facts)
    trained = torch.load(tmp_path / "four.pt")
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-4)

    # the same model within the budget: moved at its line, trained under DDP
    command = ["-m", "autoddp.cli", "-n", "4", "--device-memory", "64MiB", "train.py", "fits.pt"]
    fits = _run(tmp_path, command, env)
    assert fits.returncode == 0, fits.stderr
    assert "waits in host memory" not in fits.stderr, fits.stderr
    for rank in range(4):
        facts = json.loads((tmp_path / f"fits.pt{rank}.json").read_text())
        assert facts == {"model": 18, "teacher": 32, "teacher's forward": 0}, (rank, facts)  # (sent twice)


@pytest.mark.unit
def test_the_bytes_a_move_would_take_and_the_forms_of_to_that_name_a_device():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    # 28 parameters and 8 running statistics in float32, one int64 counter
    assert _bytes_moved(model, torch.device("cuda", 0), None) == 36 * 4 + 8
    assert _bytes_moved(model, torch.device("cuda", 0), torch.bfloat16) == 36 * 2 + 8
    assert _bytes_moved(model, torch.device("cpu"), None) == 0
    assert _parse_to(("cuda",), {}) == ("cuda", {})
    assert _parse_to((), {"device": "cuda:1", "dtype": torch.half}) == ("cuda:1", {"dtype": torch.half})
    assert _parse_to(("cuda", torch.half, True), {}) == ("cuda", {"dtype": torch.half})
    assert _parse_to(("cuda", None, True), {}) == ("cuda", {})
    assert _parse_to((0,), {"non_blocking": True}) == (0, {})
    assert _parse_to(("cuda",), {"memory_format": torch.channels_last}) == (
        "cuda",
        {"memory_format": torch.channels_last},
    )
    half = torch.ones(1, dtype=torch.half)
    assert _parse_to((half,), {}) == (half.device, {"dtype": torch.half})  # a tensor's device and dtype
    assert _parse_to((torch.half,), {}) is None  # a dtype alone
    assert _parse_to(("cuda",), {"unknown": 1}) is None


#: A model sent to the GPU in parts (the encoder fits and goes; the decoder then does not: it waits),
#: pickled and deep-copied while it waits, a module sent and brought back, and the copy sent after
#: training: each rank writes what went to a GPU at each line.
PARTS = """
    import copy, json, os, sys, torch
    from collections import OrderedDict
    from torch import nn


    def moves():
        log = os.path.join(os.environ.get("FAKE_LOG", ""), f"rank{os.environ.get('RANK', '-')}.jsonl")
        if not os.path.exists(log):
            return 0
        records = [json.loads(line) for line in open(log)]
        return sum(kind == "cuda" or (kind == "to" and value.startswith("cuda")) for kind, value in records)


    def layers(count):
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(count)])


    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(enc=layers(4), dec=nn.Sequential(layers(4), nn.Linear(512, 1))))
    facts, counted = {}, moves()
    model.enc.cuda()
    facts["enc"], counted = moves() - counted, moves()
    model.dec.to("cuda", memory_format=torch.contiguous_format)
    facts["dec"], counted = moves() - counted, moves()
    torch.save(model, sys.argv[1] + ".whole")  # (a waiting model pickles)
    ema = copy.deepcopy(model)  # (a plain copy on the host)
    spare = layers(16).cuda()
    spare.cpu()  # (back to the host: nothing of it waits)
    spare(torch.ones(2, 512))
    facts["spare"], counted = moves() - counted, moves()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = torch.Generator().manual_seed(5)
    inputs, targets = torch.randn(128, 512, generator=rows), torch.randn(128, 1, generator=rows)
    data = torch.utils.data.TensorDataset(inputs, targets)
    loader = torch.utils.data.DataLoader(data, batch_size=128, shuffle=True)  # (one batch: any order)
    for inputs, targets in [batch for epoch in range(2) for batch in loader]:
        opt.zero_grad()
        nn.functional.mse_loss(model(inputs.to("cuda")), targets.to("cuda")).backward()
        opt.step()
    counted = moves()
    ema.cuda()
    facts["ema"], counted = moves() - counted, moves()
    with torch.no_grad():
        ema(inputs)
    facts["ema's forward"] = moves() - counted
    torch.save(model.state_dict(), sys.argv[1])
    with open(sys.argv[1] + os.environ.get("RANK", "") + ".json", "w") as out:
        json.dump(facts, out)
"""


@needs_fsdp
@pytest.mark.timeout(240)
def test_parts_copies_and_pickles_of_a_waiting_model_behave_as_on_one_gpu(tmp_path):
    env = _fake_gpus(tmp_path, gpus=4)
    write(tmp_path / "parts.py", PARTS)
    one = _run(tmp_path, ["parts.py", "one.pt"], {**env, "FAKE_LOG": str(tmp_path)})
    assert one.returncode == 0, one.stderr
    reference = torch.load(tmp_path / "one.pt")
    command = ["-m", "autoddp.cli", "-n", "4", "--device-memory", "7MiB", "parts.py", "four.pt"]
    four = _run(tmp_path, command, env)
    assert four.returncode == 0, four.stderr
    for rank in range(4):
        facts = json.loads((tmp_path / f"four.pt{rank}.json").read_text())
        # the encoder (4.0 MiB) fits and goes; the decoder (4.0 MiB) no longer does: it waits, and
        # is sharded with the model; the spare (16 MiB) waits, then goes back to the host; the copy
        # (8.0 MiB, made while the decoder waited) waits when sent, and goes whole at its forward
        assert facts == {"enc": 8, "dec": 0, "spare": 0, "ema": 0, "ema's forward": 18}, (rank, facts)
    trained = torch.load(tmp_path / "four.pt")
    for name, value in reference.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-4)
    assert isinstance(torch.load(tmp_path / "four.pt.whole", weights_only=False), torch.nn.Module)
