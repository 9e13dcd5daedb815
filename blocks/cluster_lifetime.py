"""A flow run's Dask cluster, started and closed beside the flow's other work.

A local cluster takes about 4.5 s to start here (the scheduler, then worker processes that
import torch and Prefect) and 1-2.5 s to close (each worker process tears down its
interpreter). A flow needs it only from the decode check to the end of training, so
`ClusterLifetime` starts it in a thread while the flow validates, lists and splits, and
closes it in a thread while the flow aggregates, promotes and reports
(docs/architecture.md, "The life of a run"; bench/RESULTS.md, "Launch tax").

    with ClusterLifetime(spec.task_runner) as cluster:     # starting from here
        manifest = index_images(...)                         # ... while this lists
        run_gang(..., task_runner=cluster.ready())           # waits for the start, if still under way
        cluster.close_in_background()                        # the flow needs it no more
        publish_report(...)                                  # ... while it closes
    # leaving the block waits for the close: when the run ends, its cluster is gone

Where the process that started the run keeps a cluster warm (blocks/warm_cluster.py), the
run uses that one instead when it fits: `ClusterLifetime.of(spec)` claims it, the start
only connects, and the close names its workers for replacement and lets go of it. Where
the warm cluster cannot give the run fresh workers after all (its holder could not
replace the last run's, or it did not answer), the start logs why and starts the run's
own cluster instead: a warm cluster saves seconds, and never fails a run.

Even the runner is made in the thread (`DaskCluster.task_runner` checks that an existing
scheduler answers), so a start that fails is raised by `ready()`: a flow that finds bad
input before it needs the cluster reports that input, not the cluster. Such a flow still
waits for a local cluster's start to end before it can close it (a few seconds).
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Self

from distributed import Client
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect_dask import DaskTaskRunner

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.warm_cluster import WarmClaim, WarmClusterUnavailable, claim_warm_cluster
from prefect_ddp.blocks.worker_events import send_workers_queued
from prefect_ddp.tasks.reporting import flow_api_url, run_logger

logger = logging.getLogger(__name__)


def api_url_named() -> AbstractContextManager:
    """Within it, this flow's Prefect settings name the API it records on, also a temporary server's.

    prefect_dask sends the flow's settings with every task, and a worker runs the task under
    them. Where the flow uses a temporary server, those settings name no API, and where they
    set anything at all (any PREFECT_* variable in the flow's environment, a profile's
    setting), the worker took them over its own PREFECT_API_URL: each worker that ran a task
    started a temporary server of its own (3 servers for 2 workers, seen with
    PREFECT_API_REQUEST_TIMEOUT set; tests/test_plain_script.py). Outside a flow run there is
    no server to name, and asking for one would start it.
    """
    if PREFECT_API_URL.value() or FlowRunContext.get() is None:
        return nullcontext()
    return temporary_settings({PREFECT_API_URL: flow_api_url()})


class ClusterLifetime:
    """Make, enter and start a DaskTaskRunner in a thread; close it in a thread."""

    def __init__(self, make_runner: Callable[[], DaskTaskRunner], warm: WarmClaim | None = None,
                 own: Callable[[], DaskTaskRunner] | None = None) -> None:
        self._make_runner = make_runner
        self._warm = warm
        self._own = own  # the run's own cluster, where the warm one fails it
        self.runner: DaskTaskRunner | None = None
        self._client: Client | None = None
        self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cluster-lifetime")
        self._start: Future | None = None
        self._close: Future | None = None
        self._lock = threading.Lock()
        self._began = 0.0
        self._up_after_s = 0.0
        self._closed_in_s = 0.0
        self._api_named: AbstractContextManager = nullcontext()

    @classmethod
    def of(cls, spec: DaskCluster) -> ClusterLifetime:
        """`spec`'s cluster: the warm one of the process that started this run where it fits, else its own."""
        warm = claim_warm_cluster(spec)
        return cls(warm.task_runner, warm, spec.task_runner) if warm else cls(spec.task_runner)

    @property
    def is_warm(self) -> bool:
        """Whether the run uses the warm cluster of the process that started it."""
        return self._warm is not None

    def __enter__(self) -> Self:
        self._api_named = api_url_named()
        self._api_named.__enter__()
        # The thread sees this flow's Prefect settings (the API URL workers are told) only
        # through a copy of this thread's context.
        context = contextvars.copy_context()
        self._began = time.monotonic()
        self._start = self._threads.submit(context.run, self._started)
        return self

    def _started(self) -> None:
        try:
            client = self._enter(self._make_runner)
            if self._warm:
                self._warm.prepare(client)
        except Exception as exc:
            if not self._warm or self._own is None:
                raise
            self._fall_back(exc, self._warm, self._own)
        self._up_after_s = time.monotonic() - self._began

    def _enter(self, make_runner: Callable[[], DaskTaskRunner]) -> Client:
        self.runner = make_runner().__enter__()
        self._client = self.runner.client  # the runner starts (or connects to) its cluster on first use
        return self._client

    def _fall_back(self, exc: Exception, warm: WarmClaim, own: Callable[[], DaskTaskRunner]) -> None:
        """Let go of `warm`, the warm cluster, which could not serve this run, and start the run's `own`."""
        reason = str(exc) if isinstance(exc, WarmClusterUnavailable) else f"{type(exc).__name__}: {exc}"
        run_logger().warning("Not using the warm Dask cluster after all: %s. Starting a cluster for this run.",
                             reason)
        self._warm = None
        try:
            if self.runner is not None:
                self.runner.__exit__(None, None, None)
        finally:
            warm.withdraw()
        self.runner = self._client = None
        self._enter(own)

    def ready(self) -> DaskTaskRunner:
        """The runner, once its cluster is up; a failed start raises here, in the flow."""
        assert self._start is not None, "ClusterLifetime.ready() outside its with block"
        asked = time.monotonic()
        self._start.result()
        assert self.runner is not None
        run_logger().info(
            "Dask cluster up %.1f s after the run asked for it; the run waited %.1f s of that "
            "(the rest went on beside its listing)", self._up_after_s, time.monotonic() - asked)
        return self.runner

    def close_in_background(self) -> None:
        """Start closing the cluster; the flow must not use the runner after this."""
        with self._lock:
            if self._close is None:
                context = contextvars.copy_context()
                self._close = self._threads.submit(context.run, self._closed_after_start, None, None, None)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            closing = self._close
        try:
            if closing is None:
                self._closed_after_start(exc_type, exc, tb)
            else:
                waited = time.monotonic()
                closing.result()
                done = "let go of (its workers being replaced for the next run)" if self._warm else "closed"
                run_logger().info("Dask cluster %s in %.1f s beside the run's report; the run waited %.1f s of "
                                  "that at its end", done, self._closed_in_s, time.monotonic() - waited)
        finally:
            self._threads.shutdown(wait=True)
            self._api_named.__exit__(None, None, None)

    def _closed_after_start(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                            tb: TracebackType | None) -> None:
        """Close the runner once a start still under way has ended (else its cluster would leak)."""
        if self._start is not None:
            try:
                self._start.result()
            except Exception:  # already raised to the flow by ready(), or the flow failed before
                logger.debug("The cluster did not start; closing what there is", exc_info=True)
        began = time.monotonic()
        try:
            if self.runner is not None:  # else not even made: nothing to close
                if self._client is not None and (self._warm or self.runner.address is None):  # workers it ends
                    send_workers_queued(self._client)
                if self._warm:
                    self._warm.release(self._client)  # never raises: a failure leaves the in-use mark
                self.runner.__exit__(exc_type, exc, tb)
        finally:
            if self._warm:
                self._warm.unlock()
        self._closed_in_s = time.monotonic() - began
