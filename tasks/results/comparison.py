"""Champion against challenger on the same images: what promotion compares, and on which images.

Each run's `best_val_acc` is measured on its own validation set: another night's (the bucket
grew), another seed's or another val_fraction's. Those numbers do not compare, and a set that
holds images the kept model trained on inflates whatever was trained from it (a warm start
across another split: 80 % of one run's validation images had been the kept model's training
images). So, before promotion, the ranks score the kept model (the champion) and the run's
own model (the challenger) on the run's validation images that the champion never trained on
(`Champion.positions`: its training keys are the `split.json` kept beside it), image by image
(`tasks/training/champion.py`). Promotion then needs the challenger to be right more often by
more than the noise of that paired count: one standard error, sqrt(better + worse) / n, where
`better` and `worse` count the images only one of the two gets right (McNemar's view of a
paired comparison), or by `output.min_improvement` when that is set. A tie keeps the champion.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.data.storage import exists, read_json
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.training.champion import Champion
from prefect_ddp.tasks.training.model import model_problem
from prefect_ddp.tasks.urls import child_url

SPLIT_FILE = "split.json"


class UnusableChampion(BaseModel):
    """A kept model whose files are missing or cannot be read: warm starts and batch-predict of it
    fail, so it is not scored and this run's model replaces it (promotion.decide), whatever its
    recorded val accuracy."""

    version: str  # as latest.json names it: replaced only while the pointer still does
    run: str
    problem: str  # model_problem's answer

    def why_replaced(self) -> str:
        return (f"the kept model (of {self.run}) cannot be used, {self.problem}, so this run's model replaces it "
                "whatever its score")


def champion_to_beat(kept: Location, pointer: dict[str, Any] | None, manifest: Manifest,
                     split: Split) -> Champion | UnusableChampion | None:
    """The kept model to score beside this run's; an `UnusableChampion` when its files are missing or
    cannot be read; None when none is kept or it predicts other classes."""
    if pointer is None:
        return None
    if unusable := unusable_champion(kept, pointer):
        return unusable
    folder = kept.with_url(pointer["version"])
    run = pointer.get("run", {}).get("name", "an earlier run")
    card = read_json(child_url(folder.url, "model.json"), folder.storage_options())
    if card["classes"] != manifest.classes:
        run_logger().warning(
            "The kept model (of %s) predicts other classes (%s) than this run's (%s): it cannot be scored on "
            "this run's images, and promotion compares val accuracies on each run's own images.",
            run, card["classes"], manifest.classes)
        return None
    trained = training_keys(folder, pointer)
    val = [i for i in split.val if trained is None or manifest.paths[i] not in trained]
    return Champion(folder=folder, version=pointer["version"], run=run, positions=val,
                    left_out=len(split.val) - len(val), split_known=trained is not None)


def unusable_champion(kept: Location, pointer: dict[str, Any]) -> UnusableChampion | None:
    """The kept model `pointer` names, when its files are missing or cannot be loaded
    (model_problem), said in the run's log; None when it loads."""
    folder = kept.with_url(pointer["version"])
    if not (problem := model_problem(folder)):
        return None
    run = pointer.get("run", {}).get("name", "an earlier run")
    run_logger().warning(
        "The kept model (of %s) in %s cannot be used: %s. It is not scored, and the next model promoted under "
        "%s replaces it whatever its score: nothing needs doing, though a store that cuts files short should be "
        "looked at.", run, folder.url, problem, kept.url)
    return UnusableChampion(version=pointer["version"], run=run, problem=problem)


def training_keys(folder: Location, pointer: dict[str, Any]) -> set[str] | None:
    """The keys the kept model trained on: from split.json beside it, else in the folder of the
    run that trained it (a version kept before split.json was copied); None when neither is there."""
    run_url = pointer.get("run", {}).get("url")
    for place in (folder, folder.with_url(run_url) if run_url else None):
        if place is not None and exists(url := child_url(place.url, SPLIT_FILE), place.storage_options()):
            return set(read_json(url, place.storage_options())["train_keys"])
    return None


def decide_on_comparison(comparison: dict[str, Any], current: dict[str, Any],
                         min_improvement: float | None) -> tuple[bool, str]:
    """Promote when the challenger beats the champion on the same images by more than the margin
    (`current` is the champion it was compared with: promotion.decide checks)."""
    run = current.get("run", {}).get("name", "an earlier run")
    images = comparison["images"]
    if not images:
        return False, ("none of this run's validation images is one the kept model never trained on, so the two "
                       f"could not be compared fairly; {run}'s model stays")
    new, old = comparison["challenger_acc"], comparison["champion_acc"]
    margin = min_improvement if min_improvement is not None else noise(comparison)
    rule = (f"output.min_improvement {margin:.4f}" if min_improvement is not None
            else f"the noise of the paired count, {margin:.4f}")
    on = f"on the {images} validation images neither trained on, accuracy {new:.4f} against {old:.4f} of {run}"
    # In images, not quotients: a gain of exactly the margin is not more than it.
    if comparison["better"] - comparison["worse"] > margin * images + 1e-9:
        return True, f"{on}: better by {new - old:+.4f}, more than {rule}"
    return False, f"{on}: {new - old:+.4f} is not more than {rule}, so {run}'s model stays"


def noise(comparison: dict[str, Any]) -> float:
    """One standard error of the accuracy difference on paired images: sqrt(better + worse) / n.

    >>> noise({"images": 100, "better": 10, "worse": 6})
    0.04
    """
    return math.sqrt(comparison["better"] + comparison["worse"]) / comparison["images"]


def comparison_markdown(comparison: dict[str, Any] | None) -> str:
    """Both scores side by side, and the images they were measured on; empty without a comparison."""
    if not comparison:
        return ""
    left_out = comparison["left_out"]
    if not comparison["images"]:
        return (f"Champion against challenger: none of this run's validation images is one the kept model never "
                f"trained on ({left_out} left out), so the two were not compared.\n")
    why = (f", leaving out {left_out} the kept model trained on (its split differs: another seed, val_fraction "
           "or source)" if left_out else "")
    unknown = ("" if comparison["split_known"] else " The kept model's training images are not recorded beside "
               "it, so none could be left out: its score may include images it trained on.")
    return (
        f"Champion against challenger on the same {comparison['images']} validation images{why}:{unknown}\n\n"
        "| model | accuracy | right where the other is wrong |\n|---|---|---|\n"
        f"| this run's (epoch {comparison['challenger_epoch']}) | {comparison['challenger_acc']:.4f} | "
        f"{comparison['better']} |\n"
        f"| kept, of {comparison['champion_run']} | {comparison['champion_acc']:.4f} | {comparison['worse']} |\n"
    )
