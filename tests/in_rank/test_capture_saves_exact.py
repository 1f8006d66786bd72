"""Captured ``torch.save`` matched across ranks exactly (issue 31, item 5): a save-then-load loop
with no collective in between never reads a stale file, a failing save raises the same error on
every rank, and a symlink keeps pointing at its target, which gets the new checkpoint.

Real 2-process gloo runs of unchanged code, the command and the decorator alike.
"""

from __future__ import annotations

import os
import pickle
import re

import pytest
import torch
import torch.distributed as dist

import autoddp
from conftest import run_python, write

SAVE_THEN_LOAD = """
    import os, sys, torch, torch.distributed as dist
    stale = 0
    for step in range(20):  # no collective in between: the group's collective count stays put
        torch.save({"step": step}, "best.pt")
        stale += torch.load("best.pt")["step"] != step
    print("STALE", dist.get_rank(), stale, flush=True)
"""


def _tagged(output: str, tag: str) -> list[list[str]]:
    return sorted(line.split(tag, 1)[1].split() for line in output.splitlines() if tag in line)


@pytest.mark.parametrize("attempt", range(3))
def test_the_command_never_loads_a_stale_save(tmp_path, attempt):
    script = write(tmp_path / "loop.py", SAVE_THEN_LOAD)
    ran = run_python(["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert _tagged(ran.stdout, "STALE") == [["0", "0"], ["1", "0"]]  # 17 of 20 stale on rank 1 before
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "loop.py"]
    assert torch.load(tmp_path / "best.pt") == {"step": 19}


@autoddp.distributed(nproc=2)
def _save_then_load(folder: str) -> list:
    path = os.path.join(folder, "best.pt")
    stale = 0
    for step in range(20):
        torch.save({"step": step}, path)
        stale += torch.load(path)["step"] != step
    everyone = [None, None]
    dist.all_gather_object(everyone, stale)
    return everyone


@pytest.mark.parametrize("attempt", range(3))
def test_the_decorator_never_loads_a_stale_save(tmp_path, attempt):
    assert _save_then_load(str(tmp_path)) == [0, 0]  # 13 of 20 stale on rank 1 before


FAILING_SAVE = """
    import torch, torch.distributed as dist
    try:
        torch.save({"step": 1}, "missing/best.pt")
    except FileNotFoundError as error:
        print("CAUGHT", dist.get_rank(), type(error).__name__, "does not exist" in str(error), flush=True)
    torch.save({"step": 2}, "best.pt")  # the ranks stay in step after it
    print("LOADED", dist.get_rank(), torch.load("best.pt")["step"], flush=True)
"""


def test_a_save_failing_on_rank0_raises_the_same_error_on_every_rank(tmp_path):
    script = write(tmp_path / "fails.py", FAILING_SAVE)
    ran = run_python(["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr  # rank 1 waited forever before
    caught = [["0", "FileNotFoundError", "True"], ["1", "FileNotFoundError", "True"]]
    assert _tagged(ran.stdout, "CAUGHT") == caught
    assert _tagged(ran.stdout, "LOADED") == [["0", "2"], ["1", "2"]]


@autoddp.distributed(nproc=2)
def _save_through_link(link: str) -> dict:
    torch.save({"step": 7}, link)
    return torch.load(link)


def test_a_save_onto_a_symlink_writes_its_target(tmp_path):
    target = tmp_path / "checkpoints" / "epoch3.pt"
    target.parent.mkdir()
    torch.save({"step": 3}, target)
    link = tmp_path / "latest.pt"
    link.symlink_to(target)
    assert _save_through_link(str(link)) == {"step": 7}
    assert link.is_symlink() and os.readlink(link) == str(target)  # a file replaced the link before
    assert torch.load(target) == {"step": 7}


# --- item 6: files other than torch.save that every rank wrote are named, with the fix ----------

SHARED_FILES = """
    import csv, json, logging, pickle, torch
    import numpy as np
    logging.basicConfig(filename="train.log", filemode="w", level=logging.INFO)
    torch.save({"step": 0}, "best.pt")  # capture's own: written once, not named
    logging.info("step 0")
    with open("predictions.csv", "w", newline="") as f:
        csv.writer(f).writerow(["id", "label"])
    np.save("scores.npy", np.zeros(3))
    torch.no_grad()(np.savetxt)("grid.txt", np.zeros(3))  # a library's open under a torch frame
    with open("metrics.json", "w") as f:
        json.dump({"loss": 1.0}, f)
    with open("own%d.pkl" % torch.distributed.get_rank(), "wb") as f:  # a file per rank: fine
        pickle.dump(1, f)
    print("DONE", flush=True)
"""


def test_files_every_rank_wrote_are_named_with_the_fix(tmp_path):
    script = write(tmp_path / "writes.py", SHARED_FILES)
    ran = run_python(["-m", "autoddp.cli", "-n", "2", str(script)], cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    named = set(re.findall(r"autoddp: +(\S+) \(writes\.py:\d+\): every rank wrote it", ran.stderr))
    # (torchvision's save_image is a library under @torch.no_grad(), as grid.txt's writer is here)
    assert named == {"train.log", "predictions.csv", "scores.npy", "grid.txt", "metrics.json"}, ran.stderr
    assert "if autoddp.rank() == 0" in ran.stderr and "autoddp.rank()}" in ran.stderr


# --- issue 38, item 6: open(path, "wb") then torch.save(obj, f), then a load, on every rank -------

OPEN_SAVE_LOAD = """
    import os, sys, time, torch
    rank, slow = int(os.environ["RANK"]), int(sys.argv[1])
    wrong = []
    for i in range(10):
        with open("last.pt", "wb") as f:  # each rank's own open truncated the file another read
            torch.save({"i": i, "by": rank}, f)
        if rank == slow:
            time.sleep(0.3)  # widen the race: the other rank goes on to its next open first
        try:
            back = torch.load("last.pt")
        except Exception as error:
            back = type(error).__name__
        if back != {"i": i, "by": 0}:  # rank 0's object: written once, by rank 0
            wrong.append((i, back))
    print("WRONG", rank, len(wrong), wrong, flush=True)
    torch.distributed.barrier()  # (a plain write is not a save: the user's own wait for the readers)
    if rank == 0:  # a plain write to the same path is still the write one process makes
        with open("last.pt", "wb") as f:
            f.write(b"plain")
        with open("last.pt", "rb") as f:
            print("PLAIN", f.read(), flush=True)
"""


@pytest.mark.parametrize("slow", [0, 1])
def test_open_then_save_then_load_on_every_rank_is_exact(tmp_path, slow):
    script = write(tmp_path / "loop.py", OPEN_SAVE_LOAD)
    command = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script), str(slow)]
    ran = run_python(command, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    wrong = [line.split("WRONG", 1)[1].split(None, 2) for line in ran.stdout.splitlines() if "WRONG" in line]
    assert sorted(wrong) == [["0", "0", "[]"], ["1", "0", "[]"]], ran.stdout  # failed loads before
    assert "PLAIN b'plain'" in ran.stdout
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "loop.py"]  # no temporary file left


RESUME_THEN_OPEN_SAVE_LOAD = """
    import os, sys, time, torch
    rank, slow = int(os.environ["RANK"]), int(sys.argv[1])
    if rank == slow:
        time.sleep(0.3)  # widen the race: the other rank resumes first, then opens the file
    try:
        start = torch.load("last.pt")  # every rank resumes from the checkpoint a run left
    except Exception as error:
        start = type(error).__name__
    with open("last.pt", "wb") as f:  # (no collective since the load)
        torch.save({"i": 1, "by": rank}, f)
    print("RESUMED", rank, start == {"i": 0, "by": 0}, torch.load("last.pt") == {"i": 1, "by": 0}, flush=True)
"""


@pytest.mark.parametrize("slow", [0, 1])
def test_resume_then_open_then_save_on_every_rank_is_exact(tmp_path, slow):
    torch.save({"i": 0, "by": 0}, tmp_path / "last.pt")
    script = write(tmp_path / "resume.py", RESUME_THEN_OPEN_SAVE_LOAD)
    command = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script), str(slow)]
    ran = run_python(command, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert _tagged(ran.stdout, "RESUMED") == [["0", "True", "True"], ["1", "True", "True"]], ran.stdout
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "resume.py"]


