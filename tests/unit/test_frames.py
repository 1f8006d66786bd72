"""The one rule for "the user's frame" (``autoddp.core._frames``), and that no other module has its own."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import sys
import traceback
import warnings

import pytest
import torch

import autoddp
from autoddp.core import _frames, _warn

pytestmark = [pytest.mark.unit, pytest.mark.smoke]  # every test here starts no process; smoke: CI's -m smoke

PACKAGE = pathlib.Path(autoddp.__file__).resolve().parent
TORCH_FILE = torch.nn.modules.module.__file__


def _code(filename: str, source: str, namespace: dict) -> dict:
    """Run ``source`` as if it were the file ``filename`` (its frames carry that name)."""
    exec(compile(source, filename, "exec"), namespace)
    return namespace


# --- the rule, file by file ---------------------------------------------------------------------


def test_autoddp_torch_and_the_standard_library_are_libraries_and_named_from_their_package_down():
    stacks = str(PACKAGE / "launch" / "hang" / "stacks.py")
    assert _frames.is_autoddp(stacks) and _frames.is_library(stacks) and not _frames.is_user(stacks)
    assert _frames.short(stacks) == "autoddp/launch/hang/stacks.py"
    assert not _frames.is_autoddp(TORCH_FILE) and _frames.is_library(TORCH_FILE)
    assert _frames.short(TORCH_FILE) == "torch/nn/modules/module.py"
    assert _frames.is_library(json.__file__) and _frames.short(json.__file__) == "json/__init__.py"
    assert _frames.is_library(pytest_file := sys.modules["_pytest"].__file__)  # site-packages
    assert _frames.short(pytest_file) == "_pytest/__init__.py"
    assert _frames.is_library("<frozen importlib._bootstrap>")


def test_the_call_path_and_runpy_are_runners():
    for name in _frames.CALL_PATH:
        assert (PACKAGE / name).is_file(), name
        assert _frames.is_runner(str(PACKAGE / name)) and _frames.is_library(str(PACKAGE / name))
    import runpy

    assert _frames.is_runner(runpy.__file__) and _frames.is_runner("<frozen runpy>")
    assert not _frames.is_runner(str(PACKAGE / "decorator.py")) and not _frames.is_runner(TORCH_FILE)


def test_the_users_files_and_code_given_as_text_are_the_users(tmp_path):
    train = str(tmp_path / "train.py")
    assert _frames.is_user(train) and not _frames.is_library(train) and not _frames.is_runner(train)
    assert _frames.short(train) == "train.py"
    assert _frames.is_user(__file__)  # the tests are the user's code too
    for text in ("<string>", "<stdin>"):  # python -c, exec, an interactive session
        assert _frames.is_user(text) and _frames.short(text) == text


def test_an_editable_or_symlinked_install_is_still_autoddp(tmp_path):
    (tmp_path / "site").mkdir()
    link = tmp_path / "site" / "autoddp"
    link.symlink_to(PACKAGE, target_is_directory=True)
    assert _frames.is_autoddp(str(link / "in_rank" / "run_folder" / "transport.py"))
    assert _frames.is_runner(str(link / "in_rank" / "worker" / "running.py")) and _frames.short(
        str(link / "in_rank" / "worker" / "running.py")
    ) == ("autoddp/in_rank/worker/running.py")
    # _frames itself imported through the link finds autoddp's real folder
    spec = importlib.util.spec_from_file_location("frames_through_a_link", link / "core" / "_frames.py")
    linked = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(linked)
    assert linked.__file__ == str(link / "core" / "_frames.py")
    assert str(PACKAGE) + os.sep == linked.AUTODDP
    assert linked.is_autoddp(str(link / "in_rank" / "capture" / "_registry.py"))
    # the user's own code reached through a link stays the user's
    (tmp_path / "project").mkdir()
    (tmp_path / "work").symlink_to(tmp_path / "project", target_is_directory=True)
    assert _frames.is_user(str(tmp_path / "work" / "train.py"))


# --- frames and tracebacks ----------------------------------------------------------------------


def _stack(tmp_path, outermost: str) -> dict:
    """user's ``outer`` (train.py) -> torch's ``lib`` -> autoddp's ``inner``, called from ``outermost``."""
    space: dict = {"_frames": _frames, "sys": sys}
    _code(
        str(PACKAGE / "somewhere.py"),
        "def inner(also=None):\n    return _frames.user_frame(sys._getframe(), also)\n",
        space,
    )
    _code(
        os.path.join(os.path.dirname(TORCH_FILE), "lib.py"),
        "def lib(also=None):\n    return inner(also)\n",
        space,
    )
    _code(str(tmp_path / "train.py"), "def outer(also=None):\n    return lib(also)\n", space)
    _code(outermost, "def run(also=None):\n    return outer(also)\n", space)
    return space


