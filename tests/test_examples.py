"""The examples the README points to run as documented."""

from __future__ import annotations

import pathlib

import pytest

from conftest import run_python

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_on_two_processes(tmp_path):
    proc = run_python([str(EXAMPLES / "quickstart.py"), "--nproc", "2"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "trained on 2 process(es)" in proc.stdout
    assert "weights: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]" in proc.stdout


def test_digits_on_two_processes(tmp_path):
    pytest.importorskip("sklearn")
    proc = run_python([str(EXAMPLES / "digits.py"), "--nproc", "2", "--epochs", "3"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("epoch ") == 3  # printed by rank 0 only
    assert "on 297 images, 2 process(es)" in proc.stdout  # every test image counted once
    accuracy = float(proc.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.9
    assert (tmp_path / "digits.pt").exists()
    assert "checkpoint reloaded into a plain CNN" in proc.stdout


def test_the_plain_single_gpu_script_under_the_command(tmp_path):
    alone = run_python([str(EXAMPLES / "single_gpu.py")], cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    proc = run_python(["-m", "autoddp.cli", "-n", "2", str(EXAMPLES / "single_gpu.py")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("test accuracy") == 1  # the console shows rank 0
    assert "on 512 samples" in proc.stdout  # the evaluation loader stayed whole
    assert float(proc.stdout.split("test accuracy ")[1].split()[0]) > 0.9
    assert "sharded" in proc.stderr and "Sequential (single_gpu.py:" in proc.stderr
    assert (tmp_path / "single_gpu.pt").exists()