SAVE_LOAD_THEN_PLAIN_WRITE = """
    import os, pickle, sys, time, torch
    rank, slow = int(os.environ["RANK"]), int(sys.argv[1])
    wrong = 0
    for i in range(5):
        torch.save({"i": i}, "last.pt")  # every rank: written once, by rank 0
        if rank == slow:
            time.sleep(0.2)  # widen the race: the other rank goes on to its plain write first
        try:
            wrong += torch.load("last.pt") != {"i": i}
        except Exception:
            wrong += 1
        with open("last.pt", "wb") as f:  # a plain write (no torch.save) to the checkpoint's path
            pickle.dump({"plain": i}, f)
    print("WRONG", rank, wrong, flush=True)
"""


@pytest.mark.parametrize("slow", [0, 1])
def test_a_plain_write_to_a_saved_path_never_replaces_it_under_a_reader(tmp_path, slow):
    # Each rank's open(path, "wb") gave a private file copied to the path at close, at once: rank 0
    # replaced the checkpoint with its pickle while rank 1 had still to load it (5 of 5 wrong).
    script = write(tmp_path / "plain.py", SAVE_LOAD_THEN_PLAIN_WRITE)
    command = ["-m", "autoddp.cli", "-n", "2", "--ranks", "all", str(script), str(slow)]
    ran = run_python(command, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert _tagged(ran.stdout, "WRONG") == [["0", "0"], ["1", "0"]], ran.stdout
    with open(tmp_path / "last.pt", "rb") as f:
        assert pickle.load(f) == {"plain": 4}  # as one process leaves it
    assert sorted(os.listdir(tmp_path)) == ["last.pt", "plain.py"]
