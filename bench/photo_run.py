"""A training run on camera originals (issue 31): where each step's time goes, read three ways.

    .venv/bin/python -m bench.photo_run [--photos 40] [--epochs 3] [--modes full,reduced,cached,shards]

12-MP JPEGs (4032x3024, `bench.photos.photo`) in two class folders on local disk; resnet18
at image_size 64 on 2 real gloo ranks (the project's `train_classifier`), batch 8, one
loader worker per rank, read:

- full: per image, every original decoded in full, as before reduced-size decoding
  (`needed_side` made to ask for no size in each rank);
- reduced: per image, as now (libjpeg's reduced-size decode, `open_rgb`);
- cached: per image as `reduced`, through the byte cache (`training.cache_gb`, a folder of
  the run's own), which keeps each photo as a copy resized to the side the crop needs;
- shards: from shards written pre-resized (`training.images_per_shard`, `shard_side` empty:
  1.5 x image_size), written before the run as the flow's write-shards step would.

Prints each epoch's images/s, the share of each step spent waiting for data and the
verdict. Record results in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench.digits import train
from bench.photos import write_set
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.shard_writer import shard_format, write_shards
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.training.job import TrainJob


def full_decode() -> None:
    """The decode as it was: no transform asks for a size, so every original decodes in full."""
    import prefect_ddp.tasks.data.dataset as dataset

    dataset.needed_side = lambda transform: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--photos", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--modes", default="full,reduced,cached,shards", help="which reads, comma-separated")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="photo-run-"))
    manifest = write_set(work / "images", 4032, 3024, args.photos)
    split = stratified_split(manifest, 0.2, 0)
    print(f"{len(split.train)} training and {len(split.val)} validation 12-MP photos; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    os.environ["PREFECT_DDP_CACHE_DIR"] = str(work / "cache")  # the spawned ranks inherit it
    for mode in args.modes.split(","):
        training = TrainingConfig(epochs=args.epochs, batch_size=8, image_size=64, num_workers=1,
                                  images_per_shard=8 if mode == "shards" else None,
                                  cache_gb=1 if mode == "cached" else 0)
        if mode == "shards":
            write_shards(manifest, split.train, {}, str(work), {}, shard_format(training), split.digest(manifest),
                         split.seed)
        job = TrainJob(source=DataLocation(url=str(work / "images")), output=DataLocation(url=str(work / f"run-{mode}")),
                       manifest=manifest, split=split, model=ModelConfig(backbone="resnet18"), training=training)
        result = train(job, 2, full_decode if mode == "full" else None)
        for epoch in result.history:
            print(json.dumps({"mode": mode, "epoch": epoch["epoch"], "images_per_s": epoch["images_per_s"],
                              "data_wait_pct": epoch["data_wait_pct"], "verdict": epoch["time"]["verdict"]}),
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
