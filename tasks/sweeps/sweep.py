"""Many trials of one trainable on one cluster: Optuna asks, trials train, Optuna is told.

Optuna is the engine (ask/tell with its samplers and pruners). Each trial's gang reports
its metric after every epoch through `ctx.report`; the report reaches this process
through the trial's relay (prefect_ddp.tasks.sweeps.trial_relay), which records it on the study and asks the
pruner. Only this process opens the study, so it may live where the cluster cannot reach
(SQLite on the flow's host: below a local output, or in a private folder of the user's
for an S3 output), or in a database named by a `study-storage` block (its URL holds a
password). Running a sweep again under the same name continues it: finished trials are
not trained again, and trials a crash left running are tried again with the same
parameters; while a sweep of that name is running, a second one is refused.

Trials run concurrently on a pool of `concurrency` threads, each with a copy of the
flow's Prefect context; their gangs take disjoint workers of the one cluster through
worker leases. (Not as Prefect task runs: a task run's function and parameters travel
with every Dask task started inside it, and a trial's are not meant to travel.)
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import distributed
import optuna
from optuna.trial import TrialState
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner

from prefect_ddp.blocks.saved import load_block
from prefect_ddp.blocks.study_storage import StudyStorage
from prefect_ddp.tasks.gang import (
    PRUNED_AT,
    TrialLink,
    current_dask_runner,
    run_gang,
    stop_all_gangs,
    stop_scope,
)
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.private_folder import private_folder
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.selection import best_index
from prefect_ddp.tasks.sweeps.search_space import (
    Dimension,
    describe,
    distributions,
    grid,
    grid_size,
    with_params,
)
from prefect_ddp.tasks.sweeps.settings import (
    INTERRUPTED,
    OUTCOME,
    RETRIED,
    SweepSettings,
    TrialOutcome,
    direction_of,
)
from prefect_ddp.tasks.sweeps.sweep_report import publish_sweep_report
from prefect_ddp.tasks.sweeps.trial_relay import TrialRelay
from prefect_ddp.tasks.urls import absolute_url, child_url, is_local_url, safe_segment

# Which sweep runs the study now, kept on the study: {"id", "name", "beat"}.
OWNER = "running_sweep"
HEARTBEAT_S = 10.0
OWNER_STALE_S = 60.0
CLAIM_SETTLE_S = 0.5
STUDY_DIR_ENV = "PREFECT_DDP_STUDY_DIR"


def study_storage(settings: SweepSettings, output_url: str) -> str:
    """Where the study lives: the block's or the given URL, else SQLite on this host.

    With a local output that is `<output>/<name>/study.db`, beside the sweep's report; with
    an S3 output, a private folder of the user's keyed by the output URL
    ($PREFECT_DDP_STUDY_DIR, else the XDG data folder), so running the sweep again from
    this host continues it.
    """
    if settings.storage_block:
        return load_block(StudyStorage, settings.storage_block).url.get_secret_value()
    if settings.storage:
        return settings.storage
    folder: Path | str
    if not is_local_url(output_url):
        digest = hashlib.sha256(output_url.encode()).hexdigest()[:16]
        folder = private_folder(study_root() / digest / safe_segment(settings.name),
                                fix=f"set {STUDY_DIR_ENV} to a folder of your own")
    else:
        folder = child_url(os.path.abspath(output_url.removeprefix("file://")), safe_segment(settings.name))
        os.makedirs(folder, exist_ok=True)
    run_logger().info("Sweep %r keeps its study in %s/study.db.", settings.name, folder)
    return f"sqlite:///{folder}/study.db"


def study_root() -> Path:
    """The user's folder of studies for sweeps whose output is not a local folder."""
    if os.environ.get(STUDY_DIR_ENV):
        return Path(os.environ[STUDY_DIR_ENV])
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(data_home) / "prefect-ddp" / "studies"