def test_the_users_frame_is_the_first_beyond_the_libraries_and_none_beyond_the_call_path(tmp_path):
    space = _stack(tmp_path, str(tmp_path / "main.py"))
    found = space["run"]()
    assert (os.path.basename(found.f_code.co_filename), found.f_code.co_name) == ("train.py", "outer")
    passed = space["run"](lambda frame: frame.f_code.co_name == "outer")
    assert passed.f_code.co_name == "run"  # ``also`` passes frames of the user's too
    # called by autoddp's call path directly (the user's ``outer`` never ran): no user frame, even
    # though this test's own frames (the user's) lie beyond the call path
    runner = _stack(tmp_path, str(PACKAGE / "in_rank" / "worker" / "running.py"))
    assert runner["lib"]() is not None  # (this test itself is the user's code)
    assert runner["run"](lambda frame: frame.f_code.co_name == "outer") is None


def test_tracebacks_lose_the_hang_marks_around_torchs_collectives(tmp_path):
    space: dict = {}
    _code(str(tmp_path / "lib.py"), "def all_reduce():\n    raise RuntimeError('peer gone')\n", space)
    _code(str(PACKAGE / "in_rank" / "hang" / "marks.py"), "def marked():\n    return all_reduce()\n", space)
    _code(str(tmp_path / "train.py"), "def train():\n    marked()\n", space)
    try:
        space["train"]()
    except RuntimeError as exc:
        tb = exc.__traceback__
    shown = "".join(traceback.format_tb(_frames.without_runners(tb)))
    assert "train.py" in shown and "lib.py" in shown and "marks.py" not in shown, shown
    space["all_reduce"] = None  # the mark itself fails: its innermost frame stays
    try:
        space["marked"]()
    except TypeError as exc:
        tb = exc.__traceback__.tb_next
    assert _frames.without_pass_through(tb) is tb and tb.tb_next is None


