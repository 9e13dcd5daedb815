"""Each worker of a local CPU cluster starts with the environment of the process that starts it,
as it is at that moment: at the cluster's start, at every restart and every worker added later.

A worker forked from the forkserver (blocks/worker_forkserver.py) begins with the forkserver's
environment, which was this process's when the first worker started. Handing each nanny a copy
of `os.environ` made at the cluster's creation (as this project did before) put that copy in
every restart and every worker `cluster.scale` added: a variable changed since reverted, one
added since was missing, a credential removed since was still there, and every secret of the
environment sat in `cluster.worker_spec`. `CurrentEnvironmentNanny` reads the environment when
it starts its worker instead, and the worker drops whatever it inherited that the nanny did not
give (`leave_only_given`). The nanny's options keep only what the cluster was given
explicitly (the flow's Prefect API URL, a caller's `env`).

A worker forked from the forkserver imports this package's blocks first (this module is its
first preload; a script that started the cluster is no longer imported there: tasks/script_main.py),
before the nanny's environment is applied, and importing this package imports Prefect, which
reads its settings from the environment once, on import. So `leave_only_given`
runs both when this module is imported as the worker's first preload and when Dask calls
`dask_setup` as the worker starts, after the environment is applied (whichever finds the
nanny's list first prunes, and takes the list out), and `dask_setup` then has Prefect read its
settings again (`prefect.context.refresh_global_settings_context`, Prefect's own way to pick
up a changed environment). Modules the forkserver imported before (torch, torchvision,
distributed) keep what they read of the environment when it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

from distributed import Nanny, Worker
from distributed.core import Status

# The names, never the values, of the variables the nanny gave: the worker keeps those alone.
GIVEN_NAMES = "PREFECT_DDP_WORKER_ENVIRONMENT"
# A forked worker is up in seconds here, a spawned one importing torch in about 5 s (docs/architecture.md,
# "Facts: Dask"); Dask itself waits for one forever, even one that hangs in a preload.
WORKER_START_TIMEOUT_S = 300.0
# SIGKILL ends a process at once; this only bounds the wait for the kernel to say so.
KILL_WAIT_S = 30.0


class WorkerStartTimeout(RuntimeError):
    """A worker process that its nanny started did not come up in time."""


class CurrentEnvironmentNanny(Nanny):
    """A Nanny whose worker gets this process's environment of the moment it (re)starts it, with
    Dask's own variables under it and the cluster's `env` over it."""

    def __init__(self, *args: Any, start_timeout_s: float = WORKER_START_TIMEOUT_S, **kwargs: Any) -> None:
        self.start_timeout_s = start_timeout_s
        self.given_env = {name: str(value) for name, value in (kwargs.get("env") or {}).items()}
        kwargs["env"] = self.given_env
        super().__init__(*args, **kwargs)
        self.dask_env = dict(self.env)  # Dask's pre-spawn and nanny environ settings, as the nanny merged them

    async def instantiate(self) -> Status:
        self.env = self.current_environment()
        if self.process is not None:  # a restart reuses the worker process's handle, and the env it was given
            self.process.env = self.env
        try:
            return await asyncio.wait_for(super().instantiate(), self.start_timeout_s)
        except asyncio.TimeoutError:
            await self.kill_unstarted()
            raise WorkerStartTimeout(
                f"The worker process of nanny {self.name!r} did not start within {self.start_timeout_s:.0f} s, "
                "and was killed. A worker imports the cluster's preload modules, and a guarded script "
                "that started it, as it starts (a module that waits there holds it); its log above says "
                "how far it got."
            ) from None

    async def kill_unstarted(self) -> None:
        """Kill a worker process that never reported itself started (Dask's own kill waits for that).

        The kill is queued behind the process's start (a first start waits for the forkserver to
        import torch), so it kills what that start makes; a start that failed left nothing to kill.
        """
        process = self.process.process if self.process is not None else None
        if process is None:
            return
        try:
            await process.kill()
        except Exception:  # its start raised: multiprocessing made no process
            return
        await asyncio.wait_for(process.join(), KILL_WAIT_S)

    def current_environment(self) -> dict[str, str]:
        env = {**self.dask_env, **os.environ, **self.given_env}
        return env | {GIVEN_NAMES: json.dumps(sorted(env))}


def leave_only_given(environ: Any = os.environ) -> list[str]:
    """In a worker started by a CurrentEnvironmentNanny: remove the variables it inherited from the
    forkserver that its nanny did not give; returns their names. Does nothing elsewhere.

    The list of names is taken out of the environment too, so that what the worker starts later
    (a rank's loader processes) never prunes what the worker set meanwhile.
    """
    given = environ.pop(GIVEN_NAMES, None)
    if given is None:
        return []
    keep = set(json.loads(given))
    removed = [name for name in environ if name not in keep]
    for name in removed:
        del environ[name]
    return removed


def dask_setup(worker: Worker) -> None:
    """Dask calls this in each worker as it starts, after its nanny's environment is applied: prune
    it, and have Prefect, where the worker imported it already, read its settings from it again."""
    leave_only_given()
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


# A preload module is imported as its worker starts, in the order of the preload list; this one is first.
leave_only_given()
