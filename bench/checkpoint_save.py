"""Issue 32: what training waits for at a checkpoint, written in the training thread (before) or
copied to memory and written in the background (tasks/training/checkpoint_writer.py).

    .venv/bin/python -m bench.checkpoint_save [--models resnet18 resnet50] [--repeats 5] [--folder DIR]

For each model: its state with SGD momentum (one optimizer step), the checkpoint dict the
recipe saves, and the median of `--repeats` saves each way into a local folder: the
synchronous save (torch.save into memory, then the atomic write), against the blocking part
of the background one (`to_cpu`) and that save's write, timed in its thread. Prints one JSON
line per model with the ratio blocking / synchronous; record it in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torchvision

from prefect_ddp.tasks.data.storage import save_torch
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter, to_cpu


def checkpoint_of(name: str) -> dict[str, Any]:
    """The dict the recipe checkpoints, for torchvision model `name` after one SGD step."""
    model = torchvision.models.get_model(name, weights=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 0, "history": []}


def timed(action: Any) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure(name: str, folder: Path, repeats: int) -> dict[str, Any]:
    state = checkpoint_of(name)
    url = str(folder / f"{name}.pt")
    synchronous = [timed(lambda: save_torch(url, state, {})) for _ in range(repeats)]
    blocking, written = [], []
    for _ in range(repeats):
        with BackgroundWriter() as writer:
            snapshot: dict[str, Any] = {}
            blocking.append(timed(lambda: snapshot.update(to_cpu(state))))
            writer.submit("the checkpoint", lambda: save_torch(url, snapshot, {}))
        written.extend(writer.write_s)
    return {
        "model": name, "checkpoint_mb": round(os.path.getsize(url) / 1e6, 1),
        "synchronous_s": round(statistics.median(synchronous), 3),
        "blocking_s": round(statistics.median(blocking), 3),
        "background_write_s": round(statistics.median(written), 3),
        "blocking_vs_synchronous": round(statistics.median(blocking) / statistics.median(synchronous), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet18", "resnet50"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as scratch:
        folder = args.folder or Path(scratch)
        print(json.dumps({"load_average": os.getloadavg(), "cpus": os.cpu_count(), "folder": str(folder),
                          "torch_threads": torch.get_num_threads()}), flush=True)
        for name in args.models:
            print(json.dumps(measure(name, folder, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
