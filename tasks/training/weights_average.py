"""An exponential moving average (EMA) of the weights, validated beside them and kept when better.

`training.ema_decay`: after every optimizer step the average moves `1 - decay` of the way to the
model's weights (torch's `AveragedModel` with `get_ema_multi_avg_fn`; BatchNorm's running
statistics averaged with them), so it remembers about `1 / (1 - decay)` steps: 0.999 about a
thousand. Each epoch validates the model and the average on the same images; the epoch's record
says which did better by the run's selection metric (tasks/selection.py) and gives that one's
`val_loss` and `val_acc`, so the best epoch's weights, model.pt, promotion, a sweep's objective
and a plateau schedule all take the better of the two (docs/models.md, "Fine-tuning knobs").
The average is part of every checkpoint and of the state an elastic gang hands over.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from prefect_ddp.tasks.selection import Selection, is_better

VALIDATED = ("val_loss", "val_acc")


def weights_average(model: nn.Module, decay: float | None) -> AveragedModel | None:
    """The EMA of `model`'s weights and buffers, starting from them; None without `training.ema_decay`."""
    if decay is None:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def with_average(record: dict[str, Any], average: list[float], selection: Selection) -> dict[str, Any]:
    """The epoch's record with the average's validation beside the model's (`average`: its gang's
    loss sum, correct and count), its `val_*` those of the one kept: the average where it did strictly
    better by `selection`, else the model (a tie, or a metric validation does not give, keeps the model).

    >>> record = {"epoch": 1, "val_loss": 0.5, "val_acc": 0.75}
    >>> kept = with_average(record, [2.0, 7.0, 8.0], Selection())
    >>> kept["weights"], kept["val_acc"], kept["model_val_acc"], kept["ema_val_loss"]
    ('ema', 0.875, 0.75, 0.25)
    >>> with_average(record, [2.0, 7.0, 8.0], Selection("train_loss", "minimize"))["weights"]
    'model'
    """
    loss, correct, count = average
    averaged = {"val_loss": loss / max(count, 1), "val_acc": correct / max(count, 1)}
    better = selection.metric in VALIDATED and is_better(averaged[selection.metric], record[selection.metric],
                                                         selection.direction)
    both = {f"model_{key}": record[key] for key in VALIDATED} | {f"ema_{key}": averaged[key] for key in VALIDATED}
    return record | both | (averaged if better else {}) | {"weights": "ema" if better else "model"}


def kept_module(model: nn.Module, average: AveragedModel | None, record: dict[str, Any]) -> nn.Module:
    """The weights the epoch of `record` kept: the average's where it did better, else the model's."""
    return average.module if average is not None and record.get("weights") == "ema" else model
