"""What a cluster's workers still hold for the Prefect server, sent before the flow closes them.

A rank's task run reaches the server as events its worker sends from a queue, in a thread of its
own (Prefect's `EventsWorker`), after the rank has returned; its log lines likewise
(`APILogWorker`). A worker closed with its cluster before they left, killed by its nanny when it
has not closed within seconds, never sends them: the rank's task run stayed RUNNING after its flow
had completed (seen in CI, after a Prefect server restart held a worker's events back). So before
a flow closes its cluster, or lets go of a warm one whose workers are then replaced, each worker
sends what it holds, for at most SEND_S a queue (`ClusterLifetime`, blocks/cluster_lifetime.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distributed import Client
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker

from prefect_ddp.tasks.reporting import run_logger

# How long a worker may take to send each of its queues (events, then logs): a server that
# answers nothing for longer (docs/architecture.md, "Facts: Prefect") loses them as before.
SEND_S = 15.0
# How long the flow waits for its workers' answers: both queues' time and a margin for the round trip.
WAIT_S = 2 * SEND_S + 5


def send_queued(timeout_s: float = SEND_S) -> bool:
    """On a worker: send the Prefect events and logs its queues hold, waiting up to `timeout_s` for
    each; whether all were sent. Their services stop, and start again at the next event or log."""
    def drained() -> bool:
        unsent = 0
        for service in (EventsWorker, APILogWorker):
            waited = service.drain_all(timeout=timeout_s)
            assert isinstance(waited, tuple)  # no event loop runs in this thread: (done, not done) futures
            unsent += len(waited[1])
        return not unsent

    # In a thread of its own: on the worker's event loop, drain_all would hand back a coroutine.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(drained).result()


def send_workers_queued(client: Client, wait_s: float = WAIT_S) -> None:
    """Have every worker of `client`'s cluster send what it holds for the Prefect server
    (`send_queued`), waiting for their answers up to `wait_s`; warn of those that could not.
    Never raises: the run's outcome is made.

    The wait is bounded here, in a daemon thread: a frozen worker (stopped, or its event loop
    held) never answers `client.run`, which has no deadline of its own; closing the client
    ends the call left waiting."""
    answers: dict[str, Any] = {}

    def ask() -> None:
        try:
            answers.update(client.run(send_queued, SEND_S, on_error="return"))
        except Exception as error:  # the scheduler gone, or the client closed while it waited
            answers["the scheduler"] = error

    asking = threading.Thread(target=ask, name="send-workers-queued", daemon=True)
    asking.start()
    asking.join(wait_s)
    unsent = sorted(worker for worker, answer in answers.items() if answer is not True)
    if asking.is_alive() or unsent:
        said = f"{unsent}" if unsent else f"every worker (not all answered within {wait_s:.0f} s)"
        run_logger().warning("Before closing its Dask workers the run could not have %s send the Prefect events and "
                             "logs they held: their task runs may show an earlier state than their last.", said)
