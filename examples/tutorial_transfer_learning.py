"""The dask-pytorch-ddp tutorial's transfer-learning loop, as plain user code on the gang API.

Fine-tune a torchvision resnet18 on an image folder (ROOT/CLASS/IMAGE.jpg, on S3 or on
disk) with DDP, SGD and cross-entropy for a few epochs; rank 0 saves the weights.

Before, with dask-pytorch-ddp, every rank listed the bucket itself and the client waited
on bare futures (a fixed port, no timeout, no record of the run):

    from dask_pytorch_ddp import dispatch
    from dask_pytorch_ddp.data import S3ImageFolder

    def train(bucket, prefix, epochs):
        rank = dist.get_rank()
        dataset = S3ImageFolder(bucket, prefix, transform=transform)   # lists the bucket
        sampler = DistributedSampler(dataset)
        ...                                                             # the loop below
        if rank == 0:
            torch.save(model.state_dict(), "model.pt")

    futures = dispatch.run(client, train, bucket="BUCKET", prefix="PREFIX", epochs=3)
    client.gather(futures)

After: the same loop takes `(ctx, config)`; the flow lists the folder once and hands the
keys and labels to every rank; `run_gang` places one rank per Dask worker, forms the
process group, and records each rank as a task run of the flow:

    from examples.tutorial_transfer_learning import tutorial_transfer_learning
    from prefect_ddp import DataLocation

    tutorial_transfer_learning(DataLocation.load("flowers"))   # a saved data-location block
    tutorial_transfer_learning(DataLocation(url="/data/flowers"))

Run it from the repository root, where `examples` imports (the workers of an existing
cluster, `address=...`, must be able to import it too). The location's secret stays a
SecretStr: masked in the flow run's recorded parameters, turned into plain text only by
`storage_options()` where a connection is opened.

This loop trusts every listed image to decode, as the tutorial's did; the project's
`transfer-learning` flow checks them first and leaves out the broken ones.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

import fsspec
import torch
import torch.distributed as dist
import torchvision
from prefect import flow, get_run_logger
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

import prefect_ddp
from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.tasks.data.dataset import train_transform
from prefect_ddp.tasks.data.indexing import build_manifest


def list_image_folder(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """One listing of ROOT/CLASS/IMAGE: the class names, and each image's key and label.

    Done once, in the flow, so that no rank lists the bucket. Classes are the first folder
    below the root, sorted (torchvision's ImageFolder order); files that are not images,
    or lie directly under the root, are skipped.
    """
    fs, root = fsspec.core.url_to_fs(url, **storage_options)
    root = root.rstrip("/")
    found = fs.find(root, detail=True)
    listing = {path[len(root) + 1:]: int(info.get("size") or 0) for path, info in found.items()
               if path.startswith(root + "/")}
    manifest = build_manifest(url, listing)
    get_run_logger().info(
        "%d images in classes %s; skipped %d files that are not images and %d outside class folders.",
        len(manifest), manifest.classes, manifest.skipped_non_image, manifest.skipped_outside_class,
    )
    return {"classes": manifest.classes, "keys": manifest.paths, "labels": manifest.labels}


def train(ctx: prefect_ddp.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """One rank of the tutorial's loop: its share of the images, every epoch; rank 0 saves."""
    torch.manual_seed(config["seed"])
    device = torch.device(ctx.device)
    log = get_run_logger()

    data: prefect_ddp.DataLocation = config["data"]
    dataset = prefect_ddp.S3ImageFolder(
        data.url, config["keys"], config["labels"], data.storage_options(),
        transform=train_transform(config["image_size"]),
    )
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=config["seed"])
    loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)

    # The backbone (pretrained unless weights is None) with a new head for our classes.
    net = torchvision.models.resnet18(weights=config["weights"])
    net.fc = nn.Linear(net.fc.in_features, len(config["classes"]))
    net = net.to(device)
    model = net
    if dist.is_initialized():
        model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)

    losses = []
    for epoch in range(1, config["epochs"] + 1):
        sampler.set_epoch(epoch)
        model.train()
        total, correct, count = 0.0, 0, 0
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = model(images)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(labels)
            correct += int((outputs.argmax(1) == labels).sum())
            count += len(labels)
        # Every rank saw a different share: sum over the gang for the epoch's numbers.
        total, correct, count = prefect_ddp.all_reduce_sum([total, correct, count], device=device)
        losses.append(total / count)
        log.info("epoch %d/%d: loss %.4f, accuracy %.3f", epoch, config["epochs"], losses[-1], correct / count)

    result = {"rank": ctx.rank, "worker": ctx.worker_address, "losses": losses}
    if ctx.is_main:
        fs, path = fsspec.core.url_to_fs(config["model_url"])
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb") as file:
            torch.save(net.state_dict(), file)
        result["model_url"] = config["model_url"]
    return result


@flow(name="tutorial-transfer-learning")
def tutorial_transfer_learning(
    data: prefect_ddp.DataLocation,
    epochs: int = 3,
    batch_size: int = 16,
    lr: float = 0.001,
    image_size: int = 224,
    world_size: int = 2,
    weights: str | None = None,
    model_url: str = "./outputs/tutorial-transfer-learning/model.pt",
    address: str | None = None,
) -> list[dict[str, Any]]:
    """Fine-tune resnet18 on the image folder at `data.url` with `world_size` DDP ranks.

    Args:
        data: the image folder, ROOT/CLASS/IMAGE (s3://BUCKET/PREFIX or a local path), with
            the endpoint, region and credentials to read it.
        epochs, batch_size, lr, image_size: the recipe; batch_size is per rank.
        world_size: ranks, one per Dask worker.
        weights: torchvision's weights for resnet18, e.g. "DEFAULT" (ImageNet; downloaded
            once per worker); empty: random weights, nothing to download.
        model_url: where rank 0 saves the weights (a state_dict): a path, or any fsspec
            URL that rank 0's machine can write with its own credentials.
        address: scheduler of an existing Dask cluster; empty: a local one of world_size workers.

    Returns:
        Each rank's result in rank order: its worker, its losses, and (rank 0) model_url.
    """
    config = {
        "data": data, **list_image_folder(data.url, data.storage_options()),
        "epochs": epochs, "batch_size": batch_size, "lr": lr, "image_size": image_size,
        "weights": weights, "seed": 0,
        "model_url": model_url if "://" in model_url else os.path.abspath(model_url),
    }
    with DaskCluster(address=address, n_workers=world_size).task_runner() as runner:
        return prefect_ddp.run_gang(train, config, task_runner=runner, world_size=world_size)
