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

from concurrent.futures import ThreadPoolExecutor

from distributed import Client
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker

from prefect_ddp.tasks.reporting import run_logger

# How long a worker may take to send each of its queues (events, then logs): a server that
# answers nothing for longer (docs/architecture.md, "Facts: Prefect") loses them as before.
SEND_S = 20.0


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


def send_workers_queued(client: Client) -> None:
    """Have every worker of `client`'s cluster send what it holds for the Prefect server
    (`send_queued`); warn of those that could not. Never raises: the run's outcome is made."""
    try:
        sent = client.run(send_queued, SEND_S)
    except Exception as error:  # a worker gone meanwhile: what it held is lost either way
        run_logger().warning("Could not have the Dask workers send their Prefect events and logs before closing "
                             "them (%s): task runs may show an earlier state than their last.", error)
        return
    unsent = sorted(worker for worker, done in sent.items() if not done)
    if unsent:
        run_logger().warning("Workers %s could not send their Prefect events and logs within %.0f s before they were "
                             "closed: their task runs may show an earlier state than their last.", unsent, SEND_S)
