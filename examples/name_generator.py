"""A character-level LSTM that invents first names, swept over batch size and learning rate.

The "Training many PyTorch models concurrently with Dask" tutorial, on prefect-ddp: the
same small name generator (a name so far in, the next character out; sample until the end
character), trained once per (batch_size, lr) of a grid, two trials at a time on a Dask
cluster of two workers. The tutorial compared the runs by hand; here `prefect_ddp.sweep`
does it: every trial reports its loss after each epoch, the median pruner stops a trial
that is already worse than the others were at the same epoch, and the sweep leaves the
comparison behind.

Run it from the repository root, where `examples` imports (the workers of an existing
cluster, `address=...`, must be able to import it too):

    python -m examples.name_generator

What you see:

- in the Prefect UI, the flow run `name-generator-sweep` with one task run `rank-0` per
  trial (its log has the trial's loss per epoch and a few names its model made),
  and the artifact `sweep-comparison`: the trials sorted by loss, and the tutorial's two
  plots, the loss per epoch and against wall time;
- under ./outputs/name-generator/: `sweep.json` (every trial, the best one), `curves.png`
  (the two plots), `study.db` (the Optuna study) and `models/` (each completed trial's
  weights);
- in the flow's log, and under "generated" in what the flow returns, names sampled from
  the best trial's model.

Running it again with the same output continues the study: trials already finished are
not trained again. Delete the output folder, or pass another, to start over. With an
existing cluster (`address="tcp://HOST:8786"`) the output must be a folder that the
workers and this process share: rank 0 of each trial writes to the study there.

The names are examples/names.txt (one per line, ASCII letters); nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from prefect import flow, get_run_logger
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import prefect_ddp
from prefect_ddp.blocks.cluster import DaskCluster

NAMES_FILE = Path(__file__).with_name("names.txt")
PAD, END = " ", "*"  # PAD fills a short prefix on the left; END follows the last letter
ALPHABET = PAD + "abcdefghijklmnopqrstuvwxyz" + END
SAMPLES = 5

# What every trial starts from; the flow adds epochs, the names and model_dir; the space adds
# batch_size and lr.
BASE_CONFIG = {"hidden": 64, "seed": 0}
SPACE = {
    "batch_size": {"kind": "grid", "values": [16, 64]},
    "lr": {"kind": "grid", "values": [0.003, 0.03]},
}
# Every key that changes the trained weights: they name a trial's model file.
HYPERPARAMETERS = ("hidden", "batch_size", "lr", "epochs", "seed")


def load_names(path: Path = NAMES_FILE) -> list[str]:
    """The training names, lower case; refuses characters the model has no symbol for."""
    names = [line.strip().lower() for line in path.read_text().splitlines() if line.strip()]
    unknown = sorted({char for name in names for char in name if char not in ALPHABET[1:-1]})
    if unknown:
        raise ValueError(f"{path} holds characters other than the letters a-z: {unknown}. One name per line.")
    return names


def pad(prefix: str, width: int) -> list[int]:
    """`prefix` as symbol indices, padded on the left to `width`: the LSTM reads the newest last."""
    return [0] * (width - len(prefix)) + [ALPHABET.index(char) for char in prefix]


def encode(names: list[str]) -> TensorDataset:
    """Every prefix of every name, with the character that follows it ("" -> first letter,
    whole name -> END)."""
    width = max(map(len, names))
    prefixes, targets = [], []
    for name in names:
        word = name + END
        for i, char in enumerate(word):
            prefixes.append(pad(word[:i], width))
            targets.append(ALPHABET.index(char))
    return TensorDataset(torch.tensor(prefixes), torch.tensor(targets))


class NameModel(nn.Module):
    """Embedding, LSTM, and a linear layer that scores each possible next character."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(ALPHABET), hidden)
        self.lstm = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, len(ALPHABET))

    def forward(self, prefixes: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embed(prefixes))
        return self.head(output[:, -1])


