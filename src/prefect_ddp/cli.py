"""`prefect-ddp`: the demo, the laptop server and a worker, for a user who installed the package without the repository.

    prefect-ddp demo [--epochs N ...]    # the whole flow on generated images, about a minute
    prefect-ddp serve [--epochs N ...]   # a local Prefect server, the deployments, the Run button
    prefect-ddp worker --pool NAME       # `prefect worker start` beside a Dask cluster kept warm for its runs

Each command takes the options of its module (`prefect-ddp demo --help`).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": "prefect_ddp.deployments.demo",
    "serve": "prefect_ddp.deployments.serve",
    "worker": "prefect_ddp.deployments.worker",
}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in COMMANDS:
        given = repr(args[0]) if args else "no command"
        raise SystemExit(f"prefect-ddp: got {given}; the commands are {', '.join(COMMANDS)}. "
                         f"For example: prefect-ddp demo --epochs 2\n\n{__doc__}")
    importlib.import_module(COMMANDS[args[0]]).main(args[1:])


if __name__ == "__main__":
    main()
