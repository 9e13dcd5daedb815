"""Rank 0's progress updates never hold up training, even when the Prefect API hangs."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from prefect.artifacts import create_progress_artifact
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_ddp.tasks.reporting import BackgroundPublisher

pytestmark = pytest.mark.unit


@pytest.fixture
def hanging_api() -> Iterator[str]:
    """An HTTP endpoint that accepts connections and never answers (a hung server, not a down one)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/api"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_updates_to_a_hanging_api_return_at_once_and_closing_is_bounded(hanging_api, caplog):
    with temporary_settings({PREFECT_API_URL: hanging_api}):
        publisher = BackgroundPublisher(logging.getLogger("test"))
        started = time.monotonic()
        for percent in range(100):
            publisher.submit("progress", lambda percent=percent: create_progress_artifact(float(percent)))
        # At once (0.01 s quiet): one blocking submit would wait on the hanging API.
        assert time.monotonic() - started < 5
        started = time.monotonic()
        assert publisher.close(timeout_s=1.0) is False
        assert time.monotonic() - started < 10  # bounded by its timeout, not the API's hang
    assert "did not answer within 1 s" in caplog.text


def test_only_the_latest_update_per_key_is_sent_and_failures_are_logged(caplog):
    sent: list[str] = []
    gate = threading.Event()
    publisher = BackgroundPublisher(logging.getLogger("test"))
    publisher.submit("progress", lambda: (gate.wait(5), sent.append("first")))
    time.sleep(0.2)  # the first call is in flight; the next three queue behind it
    for name in ("second", "third"):
        publisher.submit("progress", lambda name=name: sent.append(name))
    publisher.submit("table", lambda: 1 / 0)
    gate.set()
    assert publisher.close(timeout_s=5) is True
    assert sent == ["first", "third"]
    assert "Could not publish training progress (to Prefect or MLflow): division by zero" in caplog.text
