"""The boundary part that scores the kept model (the champion) beside this run's best epoch.

Once the run trained every epoch, after the checkpoint part waited for rank 0's last writes
(model.pt among them), every rank scores both models on its share of the validation images
the champion never trained on (tasks/training/champion.py). A run pruned or stopped early
scores nothing: every rank agrees on that, so all score or none does.
"""

from __future__ import annotations

from typing import Any

from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.training.boundary import BoundaryPart, TrainingEnd
from prefect_ddp.tasks.training.champion import Champion, score_against_champion
from prefect_ddp.tasks.training.formation import Formation
from prefect_ddp.tasks.training.rank_setup import RankSetup


class ChampionScoring(BoundaryPart):
    name = "champion"

    def __init__(self, ctx: RankContext, champion: Champion, rank: RankSetup, formation: Formation) -> None:
        self.ctx = ctx
        self.champion = champion
        self.rank = rank
        self.formation = formation

    def after_training(self, end: TrainingEnd) -> None:
        """The scores, on `formation.comparison` for the rank's result."""
        kept = self.formation.kept.epoch
        if end.completed and kept:
            self.formation.comparison = self._score(kept)

    def _score(self, kept: int) -> dict[str, Any]:
        return score_against_champion(self.ctx, self.champion, self.formation.files.folder, self.rank.data,
                                      self.rank.device, kept)
