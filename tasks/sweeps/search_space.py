"""The typed search space of a sweep, as the UI's Run form and the CLI take it.

Keys are dotted paths into the trained configuration (`training.lr`, `model.backbone`,
or a key of a user's own config dict); each value says how to draw it. Optuna's samplers
do the drawing; this module only says what may be drawn.

    {"training.lr": {"kind": "log_uniform", "low": 0.0001, "high": 0.1},
     "training.batch_size": {"kind": "grid", "values": [16, 32, 64]}}
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Value = float | int | str | bool


class Dimension(BaseModel):
    """How one parameter is drawn."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["grid", "choice", "uniform", "log_uniform", "int"] = Field(
        description="grid: try every value (with sampler grid); choice: one of values; "
        "uniform or log_uniform: a float in [low, high]; int: an integer in [low, high]."
    )
    values: list[Value] | None = Field(default=None, description="The values of grid or choice.")
    low: float | None = Field(default=None, description="Lower bound of uniform, log_uniform or int.")
    high: float | None = Field(default=None, description="Upper bound of uniform, log_uniform or int.")

    @model_validator(mode="after")
    def _complete(self) -> Dimension:
        if self.kind in ("grid", "choice"):
            if not self.values:
                raise ValueError(f"kind={self.kind!r} needs values, a non-empty list; got {self.values!r}.")
            return self
        if self.low is None or self.high is None or not self.low < self.high:
            raise ValueError(f"kind={self.kind!r} needs low < high; got low={self.low!r}, high={self.high!r}.")
        if self.kind == "log_uniform" and self.low <= 0:
            raise ValueError(f"kind='log_uniform' needs low > 0; got low={self.low!r}.")
        return self

    def offered(self) -> list[Value]:
        """The values a grid or choice offers; a range's ends.

        >>> Dimension(kind="uniform", low=0.1, high=0.3).offered(), Dimension(kind="grid", values=[1, 2]).offered()
        ([0.1, 0.3], [1, 2])
        """
        if self.values is not None:
            return self.values
        assert self.low is not None and self.high is not None, "_complete requires low and high of a range"
        return [self.low, self.high]

    def distribution(self) -> Any:
        """The Optuna distribution this dimension draws from."""
        from optuna.distributions import (
            CategoricalDistribution,
            FloatDistribution,
            IntDistribution,
        )

        if self.kind in ("grid", "choice"):
            assert self.values is not None, "_complete requires values of grid and choice"
            return CategoricalDistribution(self.values)
        assert self.low is not None and self.high is not None, "_complete requires low and high of the rest"
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high))
        return FloatDistribution(self.low, self.high, log=self.kind == "log_uniform")


def distributions(space: dict[str, Dimension]) -> dict[str, Any]:
    return {name: dimension.distribution() for name, dimension in space.items()}


def grid(space: dict[str, Dimension]) -> dict[str, list[Value]]:
    """The grid of a space whose every dimension is a grid; the sampler `grid` needs one."""
    not_grid = [name for name, dimension in space.items() if dimension.kind != "grid"]
    if not_grid:
        raise ValueError(
            f"sampler='grid' tries every combination, so every dimension must be kind='grid'; "
            f"{not_grid} are not. Give them values as a grid, or use sampler 'random' or 'tpe'."
        )
    values: dict[str, list[Value]] = {}
    for name, dimension in space.items():
        assert dimension.values is not None, "_complete requires values of grid"
        values[name] = list(dimension.values)
    return values


def grid_size(space: dict[str, Dimension]) -> int:
    size = 1
    for values in grid(space).values():
        size *= len(values)
    return size


def set_path(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of nested `config` with `path` ('training.lr') set to `value`."""
    head, _, rest = path.partition(".")
    updated = dict(config)
    updated[head] = set_path(dict(config.get(head) or {}), rest, value) if rest else value
    return updated


def with_params(config: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    for path, value in params.items():
        config = set_path(config, path, value)
    return config


def describe(params: dict[str, Any], *, digits: int, separator: str, short: bool = False) -> str:
    """`lr=0.00123 batch_size=32`: each value as a person reads it, floats to `digits`
    significant digits; `short` names a dotted path by its last part."""
    def name(path: str) -> str:
        return path.split(".")[-1] if short else path

    return separator.join(f"{name(path)}={value:.{digits}g}" if isinstance(value, float) else f"{name(path)}={value}"
                          for path, value in params.items())
