"""Real photos on one core (issue 31): augmented 224-px training images per second, by how they are read.

    .venv/bin/python -m bench.photos [--image-size 224] [--repeats 3]

Writes photo-like JPEGs (smooth gradients with grain, quality 90) at three sizes: 0.2 MP
(516x387), 2 MP (1632x1224) and 12 MP (4032x3024, a phone's), then runs training's decode
and augmentation (`train_transform(image_size)`: random crop, flip, normalise) on one
thread of this process, from local disk, reading them:

- imagefolder: torchvision's `ImageFolder` with the same transform: the baseline every ratio is taken against;
- (a) full: the project's per-image decode as it was (`open_rgb` decodes every pixel);
- (b) reduced: per image as now (`prepare`: libjpeg's reduced-size decode to `decode_side`);
- (c) shards: the project's shards written pre-resized (`shard_format`: shorter side
  `decode_side(image_size)`, JPEG quality 90), read by `ShardDataset` (one rank, no loader workers);
- ceiling: decode + augment alone of the images the shards store, already in memory; and the
  same stacked into batches of the shard reader's size (`BATCH`), as every loader hands them
  over: what (c) can reach, its tar parsing, fetching and shuffling left out;
- webdataset: WebDataset 1.0.2 reading the same shards (they follow its layout), shuffled
  through a buffer of a shard's images and batched as (c);
- litdata: LitData 0.2.76, `optimize()` storing the images resized as the shard writer does
  (`stored_resized`, one worker), then `StreamingDataset` through its `StreamingDataLoader`
  in batches of `BATCH`. Its write cost is its own column.

Both libraries decode with the project's `open_rgb` and the same transform, so the columns
differ by how each stores and reads, not by the decoder. They are installed under
bench/.cache on first use (bench.outside); where they cannot be, their columns say why.

Each reader runs `--repeats` passes over the set; the fastest counts. The shard step's own
cost (decode, resize, encode) is the CPU time its write recorded, per image. Record results,
machine and load in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image

from bench.outside import install_beside
from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.dataset import prepare, train_transform
from prefect_ddp.tasks.data.decoding import open_rgb, stored_resized
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.shard_reader import ShardDataset, read_samples
from prefect_ddp.tasks.data.shard_writer import shard_format, write_shards

# (name, width, height, images): about 5 s of full decoding per set on one core, several shards each.
BATCH = 32
SETS = [("0.2MP", 516, 387, 192), ("2MP", 1632, 1224, 64), ("12MP", 4032, 3024, 32)]


def photo(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG: colour gradients with grain, which compresses about as a photo does (~2-3 bits a pixel)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200 + rng.uniform(0, 40, 3)
    grain = rng.normal(0, 12, (height, width, 1)).astype(np.float32)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(base + grain, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_set(root: Path, width: int, height: int, count: int) -> Manifest:
    """`count` photos in two class folders below `root`."""
    paths = []
    for n in range(count):
        key = f"{'ab'[n % 2]}/{n:04d}.jpg"
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(photo(width, height, n))
        paths.append(key)
    return Manifest(root=str(root), classes=["a", "b"], paths=paths,
                    sizes=[(root / p).stat().st_size for p in paths], labels=[n % 2 for n in range(count)])


def rate(images: Callable[[], Iterable[object]], count: int, repeats: int) -> float:
    """Images per second of the fastest of `repeats` passes of `images()`, each yielding `count` images."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        seen = sum(1 for _ in images())
        best = min(best, time.perf_counter() - started)
        assert seen == count, f"a pass yielded {seen} images, not {count}"
    return count / best


LIBRARIES = {"webdataset": (["webdataset==1.0.2", "braceexpand==0.1.7"], "webdataset"),
             "litdata": (["litdata==0.2.76", "lightning-utilities==0.15.2"], "litdata")}


def webdataset_rate(shard_paths: list[Path], transform, count: int, repeats: int, buffer: int) -> float:
    import webdataset as wds  # noqa: PLC0415 - installed beside the project (bench.outside)

    def decode(sample: dict) -> torch.Tensor:
        image = next(value for name, value in sample.items() if not name.startswith("__") and name != "cls")
        return transform(open_rgb(image))

    pipeline = wds.WebDataset([str(p) for p in shard_paths], shardshuffle=False, empty_check=False)
    batches = pipeline.shuffle(buffer).map(decode).batched(BATCH, collation_fn=torch.stack)
    return rate(lambda: (image for batch in batches for image in batch), count, repeats)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def litdata_item(path: str, side: int) -> dict:
    """One photo as LitData's optimize() stores it here: resized as the shard writer does, with its class."""
    stored = stored_resized(Path(path).read_bytes(), side)
    return {"image": stored.data, "label": "ab".index(Path(path).parent.name)}


