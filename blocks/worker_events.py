"""What a cluster's workers still hold for the Prefect server, sent before the flow closes them.

A rank's task run reaches the server as events its worker sends from a queue, in a thread of its
own (Prefect's `EventsWorker`), after the rank has returned; its log lines likewise
(`APILogWorker`). A worker closed with its cluster before they left, killed by its nanny when it
has not closed within seconds, never sends them: the rank's task run stayed RUNNING after its flow
had completed (seen in CI, after a Prefect server restart held a worker's events back). So before
a flow closes its own cluster, or lets go of a warm one whose workers are then replaced, each
worker sends what it holds (`ClusterLifetime`, blocks/cluster_lifetime.py). Not an external
cluster's: its workers stay, and other flows' tasks there would lose what they send meanwhile.

Sending is Prefect's drain: it stops the services, which start again at the next event or log. An
event already written into a socket that a server restart cut is not sent again (Prefect keeps
no copy once its client closes): this narrows the loss, it does not end it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from distributed import Client
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker

from prefect_ddp.tasks.reporting import run_logger

# How long a worker may take to send what it holds, events and logs together: a server that
# answers nothing for longer (docs/architecture.md, "Facts: Prefect") loses them as before.
SEND_S = 15.0
# How long the flow waits for its workers' answers: their sending and a margin for the round trip.
WAIT_S = SEND_S + 10


def drained(timeout_s: float) -> bool:
    """Send what this process's Prefect event and log queues hold, within `timeout_s` in all;
    whether all was sent. (drain_all drains every Prefect queue service, whichever class it is
    called on; the second call finds nothing left where the first finished.)"""
    deadline = time.monotonic() + timeout_s
    unsent = 0
    for service in (EventsWorker, APILogWorker):
        waited = service.drain_all(timeout=max(0.0, deadline - time.monotonic()))
        assert isinstance(waited, tuple)  # no event loop runs in this thread: (done, not done) futures
        unsent += len(waited[1])
    return not unsent


async def send_queued(timeout_s: float = SEND_S) -> bool:
    """On a worker: `drained`, in a thread, so the worker's event loop (its heartbeats, the ranks'
    progress) goes on meanwhile."""
    return await asyncio.to_thread(drained, timeout_s)


def send_workers_queued(client: Client, wait_s: float = WAIT_S) -> None:
    """Have every worker of `client`'s cluster send what it holds for the Prefect server
    (`send_queued`), waiting for their answers up to `wait_s`; warn of those that could not.
    Never raises: the run's outcome is made.

    The wait is bounded here, in a daemon thread: a frozen worker (stopped, or its event loop
    held) never answers `client.run`, which has no deadline of its own; closing the client
    ends the call left waiting."""
    answered: list[dict[str, Any]] = []  # one dict, appended whole once all answered

    def ask() -> None:
        try:
            answered.append(client.run(send_queued, SEND_S, on_error="return"))
        except Exception as error:  # the scheduler gone, or the client closed while it waited
            answered.append({"the scheduler": error})

    asking = threading.Thread(target=ask, name="send-workers-queued", daemon=True)
    asking.start()
    asking.join(wait_s)
    unsent = sorted(worker for worker, answer in (answered[0] if answered else {}).items() if answer is not True)
    if not answered or unsent:
        said = f"{unsent}" if unsent else f"every worker (not all answered within {wait_s:.0f} s)"
        run_logger().warning("Before closing its Dask workers the run could not have %s send the Prefect events and "
                             "logs they held: their task runs may show an earlier state than their last.", said)