def test_warnings_point_at_the_users_line(tmp_path):
    space: dict = {"_warn": _warn}
    _code(os.path.join(os.path.dirname(TORCH_FILE), "lib.py"), "def lib():\n    _warn.warn('note')\n", space)
    _code(str(tmp_path / "train.py"), "def train():\n    x = 1\n    lib()\n", space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        space["train"]()
    assert [(os.path.basename(w.filename), w.lineno, str(w.message)) for w in caught] == [
        ("train.py", 3, "autoddp: note")
    ]


def test_tracebacks_lose_their_leading_runner_frames(tmp_path):
    space: dict = {}
    _code(str(tmp_path / "train.py"), "def train():\n    raise ValueError('bad')\n", space)
    _code(str(PACKAGE / "in_rank" / "worker" / "running.py"), "def run(fn):\n    return fn()\n", space)
    _code("<frozen runpy>", "def run_code(fn):\n    return run(fn)\n", space)
    try:
        space["run_code"](space["train"])
    except ValueError as exc:
        tb = exc.__traceback__.tb_next  # (from run_code on: this test's own frame is not a runner)
    shown = "".join(traceback.format_tb(_frames.without_runners(tb)))
    assert "train.py" in shown and "running.py" not in shown and "runpy" not in shown
    try:
        space["run_code"](None)  # the runner itself fails: nothing of the user's
    except TypeError as exc:
        tb = exc.__traceback__.tb_next
    assert _frames.without_runners(tb) is None
    kept = _frames.without_runners(tb, keep_last=True)
    assert (
        kept is not None and kept.tb_next is None and kept.tb_frame.f_code.co_filename.endswith("running.py")
    )


def test_runner_lines_of_dumps_and_tracebacks():
    running = PACKAGE / "in_rank" / "worker" / "running.py"
    assert _frames.runner_line(f'  File "{running}", line 120 in run_in_world')  # faulthandler
    assert _frames.runner_line(f'  File "{running}", line 120, in run_in_world')  # traceback
    assert _frames.runner_line('  File "<frozen runpy>", line 88 in _run_code')
    assert not _frames.runner_line(f'  File "{TORCH_FILE}", line 1 in _call_impl')
    assert not _frames.runner_line('  File "/home/me/running.py", line 3 in main')  # the user's own
    assert not _frames.runner_line(f"{running} is where it runs")


# --- no other module decides it on its own ------------------------------------------------------

#: ``__file__`` uses that remain outside _frames, and why (module, source of the expression).
_FILE_USES: set[tuple[str, str]] = set()


def _offences(source: str, relative: str) -> list[str]:
    """What in a module decides on its own which frame or file is whose (see the test below)."""
    found = []
    for node in ast.walk(ast.parse(source, relative)):
        line = f"{relative}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Compare) and any(
            _filename(operand) for operand in (node.left, *node.comparators)
        ):
            found.append(f"{line}: compares co_filename")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and _filename(func.value):
                found.append(f"{line}: co_filename.{func.attr}()")
            if ast.unparse(func).startswith("os.path.") and any(_filename(arg) for arg in node.args):
                found.append(f"{line}: {ast.unparse(func)}(co_filename)")
        elif isinstance(node, ast.Attribute) and node.attr == "tb_next":
            found.append(f"{line}: walks a traceback")
        elif (isinstance(node, ast.Name) and node.id == "__file__") or (
            isinstance(node, ast.Attribute) and node.attr == "__file__"
        ):
            if (relative, ast.unparse(node)) not in _FILE_USES:
                found.append(f"{line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and _names_a_runner(node.value):
            found.append(f"{line}: names {node.value!r}")
    return found


def _names_a_runner(value: object) -> bool:
    return isinstance(value, str) and (
        os.path.basename(value) in {os.path.basename(name) for name in _frames.CALL_PATH}
        or value.startswith("<frozen")
    )


def _filename(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "co_filename"


def test_no_other_module_decides_whose_frame_it_is():
    """Outside _frames, frames' files are only named (sites in messages, linecache, the code
    objects transport pickles), never compared, cut at or derived from autoddp's own paths."""
    offences = [
        offence
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_frames.py" or path.parent != PACKAGE / "core"
        for offence in _offences(path.read_text(), path.relative_to(PACKAGE).as_posix())
    ]
    assert offences == []
    assert {
        (path.relative_to(PACKAGE).as_posix(), ast.unparse(node))
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "__file__"
    } >= _FILE_USES  # (each allowed use still exists: the list does not rot)
    # the rules this replaced are found
    old = (
        "_CALL_PATH = os.path.dirname(os.path.abspath(__file__)) + os.sep + 'running.py'\n"
        "while frame.f_code.co_filename == _CALL_PATH or frame.f_code.co_filename.startswith(ROOTS):\n"
        "    tb = tb.tb_next\n"
        "real = os.path.realpath(frame.f_code.co_filename)\n"
    )
    assert sorted(offence.split(": ", 1)[1] for offence in _offences(old, "old.py")) == [
        "__file__",
        "co_filename.startswith()",
        "compares co_filename",
        "names 'running.py'",
        "os.path.realpath(co_filename)",
        "walks a traceback",
    ]


def test_the_standard_library_is_told_apart_from_packages_installed_beside_it():
    import numpy

    assert _frames.is_standard_library(os.__file__) and _frames.is_standard_library(json.__file__)
    assert _frames.is_standard_library("<frozen runpy>")
    assert not _frames.is_standard_library(numpy.__file__)  # site-packages, even inside lib/python3.X
    assert not _frames.is_standard_library(__file__) and not _frames.is_standard_library("<string>")
