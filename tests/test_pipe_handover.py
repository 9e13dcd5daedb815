"""Batches handed over through the loader processes' pipes where /dev/shm cannot hold them
(prefect_ddp.tasks.data.pipe_handover; the choice: tests/test_host_budget.py)."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch

from prefect_ddp.tasks.data.dataset import EncodedImage
from prefect_ddp.tasks.data.device_batches import EncodedBatch, encoded_collate
from prefect_ddp.tasks.data.loader_steps import collate_images
from prefect_ddp.tasks.data.loaders import rank_data
from prefect_ddp.tasks.data.pipe_handover import PipedCollate
from tests.test_training import CTX, local_job

REPO = Path(__file__).resolve().parent.parent
# In a mount namespace of its own, with a /dev/shm of 1 MiB (its semaphores need a page each): the rank's loader
# process (training.num_workers=1) reads a local folder's validation images at 224 px, 2 (294 KiB) a batch; a plain
# DataLoader then hands over one batch of 8 (1.15 MiB) in /dev/shm.
SMALL_SHM_RANK = """
import json, sys
from pathlib import Path
import torch
from torch.utils.data import DataLoader
from prefect_ddp.tasks.data.loader_steps import collate_images
from tests.test_pipe_handover import val_sums

sums, why = val_sums(Path(sys.argv[1]))
try:
    batch = [(torch.zeros(3, 224, 224, dtype=torch.uint8), 0)] * 8
    next(iter(DataLoader([batch], batch_size=None, num_workers=1, collate_fn=collate_images)))
    in_shm = "handed over"
except RuntimeError as error:
    in_shm = str(error)
print(json.dumps({"sums": sums, "why": why, "in_shm": in_shm}))
"""


def val_sums(folder: Path) -> tuple[list[int], str]:
    """Each validation batch's pixel sum as a rank reads a local folder with one loader process at 224 px,
    and why it has that loader process (its budget's sentences)."""
    job = local_job(folder, epochs=1)
    job = job.model_copy(update={"training": job.training.model_copy(update={"num_workers": 1, "image_size": 224,
                                                                                        "batch_size": 2})})
    data = rank_data(CTX, job.source, job.output, job.manifest, job.split, job.training, job.preprocessing)
    sums = [int(images.sum()) for images, _ in data.val]
    return sums, data.loader_workers.why


def piped(batch):
    """`batch` as the rank gets it from a loader process's pipe: pickled as multiprocessing pickles it."""
    return ForkingPickler.loads(ForkingPickler.dumps(batch))


@pytest.mark.unit
def test_a_piped_batch_arrives_as_the_tensors_it_left_in_their_memory_order():
    samples = [(torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8), label) for label in range(3)]
    images, labels = piped(PipedCollate(functools.partial(collate_images, shared=False))(samples))
    expected_images, expected_labels = collate_images(samples)
    assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    assert images.is_contiguous(memory_format=torch.channels_last) and type(images) is torch.Tensor
    # The bytes travel in the pickle itself, not as a handle to /dev/shm.
    assert len(ForkingPickler.dumps(PipedCollate(functools.partial(collate_images, shared=False))(samples))) > images.nbytes
    for odd in (torch.tensor(2.5, dtype=torch.bfloat16), torch.ones(2, 0, 3), torch.tensor([True, False]),
                torch.arange(6.0, requires_grad=True).reshape(2, 3).t()):
        back = piped(PipedCollate(lambda tensor: tensor)(odd))
        assert back.dtype == odd.dtype and back.stride() == odd.stride() and torch.equal(back, odd.detach())
    encoded = [(EncodedImage(torch.tensor([255, 216, position], dtype=torch.uint8), position), position) for position in (4, 9)]
    batch, labels = piped(PipedCollate(encoded_collate)(encoded))
    assert isinstance(batch, EncodedBatch) and [image.tolist() for image in batch.data] == [[255, 216, 4], [255, 216, 9]]
    assert batch.positions.tolist() == [4, 9] and labels.tolist() == [4, 9]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) for a mount namespace with its own /dev/shm")
def test_a_rank_on_a_host_whose_dev_shm_holds_no_batch_reads_the_same_batches_through_pipes(tmp_path):
    """Docker's and Kubernetes' /dev/shm is 64 MiB unless set: DataLoader's hand-over there fails, or the
    budget left the rank without loader processes. Through the pipes the same batches arrive."""
    script = (f"mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c '{SMALL_SHM_RANK}' "
              f"{tmp_path / 'small'}")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    small = json.loads(done.stdout.strip().splitlines()[-1])
    assert "No space left on device" in small["in_shm"]  # /dev/shm holds no batch there
    # (The ranks sharing the host follow the CPUs and torch's threads the process was given.)
    assert re.match(r"training.num_workers=1, as set; Batches cross the loader processes' pipes, not /dev/shm: "
                    r"/dev/shm holds 1 MiB for the \d+ rank\(s\) on this host", small["why"]), small["why"]
    sums, why = val_sums(tmp_path / "here")  # this host's /dev/shm holds them
    assert "pipes" not in why and small["sums"] == sums and len(sums) > 1
