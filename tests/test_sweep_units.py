"""The sweep's parts without a cluster: the space, resuming, the comparison."""

from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState
from pydantic import ValidationError

from prefect_ddp.blocks.study_storage import StudyStorage
from prefect_ddp.flows.sweep import check_metric, check_space, check_trial_sizes
from prefect_ddp.tasks.config import ClusterConfig
from prefect_ddp.tasks.sweeps.search_space import Dimension, grid, with_params
from prefect_ddp.tasks.sweeps.settings import INTERRUPTED, RETRIED, SweepSettings
from prefect_ddp.tasks.sweeps.sweep import (
    NoTrialTrained,
    TrialsRun,
    in_space,
    make_sampler,
    study_storage,
    trial_run_name,
    trials_left,
)
from prefect_ddp.tasks.sweeps.sweep_report import (
    best_row,
    importances,
    sweep_markdown,
    trial_rows,
)

SPACE = {"training.lr": Dimension(kind="log_uniform", low=1e-4, high=1e-1),
         "training.batch_size": Dimension(kind="grid", values=[16, 32])}


@pytest.mark.unit
@pytest.mark.parametrize("spec, message", [
    ({"kind": "choice"}, "kind='choice' needs values, a non-empty list; got None"),
    ({"kind": "uniform", "low": 1.0, "high": 0.5}, "kind='uniform' needs low < high; got low=1.0, high=0.5"),
    ({"kind": "log_uniform", "low": 0.0, "high": 1.0}, "kind='log_uniform' needs low > 0; got low=0.0"),
    ({"kind": "normal", "low": 0.0, "high": 1.0}, "kind"),
])
def test_a_bad_dimension_says_what_it_needs(spec, message):
    with pytest.raises(ValidationError, match=message):
        Dimension.model_validate(spec)


@pytest.mark.unit
def test_the_grid_sampler_needs_a_grid_and_says_which_dimensions_are_not():
    with pytest.raises(ValueError, match=r"\['training.lr'\] are not"):
        make_sampler(SweepSettings(sampler="grid"), SPACE)
    assert grid({"training.batch_size": SPACE["training.batch_size"]}) == {"training.batch_size": [16, 32]}


@pytest.mark.unit
def test_a_metric_the_trials_never_report_is_refused():
    with pytest.raises(ValueError, match=r"settings.metric='accuracy' is not a metric transfer-learning reports each "
                       r"epoch; use one of val_acc, val_loss, train_acc, train_loss"):
        check_metric(SweepSettings(metric="accuracy"))
    check_metric(SweepSettings(metric="val_loss"))


@pytest.mark.unit
@pytest.mark.unit
def test_a_trial_size_range_is_set_in_settings_and_a_gang_s_range_is_refused_in_a_sweep():
    assert SweepSettings(ranks_per_trial=3, min_ranks_per_trial=2).min_ranks_per_trial == 2
    with pytest.raises(ValueError, match=r"min_ranks_per_trial=3 above ranks_per_trial=2; give min_ranks_per_trial"):
        SweepSettings(ranks_per_trial=2, min_ranks_per_trial=3)
    with pytest.raises(ValueError, match=r"cluster.min_world_size=2 sizes a training run's gang.*"
                                         r"set settings.min_ranks_per_trial"):
        check_trial_sizes(ClusterConfig(world_size=3, min_world_size=2))
    check_trial_sizes(ClusterConfig(world_size=3))


def test_a_path_that_names_no_parameter_is_refused():
    with pytest.raises(ValueError, match="names 'training.lrr', which is no parameter of transfer-learning"):
        check_space({"training.lrr": SPACE["training.lr"]})
    check_space(SPACE)