class AskTellGridSampler(optuna.samplers.GridSampler):
    """GridSampler for ask/tell: it calls study.stop() once the grid is done, which raises
    outside study.optimize; here `trials_left` counts the grid instead."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


def make_sampler(settings: SweepSettings, space: dict[str, Dimension]) -> optuna.samplers.BaseSampler:
    if settings.sampler == "grid":
        return AskTellGridSampler(grid(space), seed=settings.seed)
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    return optuna.samplers.TPESampler(seed=settings.seed)


def make_pruner(settings: SweepSettings, max_epochs: int | str) -> optuna.pruners.BasePruner:
    if settings.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=settings.startup_trials, n_warmup_steps=0)
    if settings.pruner == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max_epochs)
    return optuna.pruners.NopPruner()


def open_study(settings: SweepSettings, space: dict[str, Dimension], storage: str, max_epochs: int | str) -> optuna.Study:
    """Create the study, or load it when a sweep of this name ran before (resume)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        study_name=settings.name, storage=storage, direction=settings.direction,
        sampler=make_sampler(settings, space), pruner=make_pruner(settings, max_epochs),
        load_if_exists=True,
    )


def trials_left(study: Any, settings: SweepSettings, space: dict[str, Dimension]) -> int:
    """How many trials still to train; trials a crash left running are queued again, and so are
    those that failed in an earlier run, as many as `n_trials` has room for (unless
    `settings.retry_failed` is false, or their parameters lie outside `space` now)."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        optuna.trial.Trial(study, trial._trial_id).set_user_attr(INTERRUPTED, True)
        study.tell(trial.number, state=TrialState.FAIL)
        study.enqueue_trial(trial.params)
    if not study.trials:
        for params in settings.first_trials:
            study.enqueue_trial(params)
    wanted = min(settings.n_trials, grid_size(space)) if settings.sampler == "grid" else settings.n_trials
    retried = set(study.user_attrs.get(RETRIED, []))
    finished = [t for t in study.trials if t.state.is_finished() and not t.user_attrs.get(INTERRUPTED)]
    if not settings.retry_failed:  # a failure counts as finished, once: its retry, where one ran, instead
        return max(0, wanted - len([t for t in finished if t.number not in retried]))
    failed = [t for t in finished if t.state == TrialState.FAIL and t.number not in retried
              and in_space(t.params, space)]
    counted = [t for t in finished if t.number not in retried and t not in failed]  # out of the space: counted
    again = failed[:max(0, wanted - len(counted))]  # a retry takes its failure's place; the rest wait for room
    for trial in again:
        study.enqueue_trial(trial.params)
    if again:
        run_logger().info("Sweep %r trains the parameters of failed trial(s) %s again.", settings.name,
                          ", ".join(str(t.number) for t in again))
        study.set_user_attr(RETRIED, sorted(retried | {t.number for t in again}))
    return max(0, wanted - len(counted))


def in_space(params: dict[str, Any], space: dict[str, Dimension]) -> bool:
    """Whether `params` name the space's dimensions, each within its range or values now."""
    if set(params) != set(space):
        return False
    try:  # a choice's to_internal_repr raises for a value it no longer holds
        return all(distribution._contains(distribution.to_internal_repr(params[path]))
                   for path, distribution in distributions(space).items())
    except ValueError:
        return False


class SweepAlreadyRunning(RuntimeError):
    """Another sweep of the same name is running now: a second one would break the first."""


class NoTrialTrained(RuntimeError):
    """Every trial a sweep ran failed: the sweep found nothing, and must not look as if it had."""


