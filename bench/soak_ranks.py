"""The soak's gang (bench/soak.py): its rank functions, its flow, and a flow process to run it.

    python -m bench.soak_ranks SCHEDULER_ADDRESS FN_NAME MARKS_FOLDER STEPS

runs one gang of FN_NAME ("loop" of STEPS steps, or "asleep") on the cluster and prints its
outcome as one JSON line: state, error, flow run id, attempts.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner

from prefect_ddp.tasks.gang import GangError, RankContext, all_reduce_sum, run_gang

STEPS = 60
STEP_PAUSE_S = 0.05
ASLEEP_S = 600


def mark(ctx: RankContext, marks: str) -> None:
    """Say that this rank runs, on which worker (the soak's injector picks its victim by it) and
    for which flow run (a killed run prints none: the soak reads its task runs by this)."""
    (Path(marks) / f"running-{ctx.rank}").write_text(json.dumps({"worker": ctx.worker_address,
                                                                  "flow_run_id": flow_run.get_id()}))


def loop(ctx: RankContext, config: dict[str, Any]) -> float:
    """A short training loop: a collective per step, the stop flag read after each."""
    mark(ctx, config["marks"])
    total = 0.0
    for _ in range(config["steps"]):
        total += all_reduce_sum([1.0])[0]
        ctx.check_stop()
        time.sleep(STEP_PAUSE_S)
    return total


def asleep(ctx: RankContext, config: dict[str, Any]) -> float:
    """A rank deaf to its stop flag: asleep in C (libc's sleep)."""
    mark(ctx, config["marks"])
    ctypes.CDLL(None).sleep(ASLEEP_S)
    return 0.0


FUNCTIONS = {"loop": loop, "asleep": asleep}


@flow(name="soak-gang")
def soak_gang(address: str, fn_name: str, marks: str, steps: int = STEPS) -> int:
    """One gang of FUNCTIONS[fn_name] on 2 of the cluster's workers; the attempts it took."""
    with DaskTaskRunner(address=address) as runner:
        results = run_gang(
            FUNCTIONS[fn_name], {"marks": marks, "steps": steps}, task_runner=runner, world_size=2, max_restarts=1,
            init_timeout=timedelta(seconds=60), lease_timeout=timedelta(seconds=180),
            timeout=timedelta(seconds=5 if fn_name == "asleep" else 180), hang_timeout=timedelta(seconds=10),
        )
    return len(results.attempts)


def run(address: str, fn_name: str, marks: str, steps: int = STEPS) -> dict[str, Any]:
    """The gang's outcome, as the soak checks it."""
    state = soak_gang(address, fn_name, marks, steps, return_state=True)
    result = state.result(raise_on_failure=False)
    attempts = len(result.attempts) if isinstance(result, GangError) else result if isinstance(result, int) else None
    return {"state": state.type.value, "error": "" if isinstance(result, int) else str(result)[:2000],
            "flow_run_id": str(state.state_details.flow_run_id), "attempts": attempts}


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:4], int(sys.argv[4]))), flush=True)