@pytest.mark.unit
def test_trial_parameters_reach_into_the_nested_config():
    base = {"training": {"lr": 0.1, "epochs": 3}, "model": {"backbone": "resnet18"}}
    changed = with_params(base, {"training.lr": 0.01, "model.backbone": "resnet50"})
    assert changed == {"training": {"lr": 0.01, "epochs": 3}, "model": {"backbone": "resnet50"}}
    assert base["training"]["lr"] == 0.1  # the base is not changed
    assert trial_run_name(3, {"training.lr": 0.0012345, "training.batch_size": 32}) == "trial-3 lr=0.00123 batch_size=32"


@pytest.mark.unit
def test_a_resumed_study_retries_what_a_crash_left_running_and_counts_the_rest():
    study = optuna.create_study(direction="maximize")
    settings = SweepSettings(n_trials=4)
    done = study.ask({"training.lr": SPACE["training.lr"].distribution()})
    study.tell(done, 0.5)
    crashed = study.ask({"training.lr": SPACE["training.lr"].distribution()})  # left RUNNING
    assert trials_left(study, settings, SPACE) == 3
    assert study.trials[crashed.number].state == TrialState.FAIL and study.trials[crashed.number].user_attrs[INTERRUPTED]
    retried = study.ask({"training.lr": SPACE["training.lr"].distribution()})
    assert retried.params == crashed.params  # queued again with the same parameters


@pytest.mark.unit
def test_the_comparison_sorts_by_the_metric_and_weighs_parameters():
    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(4):
        trial = study.ask({"lr": SPACE["training.lr"].distribution(), "bs": optuna.distributions.IntDistribution(8, 64)})
        for epoch in (1, 2):
            trial.report(trial.params["lr"] * 10 / epoch, epoch)
        trial.set_user_attr("outcome", {"state": "completed", "run": f"trial-{trial.number}", "seconds": 1.0,
                                        "model_url": f"/out/t{trial.number}/model.pt"})
        study.tell(trial, trial.params["lr"] * 5)
    rows = trial_rows(study)
    assert [r["value"] for r in rows] == sorted(r["value"] for r in rows)
    assert rows[0]["best_epoch"] == 2 and rows[0]["state"] == "completed"
    weights = importances(study)
    assert weights is not None and set(weights) == {"lr", "bs"}
    markdown = sweep_markdown(SweepSettings(metric="loss", direction="minimize"), rows, best_row(rows), "PLOT", weights)
    assert f"**Best: trial {rows[0]['trial']}**" in markdown and "## Parameter importances" in markdown


def test_a_database_password_is_refused_as_a_parameter_and_taken_from_a_block_instead(prefect_api, tmp_path):
    with pytest.raises(ValidationError, match=r"settings.storage holds a password.*study-storage block.*"
                       r"settings.storage_block='NAME'") as refused:
        SweepSettings(storage="postgresql://optuna:s3cret@db.internal/studies")
    assert "s3cret" not in str(refused.value)
    with pytest.raises(ValidationError, match="settings got both storage=.* and storage_block='studies'"):
        SweepSettings(storage="sqlite:///x.db", storage_block="studies")
    url = f"sqlite:///{tmp_path}/secret-study.db"
    StudyStorage(url=url).save("test-studies", overwrite=True)
    assert study_storage(SweepSettings(storage_block="test-studies"), "s3://bucket/out") == url
    with pytest.raises(ValueError, match=r"No study-storage block named 'missing'.*StudyStorage\(...\).save\('missing'\)"):
        study_storage(SweepSettings(storage_block="missing"), "s3://bucket/out")