@dataclass
class TrialsRun:
    """What became of the trials one sweep run trained. A pruned trial trained: it reported at
    least one epoch, and the sweep chose to stop it."""

    trained: int = 0
    failed: dict[int, str] = field(default_factory=dict)  # trial number -> why it failed

    def require_one_trained(self, study: optuna.Study) -> None:
        """Raise where no trial of `study` trained, in this run or an earlier one (a pruned trial
        trained): a sweep that trained nothing never ends Completed. Names this run's errors, else
        the study's."""
        if self.trained or study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
            return
        name = study.study_name
        if self.failed:
            errors = "; ".join(f"trial {number}: {reason}" for number, reason in sorted(self.failed.items()))
            raise NoTrialTrained(
                f"Sweep {name!r}: none of its {len(self.failed)} trial(s) trained, so there is no result to compare "
                f"or promote. Their errors: {errors}. Fix the cause and run it again under the same settings.name: "
                "it trains the failed trials again.")
        errors = "; ".join(f"trial {number}: {reason}" for number, reason in sorted(failed_trials(study).items()))
        raise NoTrialTrained(
            f"Sweep {name!r} trained no trial in this run and its study has none that trained, so there is no result "
            f"to compare or promote. The study's failed trials: {errors or 'none'}. Set settings.retry_failed=true "
            "to train them again, raise settings.n_trials, or give another settings.name to start a new study.")


def failed_trials(study: optuna.Study) -> dict[int, str]:
    """Why each failed trial of the study failed (not those a crash interrupted), by number."""
    return {trial.number: TrialOutcome.model_validate(trial.user_attrs.get(OUTCOME, {})).message or "no metric reported"
            for trial in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
            if not trial.user_attrs.get(INTERRUPTED)}


def owner_of(study: optuna.Study) -> dict[str, Any] | None:
    """The sweep that holds the study now: one whose heartbeat is fresh, else None."""
    owner = study.user_attrs.get(OWNER)
    return owner if owner and time.time() - owner["beat"] < OWNER_STALE_S else None


def refuse_if_held(study: optuna.Study, me: dict[str, Any]) -> None:
    owner = owner_of(study)
    if owner and owner["id"] != me["id"]:
        raise SweepAlreadyRunning(
            f"Sweep {study.study_name!r} is running now in {owner['name']} (seen {time.time() - owner['beat']:.0f} s "
            "ago): a second sweep of the same name would mark its running trials failed and break it. Wait "
            "for it to end or cancel it, or give this sweep another settings.name."
        )


@contextmanager
def sole_sweep(study: optuna.Study) -> Iterator[None]:
    """Hold `study` for this sweep while the block runs: a heartbeat on the study says so.

    A sweep that finds a fresh heartbeat of another refuses to start; one whose holder
    crashed (no beat for OWNER_STALE_S) takes over and retries the trials it left running.
    Two sweeps that claim at once both write, wait, and read again: the one overwritten leaves.
    """
    me = {"id": str(flow_run.get_id() or uuid.uuid4()), "name": f"flow run {flow_run.get_name() or '(none)'}"}
    refuse_if_held(study, me)
    study.set_user_attr(OWNER, me | {"beat": time.time()})
    time.sleep(CLAIM_SETTLE_S)
    refuse_if_held(study, me)
    stopped = threading.Event()

    def beat() -> None:
        while not stopped.wait(HEARTBEAT_S):
            try:
                study.set_user_attr(OWNER, me | {"beat": time.time()})
            except Exception:  # a busy database: the next beat is in time, OWNER_STALE_S is six of them
                run_logger().exception("Sweep %r: could not renew its heartbeat on the study", study.study_name)

    heart = threading.Thread(target=beat, name="sweep-heartbeat", daemon=True)
    heart.start()
    try:
        yield
    finally:
        stopped.set()
        heart.join()
        study.set_user_attr(OWNER, None)


