"""`prefect-ddp demo|serve|worker`: what a user who installed the wheel runs, and what a wrong command says."""

import pytest

from prefect_ddp.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv, given", [([], "no command"), (["train"], "'train'")])
def test_an_unknown_command_names_what_was_given_and_the_commands(argv, given):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert f"got {given}; the commands are demo, serve, worker" in str(stopped.value.code)


@pytest.mark.parametrize("command", ["demo", "serve"])
def test_each_command_takes_its_modules_options(command, capsys):
    with pytest.raises(SystemExit) as stopped:
        main([command, "--help"])
    assert stopped.value.code == 0
    assert "--epochs" in capsys.readouterr().out


def test_the_worker_takes_its_warm_cluster_options_and_passes_the_rest_to_prefect(capsys):
    from prefect_ddp.deployments.worker import parse_args

    args, rest = parse_args(["--pool", "ddp-pool", "--n-workers", "4", "--limit", "2"])
    assert args.n_workers == 4 and not args.no_warm_cluster and rest == ["--pool", "ddp-pool", "--limit", "2"]
    with pytest.raises(SystemExit) as stopped:
        main(["worker", "--help"])
    assert stopped.value.code == 0
    assert "--no-warm-cluster" in capsys.readouterr().out