def litdata_rates(root: Path, manifest: Manifest, side: int, transform, repeats: int, work: Path) -> tuple[float, float]:
    """(images/s reading, ms per image writing) for LitData on the same photos."""
    from litdata import StreamingDataLoader, StreamingDataset, optimize  # noqa: PLC0415 - bench.outside

    out = work / "litdata"
    started = children_cpu_s()
    optimize(fn=partial(litdata_item, side=side), inputs=[str(root / p) for p in manifest.paths],
             output_dir=str(out), chunk_bytes="64MB", num_workers=1)
    write_ms = (children_cpu_s() - started) / len(manifest) * 1e3  # its worker process's CPU, start-up included
    loader = StreamingDataLoader(StreamingDataset(str(out)), batch_size=BATCH, num_workers=0,
                                 collate_fn=lambda items: torch.stack(
                                     [transform(open_rgb(item["image"])) for item in items]))
    return rate(lambda: (image for batch in loader for image in batch), len(manifest), repeats), write_ms


def measure(root: Path, manifest: Manifest, image_size: int, repeats: int, work: Path) -> dict[str, float]:
    transform = train_transform(image_size)
    originals = [(root / p).read_bytes() for p in manifest.paths]
    count = len(originals)
    folder = torchvision.datasets.ImageFolder(str(root), transform=transform)
    cfg = TrainingConfig(image_size=image_size, images_per_shard=16)
    index, _ = write_shards(manifest, range(count), {}, str(work / "out"), {}, shard_format(cfg), "bench")
    shard_dir = next((work / "out").rglob("index.json")).parent
    stored = [data for name in index.shards for _, data, _ in read_samples((shard_dir / name).read_bytes())]
    shards = ShardDataset(str(shard_dir), index, {}, transform, batch_size=BATCH, rank=0, world_size=1,
                          loader_workers=0)
    batches = [stored[i:i + BATCH] for i in range(0, count, BATCH)]
    return {
        "imagefolder": rate(lambda: (folder[i] for i in range(count)), count, repeats),
        "full": rate(lambda: (transform(open_rgb(data)) for data in originals), count, repeats),
        "reduced": rate(lambda: (prepare(data, 0, 0, transform) for data in originals), count, repeats),
        "shards": rate(lambda: (image for images, _ in shards for image in images), count, repeats),
        "ceiling": rate(lambda: (transform(open_rgb(data)) for data in stored), count, repeats),
        "batched": rate(lambda: (image for batch in batches
                                 for image in torch.stack([transform(open_rgb(data)) for data in batch])),
                        count, repeats),
        **library_rates(root, manifest, cfg, transform, repeats, work, [shard_dir / n for n in index.shards]),
        "write_ms": index.decode_cpu_s / count * 1e3,
        "stored_kb": sum(index.bytes) / count / 1e3,
        "original_kb": sum(manifest.sizes) / count / 1e3,
    }


def library_rates(root: Path, manifest: Manifest, cfg: TrainingConfig, transform, repeats: int, work: Path,
                  shard_paths: list[Path]) -> dict[str, float | str]:
    """WebDataset's and LitData's rates, or why they could not be measured."""
    rates: dict[str, float | str] = {}
    missing = install_beside("webdataset", *LIBRARIES["webdataset"])
    rates["webdataset"] = missing or webdataset_rate(shard_paths, transform, len(manifest), repeats,
                                                      cfg.images_per_shard)
    missing = install_beside("litdata", *LIBRARIES["litdata"])
    if missing:
        rates["litdata"] = rates["litdata_write_ms"] = missing
    else:
        rates["litdata"], rates["litdata_write_ms"] = litdata_rates(
            root, manifest, shard_format(cfg).side, transform, repeats, work)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="photos-"))
    print(f"image_size {args.image_size}; torch threads 1; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    print("\n| originals | KB each (stored in shards) | ImageFolder | (a) full | (b) reduced | (c) shards | "
          f"ceiling | ceiling, batches of {BATCH} | (c) / ceiling (batched) | WebDataset | LitData | "
          "shard write, ms per image | LitData write |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, width, height, count in SETS:
        manifest = write_set(work / name / "images", width, height, count)
        r = measure(work / name / "images", manifest, args.image_size, args.repeats, work / name)
        base = r["imagefolder"]
        cells = [f"{r[k]:.0f}/s ({r[k] / base:.2f}x)" for k in ("full", "reduced", "shards", "ceiling", "batched")]
        libraries = [f"{r[k]:.0f}/s ({r[k] / base:.2f}x)" if isinstance(r[k], float) else r[k]
                     for k in ("webdataset", "litdata")]
        litdata_write = r["litdata_write_ms"]
        print(f"| {name} {width}x{height} | {r['original_kb']:.0f} ({r['stored_kb']:.0f}) | {base:.0f}/s | "
              f"{' | '.join(cells)} | {r['shards'] / r['ceiling']:.2f} ({r['shards'] / r['batched']:.2f}) | "
              f"{' | '.join(libraries)} | {r['write_ms']:.0f} | "
              f"{f'{litdata_write:.0f}' if isinstance(litdata_write, float) else litdata_write} |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
