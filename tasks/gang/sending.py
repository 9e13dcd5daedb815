"""Send a training function to the workers, also one defined in a script or a notebook.

Dask sends a function defined in `__main__` (a script, a notebook) by value, with
cloudpickle, along with the modules its code names as attributes. An ImageFolder loop
reads `dataset.classes`; cloudpickle takes that name for the submodule `torch.classes`, a
module-like object it cannot pickle ("cannot pickle '_Classes' object"; the same trap as
pytorch#48832 for `torch.backends.cudnn`). Reducing torch's module-like objects to their
import names sends a reference the workers import, as for any module. The scheduler needs
the same reducers: it unpacks a submitted graph and packs each task again for its worker.
"""

from __future__ import annotations

import copyreg
import importlib
import sys
import types
from typing import Any

import cloudpickle
import distributed

from prefect_ddp.tasks.gang.errors import GangError
from prefect_ddp.tasks.reporting import run_logger


def _import_by_name(module: types.ModuleType) -> tuple[Any, tuple[str]]:
    return importlib.import_module, (module.__name__,)


def pickle_torch_modules_by_name() -> None:
    """Register a reducer for every module-like object torch puts in sys.modules."""
    import torch  # noqa: F401  (the objects exist once torch is imported)

    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "torch" and isinstance(module, types.ModuleType) and type(module) is not types.ModuleType:
            copyreg.pickle(type(module), _import_by_name)


def prepare_to_send(client: distributed.Client, train_fn: Any, config: Any) -> None:
    """Make this process and the scheduler able to send `train_fn`, or fail saying why."""
    check_sendable(train_fn, config)
    try:
        client.run_on_scheduler(pickle_torch_modules_by_name)
    except Exception as exc:  # a scheduler without torch or this package: it sends what it can
        run_logger().debug("Could not set up the scheduler to send torch modules by name: %r", exc)


def check_sendable(train_fn: Any, config: Any) -> None:
    """Fail before any rank starts, naming what cannot be sent and the way out."""
    pickle_torch_modules_by_name()
    for what, value in (("training function", train_fn), ("config", config)):
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            name = getattr(value, "__qualname__", type(value).__name__)
            raise GangError(
                f"The {what} {name!r} cannot be sent to the Dask workers: {exc!r}. Move it, "
                "and the objects it uses, into an importable module (the workers import it "
                "instead of unpickling it), or pass plain values in config."
            ) from exc
