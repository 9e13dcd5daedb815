"""Where runs are tracked (an MLflow server) and how to reach it: plain settings and a session.

Tracking is optional (the `mlflow` extra). The flow's process and rank 0 get these
settings, never the Prefect block they were saved in (`blocks/tracking.py`), as with
`tasks.location.Location`. The secrets stay SecretStr until a request needs them.

MLflow reads its request settings from environment variables at each request, and the
fluent API (`mlflow.pytorch.log_model`) from a process-wide tracking URI: a session sets
both for its duration under one lock and restores them afterwards. The credentials never
go into the environment, where a Dask worker or any child process started meanwhile would
inherit them: every HTTP request MLflow makes (runs, metrics, models, artifacts, registry)
asks the auth provider that `MLFLOW_TRACKING_AUTH` names, and ours signs a request only
when its URL is on the server of a session open in this process, with that session's
credentials. Requests give up after two retries (MLflow's default retries for minutes):
tracking that fails warns and never holds up or fails the training (docs/architecture.md,
"Tracking and the registry").
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

# Per request: at most two retries, 1 s apart growing, 30 s each; no progress bars in logs.
REQUEST_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
_SESSION = threading.Lock()
# The name MLFLOW_TRACKING_AUTH gives MLflow: not a secret, only which provider signs requests.
AUTH_PROVIDER = "prefect-ddp-session"
# What tracking leaves in a process's environment: a session's settings while it is open, and
# the telemetry id `import mlflow` sets. Each process that tracks (the flow's, rank 0's worker)
# sets its own, so a run's process may differ from its workers in these alone (the warm
# cluster's fit check, blocks/warm_cluster.py, ignores them).
TRACKING_VARIABLES = frozenset(REQUEST_SETTINGS) | {"MLFLOW_TRACKING_AUTH", "_MLFLOW_TELEMETRY_SESSION_ID"}
_OPEN_SESSIONS: dict[str, Tracking] = {}  # tracking URI -> its settings, while a session is open
# The auth the environment's provider gives, where it named one before a session replaced it (a
# user's own plugin, e.g. single sign-on): every request still goes through it first.
_outer_auth: Any = None


class Tracking(BaseModel):
    """An MLflow tracking server, the experiment runs go to, and the credentials to reach it."""

    model_config = ConfigDict(hide_input_in_errors=True)  # a refused tracking_uri may hold a password

    tracking_uri: str = Field(description="The MLflow server, e.g. http://mlflow.internal:5000.")
    experiment: str = Field(default="transfer-learning", description="Experiment the runs are recorded in.")
    username: str | None = Field(default=None, description="Basic-auth user, when the server asks for one.")
    password: SecretStr | None = Field(default=None, description="Basic-auth password.")
    token: SecretStr | None = Field(default=None, description="Bearer token, instead of a user and password.")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str) -> str:
        """Refuse `https://user:pass@host`: the URI is written into latest.json, results, reports
        and logs, where only the SecretStr fields are kept out (docs/architecture.md, "Tracking and
        the registry")."""
        return without_credentials(uri)

    def plain(self) -> Tracking:
        """These settings alone: what a subclass (a Prefect block) adds stays behind."""
        return Tracking.model_validate(self.model_dump(include=set(Tracking.model_fields)))

    def authorization(self) -> str | None:
        """The Authorization header for this server, as MLflow would make it from its variables
        (basic auth first, else the token); holds the plain secret, so never log it."""
        if self.username and self.password:
            pair = f"{self.username}:{self.password.get_secret_value()}".encode()
            return "Basic " + base64.standard_b64encode(pair).decode()
        return f"Bearer {self.token.get_secret_value()}" if self.token else None

    def serves(self, url: str) -> bool:
        """Whether a request to `url` goes to this server (its API or its artifacts), however the
        URI spells its scheme, host and port: requests sends them lower-cased, default port dropped."""
        origin, path = server_of(self.tracking_uri)
        url_origin, url_path = server_of(url)
        return url_origin == origin and (url_path == path or url_path.startswith(path + "/"))


def server_of(uri: str) -> tuple[tuple[str, str, int | None], str]:
    """(scheme, host, port) as a request sends them, and the path without its trailing slash.

    >>> server_of("HTTP://MLflow.internal:80/api/")
    (('http', 'mlflow.internal', 80), '/api')
    """
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    port = parts.port or {"http": 80, "https": 443}.get(scheme)
    return (scheme, (parts.hostname or "").lower(), port), parts.path.rstrip("/")


def same_server(one: str, other: str) -> bool:
    """Whether two tracking URIs name one server, spelled alike or not."""
    return server_of(one) == server_of(other)


def without_credentials(uri: str) -> str:
    """`uri` when it holds no user or password; ValueError, with them masked, otherwise.

    >>> without_credentials("https://mlflow.internal:5000")
    'https://mlflow.internal:5000'
    """
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    masked = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}").geturl()
    raise ValueError(
        f"tracking_uri={masked!r} holds credentials (shown as ***). The URI is recorded in latest.json, "
        "results, reports and logs, so it must name only the server: give tracking_uri without them and put "
        "them in the MLflow Tracking block's username and password fields (basic auth) or its token field."
    )