@torch.no_grad()
def generate(model: NameModel, width: int, count: int, seed: int) -> list[str]:
    """`count` names, each sampled a character at a time until END (or `width` letters)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    names = []
    for _ in range(count):
        name = ""
        while len(name) < width:
            logits = model(torch.tensor([pad(name, width)], device=device))[0]
            logits[0] = float("-inf")  # PAD only ever comes before a name
            if not name:
                logits[-1] = float("-inf")  # and END after its first letter
            char = ALPHABET[int(torch.multinomial(logits.softmax(-1), 1, generator=generator))]
            if char == END:
                break
            name += char
        names.append(name.capitalize())
    return names


def model_url(config: dict[str, Any]) -> str:
    """Where a trial's weights go, named by its hyperparameters: training is seeded, so the
    same ones train the same weights."""
    name = "-".join(f"{key}={config[key]}" for key in HYPERPARAMETERS)
    return os.path.join(config["model_dir"], f"names-{name}.pt")


def train_names(ctx: prefect_ddp.RankContext, config: dict[str, Any]) -> dict[str, Any]:
    """One rank of one trial: train, report the gang's mean loss every epoch, stop when pruned.

    Rank 0 of a trial that ran every epoch saves the weights and returns their path as
    `model_url` (the sweep records it for the best trial); a pruned trial's are not kept.
    """
    torch.manual_seed(config["seed"])
    device = torch.device(ctx.device)
    dataset = encode(config["names"])
    sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=config["seed"])
    loader = DataLoader(dataset, batch_size=config["batch_size"], sampler=sampler)
    net = NameModel(config["hidden"]).to(device)
    model = net
    if dist.is_initialized():
        model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    log = get_run_logger()
    losses: list[float] = []
    for epoch in range(1, config["epochs"] + 1):
        sampler.set_epoch(epoch)
        model.train()
        total, count = 0.0, 0
        for prefixes, targets in loader:
            prefixes, targets = prefixes.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(prefixes), targets)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(targets)
            count += len(targets)
        total, count = prefect_ddp.all_reduce_sum([total, count], device=device)
        losses.append(total / count)
        log.info("epoch %d/%d: loss %.4f", epoch, config["epochs"], losses[-1])
        if ctx.report(epoch, {"loss": losses[-1]}):
            log.info("Pruned by the sweep after epoch %d", epoch)
            break
    if not ctx.is_main:
        return {"losses": losses}
    sample = generate(net, max(map(len, config["names"])), SAMPLES, config["seed"])
    log.info("Names from this model: %s", ", ".join(sample))
    saved = None
    if len(losses) == config["epochs"]:
        saved = model_url(config)
        os.makedirs(config["model_dir"], exist_ok=True)
        torch.save(net.state_dict(), saved)
    return {"losses": losses, "sample": sample, "model_url": saved}


def names_from(url: str, config: dict[str, Any], count: int) -> list[str]:
    """Names sampled from saved weights, for a model of `config`'s size."""
    model = NameModel(config["hidden"])
    model.load_state_dict(torch.load(url, weights_only=True, map_location="cpu"))
    return generate(model, max(map(len, config["names"])), count, config["seed"])


@flow(name="name-generator-sweep")
def name_generator_sweep(
    n_trials: int = 4,
    epochs: int = 5,
    concurrency: int = 2,
    output: str = "./outputs",
    address: str | None = None,
) -> dict[str, Any]:
    """Train the name generator once per (batch_size, lr) of the grid and compare the trials.

    Args:
        n_trials: trials to train; the grid has 4 points, so at most 4.
        epochs: epochs per trial (a pruned trial stops sooner).
        concurrency: trials training at once, each on its own worker.
        output: local folder for the study, sweep.json, curves.png and the models.
        address: scheduler of an existing Dask cluster; empty: a local one of 2 workers.

    Returns:
        What sweep.json holds ("trials" best first, "best", ...), plus "generated": names
        sampled from the best trial's model.
    """
    settings = prefect_ddp.SweepSettings(
        name="name-generator", n_trials=n_trials, concurrency=concurrency, ranks_per_trial=1,
        metric="loss", direction="minimize", sampler="grid", pruner="median",
    )
    model_dir = os.path.join(os.path.abspath(output), settings.name, "models")
    config = {**BASE_CONFIG, "epochs": epochs, "names": load_names(), "model_dir": model_dir}
    with DaskCluster(address=address, n_workers=2).task_runner() as runner:
        record = prefect_ddp.sweep(train_names, config, SPACE, settings, task_runner=runner, output=output)
    best = record["best"]
    if best is None:
        states = "; ".join(f"trial {row['trial']}: {row['state']}" for row in record["trials"])
        raise RuntimeError(f"No trial of the sweep completed ({states}). The ranks' logs say why.")
    generated = names_from(best["model_url"], config, count=10)
    get_run_logger().info("Best: trial %d %s, loss %.4f. Its names: %s",
                          best["trial"], best["params"], best["value"], ", ".join(generated))
    return {**record, "generated": generated}


if __name__ == "__main__":
    name_generator_sweep()
