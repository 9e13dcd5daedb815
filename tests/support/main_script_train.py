"""A user's script, run as __main__: the training function lives here, as in the tutorials.

    python tests/support/main_script_train.py SCHEDULER_ADDRESS

Its loop reads `dataset.classes` and uses `torch`, which once made cloudpickle try to send
the submodule `torch.classes` by value ("cannot pickle '_Classes' object").
"""

import json
import sys

import torch
from prefect import flow
from prefect_dask import DaskTaskRunner

from prefect_ddp import run_gang


class Folder:
    """Stands in for torchvision's ImageFolder: what a loop reads of it."""

    classes = ["cat", "dog", "owl"]


def train(ctx, config):
    dataset = Folder()
    head = torch.nn.Linear(4, len(dataset.classes))
    return {"rank": ctx.rank, "outputs": head.out_features}


@flow(name="main-script")
def main(address: str) -> list:
    with DaskTaskRunner(address=address) as runner:
        return run_gang(train, {}, task_runner=runner)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