def run_trials(
    study: optuna.Study, space: dict[str, Dimension], settings: SweepSettings, client: distributed.Client,
    train_trial: Callable[[Any, TrialLink], TrialOutcome],
) -> TrialsRun:
    """Ask for trials, `concurrency` at a time, until the study has `n_trials` finished ones;
    what became of the trials this call trained.

    `train_trial(trial, link)` trains one trial and returns its outcome (state, message,
    run, model_url); it runs in a thread of its own, while a relay takes its gang's
    reports into the study. Raises SweepAlreadyRunning while another sweep of this name runs.
    """
    with sole_sweep(study):
        to_run = trials_left(study, settings, space)
        log = run_logger()
        log.info("Sweep %r: %d trial(s) to train, %d at a time.", settings.name, to_run, settings.concurrency)
        with stop_scope() as stopping, ThreadPoolExecutor(max_workers=settings.concurrency,
                                                          thread_name_prefix="trial") as pool:
            try:
                return _ask_and_tell(study, space, settings, client, train_trial, to_run, pool)
            except BaseException:
                # Cancel, SIGTERM or Ctrl-C reach this thread only: stop the trials' gangs,
                # and keep them from forming again (a stop is never a failure to retry),
                # or their ranks would train on while this process waits for them.
                stopping.set()
                stop_all_gangs()
                raise


def _ask_and_tell(study: optuna.Study, space: dict[str, Dimension], settings: SweepSettings,
                  client: distributed.Client, train_trial: Callable[[Any, TrialLink], TrialOutcome],
                  to_run: int, pool: ThreadPoolExecutor) -> TrialsRun:
    pending: dict[Future, tuple[Any, float]] = {}
    trials = TrialsRun()
    while to_run or pending:
        while to_run and len(pending) < settings.concurrency:
            trial = study.ask(distributions(space))
            relay = TrialRelay(client, study, trial, settings.metric, settings.direction)
            # Each thread gets the flow's context, so its runs are this flow run's children.
            future = pool.submit(contextvars.copy_context().run, relayed, train_trial, trial, relay)
            pending[future] = (trial, time.monotonic())
            to_run -= 1
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            trial, started = pending.pop(future)
            failure = tell(study, trial, outcome_of(future).model_copy(
                update={"seconds": round(time.monotonic() - started, 1)}))
            if failure is None:
                trials.trained += 1
            else:
                trials.failed[trial.number] = failure
    return trials


def relayed(train_trial: Callable[[Any, TrialLink], TrialOutcome], trial: Any, relay: TrialRelay) -> TrialOutcome:
    """Train `trial` while its relay serves the reports of its gang."""
    with relay:
        return train_trial(trial, relay.link)


def outcome_of(future: Future) -> TrialOutcome:
    try:
        return future.result()
    except Exception as exc:  # one failed trial is a result of the sweep, not its end
        return TrialOutcome(state="failed", message=f"{type(exc).__name__}: {exc}")


def tell(study: Any, trial: Any, outcome: TrialOutcome) -> str | None:
    """Record a finished trial: its outcome, and its value (best reported) or its state; why it
    failed, or None where it trained (completed or pruned)."""
    trial.set_user_attr(OUTCOME, outcome.model_dump(exclude_none=True))
    (recorded,) = [t for t in study.get_trials(deepcopy=False) if t.number == trial.number]
    values = [value for _, value in sorted(recorded.intermediate_values.items())]
    log = run_logger()
    reason = None
    if PRUNED_AT in recorded.user_attrs:
        study.tell(trial, state=TrialState.PRUNED)
    elif outcome.state == "completed" and values:
        # The best epoch's value (prefect_ddp.tasks.selection): the epoch whose weights the trial kept.
        study.tell(trial, values[best_index(values, direction_of(study))])
    else:
        reason = outcome.message or "it reported no metric: call ctx.report(epoch, metrics) every epoch"
        log.warning("Trial %d failed: %s", trial.number, reason)
        study.tell(trial, state=TrialState.FAIL)
    log.info("Trial %d: %s.", trial.number, study.get_trials(deepcopy=False)[trial.number].state.name.lower())
    return reason


def trial_run_name(number: int, params: dict[str, Any]) -> str:
    """A run name that shows the trial's parameters: 'trial-3 lr=0.001 batch_size=16'."""
    return f"trial-{number} {describe(params, digits=3, separator=' ', short=True)}"