class TrackedRun(BaseModel):
    """An MLflow run in progress: where it is, so rank 0 can add each epoch's metrics to it."""

    tracking: Tracking
    run_id: str


def import_mlflow() -> Any:
    """MLflow, or an error that says how to install it."""
    try:
        import mlflow
    except ImportError:
        raise ImportError(
            "tracking.block is set, but MLflow is not installed in this environment. Install the "
            "extra (pip install 'prefect-ddp[mlflow]') on the flow's machine and the workers, or "
            "leave tracking.block empty."
        ) from None
    return mlflow


@contextmanager
def mlflow_session(tracking: Tracking) -> Iterator[Any]:
    """An MlflowClient for `tracking`, whose requests carry its credentials meanwhile."""
    mlflow = import_mlflow()
    env = REQUEST_SETTINGS | {"MLFLOW_TRACKING_AUTH": AUTH_PROVIDER}
    global _outer_auth
    with _SESSION:
        _register_auth_provider()
        saved = {name: os.environ.get(name) for name in env}
        previous_uri = mlflow.get_tracking_uri()
        _outer_auth = outer_auth(saved["MLFLOW_TRACKING_AUTH"])
        os.environ.update(env)
        mlflow.set_tracking_uri(tracking.tracking_uri)
        _OPEN_SESSIONS[tracking.tracking_uri] = tracking
        try:
            yield mlflow.MlflowClient(tracking.tracking_uri)
        finally:
            _OPEN_SESSIONS.pop(tracking.tracking_uri, None)
            _outer_auth = None
            mlflow.set_tracking_uri(previous_uri)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def sign(request: Any) -> Any:
    """Add the Authorization of the open session whose server `request` goes to (a requests
    auth hook: MLflow's http_request passes it the prepared request, in whatever thread sends it),
    after the auth provider the environment named before the session, if any, had its turn."""
    if _outer_auth is not None:
        request = _outer_auth(request)
    for tracking in list(_OPEN_SESSIONS.values()):
        if tracking.serves(request.url) and (header := tracking.authorization()):
            request.headers["Authorization"] = header
    return request


def outer_auth(provider: str | None) -> Any:
    """The requests auth of the provider `provider` names, as MLflow would apply it; None where
    it names none, ours, or one MLflow does not know (MLflow warns of that and sends the request
    without it, as we then do)."""
    if not provider or provider == AUTH_PROVIDER:
        return None
    import requests
    from mlflow.tracking.request_auth.registry import fetch_auth

    auth = fetch_auth(provider)
    if isinstance(auth, tuple):  # requests takes (user, password) for basic auth
        return requests.auth.HTTPBasicAuth(*auth)
    return auth if callable(auth) else None


def _register_auth_provider() -> None:
    """Make AUTH_PROVIDER known to MLflow's auth registry, once per process.

    MLflow looks the name up in that registry at each request (mlflow.utils.rest_utils
    http_request, for the tracking and registry stores and the http/mlflow-artifacts
    repositories alike). Registered here rather than by a package entry point, so an
    environment installed before this provider existed still has it.
    """
    from mlflow.tracking.request_auth.abstract_request_auth_provider import RequestAuthProvider
    from mlflow.tracking.request_auth.registry import _request_auth_provider_registry as registry

    if any(provider.get_name() == AUTH_PROVIDER for provider in registry):
        return

    class SessionAuthProvider(RequestAuthProvider):
        def get_name(self) -> str:
            return AUTH_PROVIDER

        def get_auth(self) -> Any:
            return sign

    registry.register(SessionAuthProvider)


def epoch_metrics(record: dict[str, Any]) -> dict[str, float]:
    """An epoch's record as MLflow metrics: the numbers, and the step-time shares where there are.

    >>> epoch_metrics({"epoch": 2, "val_acc": 0.5, "lr": 0.01, "unreadable": [],
    ...                "time": {"images_per_s": 80.0, "shares": {"data": 0.6}, "verdict": "input-bound"}})
    {'val_acc': 0.5, 'lr': 0.01, 'images_per_s': 80.0, 'share_data': 0.6}
    """
    metrics = {k: float(v) for k, v in record.items()
               if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    timing = record.get("time") or {}
    if "images_per_s" in timing:
        metrics["images_per_s"] = float(timing["images_per_s"])
    metrics |= {f"share_{part}": float(share) for part, share in timing.get("shares", {}).items()}
    return metrics


def log_epoch(run: TrackedRun, record: dict[str, Any]) -> None:
    """Add one epoch's metrics to the run, at step = the epoch's number."""
    metric = import_mlflow().entities.Metric
    stamp = int(time.time() * 1000)
    metrics = [metric(key, value, stamp, record["epoch"]) for key, value in epoch_metrics(record).items()]
    with mlflow_session(run.tracking) as client:
        client.log_batch(run.run_id, metrics=metrics)
