"""A cluster's workers send the Prefect events they hold before the flow closes them (blocks/worker_events.py)."""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid

import httpx

from prefect_ddp.blocks.cluster import create_local_cluster
from prefect_ddp.blocks.worker_events import send_workers_queued


def emit(resource_id: str) -> None:
    """On a worker: queue one event for the Prefect server, as a rank's task run queues its states."""
    from prefect.events import emit_event

    emit_event(event="prefect-ddp.test.queued", resource={"prefect.resource.id": resource_id})


def recorded(api_url: str, resource_id: str, wait_s: float = 90) -> bool:
    """Whether the server records an event of `resource_id` within `wait_s` (it persists them in batches)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        page = httpx.post(f"{api_url}/events/filter", json={"filter": {"resource": {"id": [resource_id]}}},
                          timeout=60).json()
        if page.get("events"):
            return True
        time.sleep(1)
    return False


# Not `unit`: a real Prefect server and a cluster of its own, whose workers are killed as a nanny kills one.
def test_a_workers_queued_events_reach_the_server_though_it_is_killed_right_after_and_another_is_frozen(
        prefect_api, caplog):
    resource_id = f"prefect-ddp.test.{uuid.uuid4()}"
    with create_local_cluster(n_workers=2) as cluster, cluster.get_client() as client:
        pids = client.run(os.getpid)
        sending, frozen = sorted(pids)
        client.run(emit, resource_id, workers=[sending])
        os.kill(pids[frozen], signal.SIGSTOP)  # it never answers: the flow's end must not wait for it
        try:
            asked = time.monotonic()
            with caplog.at_level(logging.WARNING):
                send_workers_queued(client, wait_s=10)
            waited = time.monotonic() - asked
        finally:
            for pid in pids.values():
                os.kill(pid, signal.SIGKILL)  # as a nanny kills a worker that has not closed within seconds
    assert waited < 60 and "not all answered within 10 s" in caplog.text
    assert recorded(prefect_api, resource_id)
