"""One list of options: the decorator's signature, the command's flags and the option table of the
README and of docs/command.md."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib

import pytest
from click.testing import CliRunner

import autoddp
from autoddp import options
from autoddp.cli import main
from autoddp.command import option_table

pytestmark = [pytest.mark.unit, pytest.mark.smoke]  # every test here starts no process; smoke: CI's -m smoke


def test_the_decorator_the_command_and_the_readme_come_from_one_list():
    fields = dataclasses.fields(options.Options)
    signature = inspect.signature(autoddp.distributed)
    assert list(signature.parameters)[1:] == [f.name for f in fields]
    for field in fields:
        assert signature.parameters[field.name].default == field.default
    command = {p.name: p for p in main.params}
    for flag in options.command_flags():
        param = command[flag.name]
        assert param.default == (None if flag.default == () else flag.default) and param.help == flag.help
        assert {*param.opts, *param.secondary_opts} == {s for f in flag.flags for s in f.split("/")}
    eager = {"version", "print_completion"}  # click's actions, not run options
    assert set(command) - {"script", "script_args", *eager} == {f.name for f in options.command_flags()}
    helped = CliRunner().invoke(main, ["--help"]).output
    for flag in options.command_flags():
        assert flag.flags[0].split("/")[0] in helped
    root = pathlib.Path(__file__).resolve().parents[2]
    for page in ("README.md", "docs/command.md"):
        text = root.joinpath(page).read_text()
        assert option_table.readme_table() in text, (
            f"{page}'s option table: paste option_table.readme_table()"
        )


def test_the_command_checks_its_values_with_the_decorators_rules(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    runner = CliRunner()
    for args, says in [
        (
            ["--cpu-offload", "--strategy", "ddp", str(script)],
            "--cpu-offload are FSDP's options: use --strategy 'fsdp'",
        ),
        (["--strategy", "zero", str(script)], "--strategy 'zero'"),
        (["--mixed-precision", "fp8", "--strategy", "fsdp", str(script)], "--mixed-precision 'fp8'"),
    ]:
        done = runner.invoke(main, args)
        assert done.exit_code == 2 and done.output.count("\n") == 1 and says in done.output, done.output


def test_a_bad_value_of_every_choice_valued_flag_names_the_flag(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    runner = CliRunner()
    for flag, value in [
        ("--strategy", "zero"),
        ("--start-method", "bogus"),
        ("--rdzv-backend", "bogus"),
        ("--ranks", "first"),
        ("--nproc-per-node", "many"),
        ("--print-completion", "tcsh"),
        ("--master", "nohostport"),
        ("--rdzv-endpoint", "nohostport"),
    ]:
        for more in ([], ["--nnodes", "2"]) if flag in ("--master", "--rdzv-endpoint") else ([],):
            done = runner.invoke(main, [*more, flag, value, str(script)])
            assert done.exit_code == 2 and done.output.count("\n") == 1, done.output
            assert f"{flag} '{value}'" in done.output or f"{flag}={value!r}" in done.output, done.output