def gang_trial(train_fn: Callable, config: dict[str, Any], link: TrialLink, settings: SweepSettings,
               runner: DaskTaskRunner, output_url: str, max_restarts: int) -> TrialOutcome:
    """One trial of a user's trainable: a gang on leased workers, reporting to the study;
    its ranks find their own folder in `ctx.output_url`."""
    results = run_gang(train_fn, config, task_runner=runner, world_size=settings.ranks_per_trial,
                       min_world_size=settings.min_ranks_per_trial, max_restarts=max_restarts,
                       output_url=output_url, trial=link,
                       lease_timeout=timedelta(seconds=settings.lease_timeout_s))
    first = results[0] if isinstance(results[0], dict) else {}
    return TrialOutcome(state="completed", model_url=first.get("model_url"))


def sweep(
    train_fn: Callable,
    config: dict[str, Any],
    space: Mapping[str, Dimension | dict[str, Any]],
    settings: SweepSettings | None = None,
    *,
    task_runner: DaskTaskRunner | None = None,
    output: Location | str = "./outputs",
    max_restarts: int = 1,
) -> dict[str, Any]:
    """Sweep any per-rank training function over `space`, on the current flow's Dask cluster.

    Each trial runs `train_fn(ctx, config)` as a gang of `settings.ranks_per_trial` ranks
    with the trial's parameters set in `config` (dotted keys reach into nested dicts) and
    its own folder in `ctx.output_url` (`OUTPUT/NAME/trial-N`); when rank 0 returns a dict
    with `model_url`, the report names it as the trial's model. The
    function reports its metric every epoch with `if ctx.report(epoch, {"loss": loss}):
    break`; the pruner's answer reaches every rank together.

    Args:
        train_fn: the per-rank function, as for `run_gang`.
        config: the base configuration every trial starts from.
        space: per dotted key of `config`, how to draw it (a `Dimension` or its dict).
        settings: trials, concurrency, metric and direction, sampler, pruner, name.
        task_runner: the DaskTaskRunner; default: the current flow's.
        output: where `sweep.json`, the plots and the trials' folders go: a local folder
            (relative to the working directory) or an s3:// URL (a `Location` for its
            credentials); see `study_storage` for where the study goes.
        max_restarts: how often each trial's gang is formed again after a failure, as
            `run_gang`'s (1, as the flows' `cluster.max_restarts`); an elastic trial
            (`settings.min_ranks_per_trial`) re-forms on its survivors.

    Returns:
        What `sweep.json` holds: every trial (best first), the best one, importances.

    Raises:
        NoTrialTrained: no trial trained, in this run or an earlier one of the study (after the
            report is written).

    Example:
        >>> sweep(train, {"lr": 0.1, "epochs": 5},                      # doctest: +SKIP
        ...       {"lr": {"kind": "log_uniform", "low": 1e-4, "high": 1e-1}},
        ...       SweepSettings(n_trials=8, metric="loss", direction="minimize"))
    """
    settings = settings or SweepSettings()
    dimensions = {path: Dimension.model_validate(dimension) for path, dimension in space.items()}
    runner = task_runner or current_dask_runner()
    output = output if isinstance(output, Location) else Location(url=absolute_url(output))
    study = open_study(settings, dimensions, study_storage(settings, output.url),
                       max_epochs=config.get("epochs", "auto"))

    def train_trial(trial: Any, link: TrialLink) -> TrialOutcome:
        folder = child_url(output.url, safe_segment(settings.name), f"trial-{trial.number}")
        return gang_trial(train_fn, with_params(config, trial.params), link, settings, runner, folder, max_restarts)

    trials = run_trials(study, dimensions, settings, runner.client, train_trial)
    record = publish_sweep_report(study, settings, output)
    trials.require_one_trained(study)
    return record
