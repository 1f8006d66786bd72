"""The examples the README and docs/ point to run as documented, from the checkout's root as a newcomer
would, and leave nothing in the checkout: what they write goes to the temporary folder."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from conftest import run_python

pytestmark = pytest.mark.smoke  # CI runs these on the lowest and the newest torch too (-m smoke)

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _status() -> set[str] | None:
    """``git status --porcelain`` of the checkout, as a set of lines (None outside a git checkout)."""
    try:
        status = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(status.stdout.splitlines()) if status.returncode == 0 else None


@pytest.fixture
def outputs(tmp_path, monkeypatch) -> pathlib.Path:
    """The examples' default output folder (TMPDIR is this test's own); afterwards the checkout
    shows nothing new in ``git status``."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    before = _status()
    yield tmp_path / "autoddp-examples"
    if before is not None:
        new = sorted((_status() or set()) - before)
        assert not new, f"the example left these in the checkout: {new}"


def test_quickstart_on_two_processes(outputs):
    proc = run_python([str(EXAMPLES / "quickstart.py"), "--nproc", "2"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "trained on 2 process(es)" in proc.stdout
    assert "weights: [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]" in proc.stdout


def test_digits_on_two_processes(outputs):
    pytest.importorskip("sklearn")
    proc = run_python([str(EXAMPLES / "digits.py"), "--nproc", "2", "--epochs", "3"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("epoch ") == 3  # printed by rank 0 only
    assert "on 297 images, 2 process(es)" in proc.stdout  # every test image counted once
    accuracy = float(proc.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.9
    checkpoint = outputs / "digits.pt"
    assert checkpoint.exists()
    assert f"checkpoint written to {checkpoint}, reloaded into a plain CNN" in proc.stdout


def test_the_plain_single_gpu_script_under_the_command(outputs):
    alone = run_python([str(EXAMPLES / "single_gpu.py")], cwd=ROOT)
    assert alone.returncode == 0, alone.stderr
    checkpoint = outputs / "single_gpu.pt"
    assert f"weights written to {checkpoint}" in alone.stdout
    checkpoint.unlink()
    proc = run_python(["-m", "autoddp.cli", "-n", "2", str(EXAMPLES / "single_gpu.py")], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("test accuracy") == 1  # the console shows rank 0
    assert "on 512 samples" in proc.stdout  # the evaluation loader stayed whole
    assert float(proc.stdout.split("test accuracy ")[1].split()[0]) > 0.9
    assert "sharded" in proc.stderr and "Sequential (single_gpu.py:" in proc.stderr
    assert f"torch.save({str(checkpoint)!r}): written once, by rank 0" in proc.stderr
    assert checkpoint.exists()
