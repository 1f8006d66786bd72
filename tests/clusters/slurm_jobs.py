"""This test session's own SLURM jobs: submitted under one name, cancelled by it and nothing else.

The cluster may be shared: every job the SLURM tests submit carries ``JOB_NAME`` (unique to this
session), and what is left behind is found and cancelled by that name and the current user only
(``scancel --name JOB_NAME --user USER``), never another person's job. ``refusal()`` asks once,
within seconds, whether the cluster can place the tests' two tasks now, and if not says why.
"""

from __future__ import annotations

import os
import pwd
import secrets
import subprocess
import time

import pytest
from helpers import SETUP, run

#: Unique to this test session: the tests' jobs, and only they, carry it.
JOB_NAME = f"autoddp-tests-{os.getpid()}-{secrets.token_hex(3)}"
USER = pwd.getpwuid(os.getuid()).pw_name
#: The most tasks a test asks for at once.
TASKS = 2
#: srun and salloc give up after this long without resources, rather than queue (sbatch cannot).
WAIT_S = 20
#: What srun and salloc say when ``--immediate`` ran out (SLURM 22.05: "Unable to allocate resources").
NOT_PLACED = ("Unable to allocate resources", "Immediate execution impossible")


def command(program: str, *args: str, wait_s: int = WAIT_S) -> list[str]:
    """``program`` (srun, salloc or sbatch) and ``args``, submitting a job of this session."""
    wait = [f"--immediate={wait_s}"] if program in ("srun", "salloc") else []
    return [program, f"--job-name={JOB_NAME}", *wait, *args]


def run_job(program: str, *args: str, timeout: float = 90):
    """Run ``command(program, *args)`` to the end; a cluster too busy to place it is a skip."""
    done = run(command(program, *args), timeout=timeout)
    if done.returncode != 0 and any(words in done.stderr for words in NOT_PLACED):
        pytest.skip(
            f"SLURM here could not place the job within {WAIT_S} s ({done.stderr.strip()}; sinfo: {nodes()})"
        )
    return done


def left() -> str:
    """This session's jobs still in the queue, one ``ID STATE`` line each ("" when none)."""
    listed = subprocess.run(
        ["squeue", "-h", "--name", JOB_NAME, "--user", USER, "-o", "%i %T"],
        capture_output=True,
        text=True,
        timeout=15,
    )
    return listed.stdout.strip()


def cancel() -> None:
    """Cancel this session's jobs (only them: by name and user)."""
    subprocess.run(["scancel", "--name", JOB_NAME, "--user", USER], capture_output=True, timeout=15)


def wait_until_gone(seconds: float = 15) -> str:
    """Wait for this session's jobs to leave the queue; those still there are cancelled and returned."""
    deadline = time.monotonic() + seconds
    while (jobs := left()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if jobs:
        cancel()
    return jobs


def _sinfo() -> tuple[bool, str]:
    """(whether a controller answered, what sinfo says of the partitions in words or its error)."""
    try:
        state = subprocess.run(
            ["sinfo", "-h", "-o", "%P %a %D %t %C"], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired:
        return False, "no answer within 15 s"
    if state.returncode != 0 or not state.stdout.strip():
        said = (state.stdout + state.stderr).strip()
        return state.returncode == 0, said or f"exit status {state.returncode}, no partition"
    lines = []
    for line in state.stdout.strip().splitlines():
        fields = line.split()
        if len(fields) != 5:
            lines.append(line)
            continue
        partition, available, count, node_state, cpus = fields
        lines.append(
            f"partition {partition} {available}, {count} node(s) {node_state}, CPUs {cpus} (A/I/O/T)"
        )
    return True, "; ".join(lines)


def nodes() -> str:
    """What sinfo says of the partitions, in words (or its error)."""
    return _sinfo()[1]


def refusal() -> str | None:
    """Why this cluster cannot run the tests now (found within about 20 s), or None when it can."""
    answered, said = _sinfo()
    if not answered:
        return f"no SLURM controller answers (sinfo: {said}); {SETUP} starts a one-node cluster"
    probe = command("srun", "-n", str(TASKS), "true", wait_s=5)
    try:
        tried = subprocess.run(probe, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        tried = subprocess.CompletedProcess(probe, 1, "", "no answer within 20 s")
    finally:
        wait_until_gone(5)
    if tried.returncode != 0:
        error = tried.stderr.strip().splitlines()[-1:] or [f"exit status {tried.returncode}"]
        return f"SLURM here cannot place {TASKS} tasks ({error[0]}; sinfo: {nodes()})"
    return None