@pytest.mark.unit
def test_a_sweep_fails_only_when_no_trial_of_its_study_trained():
    study = optuna.create_study(study_name="s", direction="maximize")
    distribution = {"training.lr": SPACE["training.lr"].distribution()}
    for _ in range(2):
        trial = study.ask(distribution)
        trial.set_user_attr("outcome", {"state": "failed", "message": "NameError: name 'loss' is not defined"})
        study.tell(trial, state=TrialState.FAIL)
    failed = TrialsRun(trained=0, failed={0: "ValueError: batch_size too large", 1: "ValueError: batch_size too large"})
    with pytest.raises(NoTrialTrained, match=r"Sweep 's': none of its 2 trial\(s\) trained.*trial 0: ValueError"):
        failed.require_one_trained(study)
    # Run again with nothing left to train, over a study none of whose trials trained: never Completed.
    with pytest.raises(NoTrialTrained, match=r"Sweep 's' trained no trial in this run.*trial 0: NameError.*"
                       r"settings.retry_failed=true"):
        TrialsRun().require_one_trained(study)
    pruned = study.ask(distribution)
    pruned.report(0.1, 1)
    study.tell(pruned, state=TrialState.PRUNED)
    TrialsRun().require_one_trained(study)  # a pruned trial trained: run again, the sweep ends as it did
    failed.require_one_trained(study)  # continued with more trials that all failed: the study keeps its result


@pytest.mark.unit
def test_a_sweep_run_again_queues_its_failed_trials_once_unless_told_not_to():
    study = optuna.create_study(direction="maximize")
    space = {"training.lr": SPACE["training.lr"]}
    distribution = {"training.lr": space["training.lr"].distribution()}
    study.tell(study.ask(distribution), 0.5)
    for _ in range(2):
        study.tell(study.ask(distribution), state=TrialState.FAIL)
    assert trials_left(study, SweepSettings(n_trials=3, retry_failed=False), space) == 0
    assert trials_left(study, SweepSettings(n_trials=3), space) == 2
    retried = [study.ask(distribution) for _ in range(2)]
    assert [trial.params for trial in retried] == [study.trials[1].params, study.trials[2].params]
    for trial in retried:
        study.tell(trial, 0.6)
    assert trials_left(study, SweepSettings(n_trials=3), space) == 0  # the same failures are not queued twice
    assert trials_left(study, SweepSettings(n_trials=3, retry_failed=False), space) == 0  # each counted once
    assert not study.get_trials(states=(TrialState.WAITING,))


@pytest.mark.unit
def test_failed_trials_are_queued_again_only_as_room_and_the_space_allow():
    wide = {"training.lr": Dimension(kind="log_uniform", low=1e-4, high=10.0)}
    distribution = {"training.lr": wide["training.lr"].distribution()}

    def study_of(completed: int, failed_lrs: tuple[float, ...]) -> optuna.Study:
        study = optuna.create_study(direction="maximize")
        for _ in range(completed):
            study.tell(study.ask(distribution), 0.5)
        for lr in failed_lrs:
            study.enqueue_trial({"training.lr": lr})
            study.tell(study.ask(distribution), state=TrialState.FAIL)
        return study

    # n_trials lowered to 2 beside one completed trial: room for one retry; the other failure is
    # neither queued nor marked, and waits for room in a later run.
    lowered = study_of(1, (0.001, 0.002))
    assert trials_left(lowered, SweepSettings(n_trials=2), wide) == 1
    assert lowered.user_attrs[RETRIED] == [1]
    assert [t.system_attrs["fixed_params"] for t in lowered.get_trials(states=(TrialState.WAITING,))] == [{"training.lr": 0.001}]
    # The space narrowed so that lr=5.0 lies outside it: that failure is never queued again, and counts.
    narrowed = study_of(0, (5.0, 0.001))
    narrow = {"training.lr": Dimension(kind="log_uniform", low=1e-4, high=1e-2)}
    assert trials_left(narrowed, SweepSettings(n_trials=4), narrow) == 3
    assert narrowed.user_attrs[RETRIED] == [1]
    assert [t.system_attrs["fixed_params"] for t in narrowed.get_trials(states=(TrialState.WAITING,))] == [{"training.lr": 0.001}]
    # A choice that no longer holds a failed value, a dimension added or gone: not queued, no error.
    sizes = {"training.batch_size": Dimension(kind="grid", values=[16, 32])}
    assert not in_space({"training.batch_size": 64}, sizes) and in_space({"training.batch_size": 32}, sizes)
    assert not in_space({"training.batch_size": 32, "training.lr": 0.1}, sizes) and not in_space({}, sizes)
