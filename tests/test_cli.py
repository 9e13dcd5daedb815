"""`prefect-ddp demo|serve`: what a user who installed the wheel runs, and what a wrong command says."""

import pytest

from prefect_ddp.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv, given", [([], "no command"), (["train"], "'train'")])
def test_an_unknown_command_names_what_was_given_and_the_commands(argv, given):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert f"got {given}; the commands are demo, serve" in str(stopped.value.code)


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_each_command_takes_its_modules_options(command, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([command, "--help"])
    assert stopped.value.code == 0
    assert "--epochs" in capsys.readouterr().out
