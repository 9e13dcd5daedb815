import pytest

from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.results.aggregation import (
    EpochsDisagree,
    check_one_best_epoch,
    global_history,
    last_epoch_time,
    summarize,
)
from prefect_ddp.tasks.training.optimization import EffectiveRecipe
from prefect_ddp.tasks.training.rank_result import RankResult

pytestmark = pytest.mark.unit


def history(*val_accs):
    return [{"epoch": i + 1, "train_loss": 1.0, "train_acc": 0.5, "val_loss": 1 - acc, "val_acc": acc,
             "train_samples": 10, "val_samples": 4, "lr": 0.1, "seconds": 1.0, "unreadable": []}
            for i, acc in enumerate(val_accs)]


def rank(r, hist, local=(5, 5), best_epoch=1):
    return RankResult(rank=r, worker_address=f"tcp://h:{r}", split_digest="abc", history=hist,
                      local_train_samples=list(local), checkpoint_s=[], best_epoch=best_epoch,
                      selected_by="highest val_acc", pruned_at=None, attempts=[],
                      unreadable={"decode_check": 1, "in_training": 0, "keys": []}, stopped=None,
                      recipe=EffectiveRecipe(lr=0.1, lr_scaled_by=1, warmup_epochs=0, weight_decay=0.0,
                                             frozen_batchnorm=0, sync_batchnorm=False),
                      comparison=None)


def test_the_best_epoch_is_the_one_whose_weights_rank_0_kept_and_the_final_metrics_the_last():
    summary = summarize([rank(0, history(0.5, 0.9, 0.8), best_epoch=2), rank(1, history(0.5, 0.9, 0.8), best_epoch=2)],
                        Split(train=list(range(10)), val=[10, 11, 12, 13], seed=0, val_fraction=0.3), {})
    assert (summary.best_epoch, summary.best_val_acc, summary.final_val_acc) == (2, 0.9, 0.8)
    assert summary.selected_by == "highest val_acc"
    assert summary.world_size == 2 and summary.split_digests == ["abc"]
    assert summary.unreadable == {"decode_check": 1, "in_training": 0, "keys": []}
    # metrics.json and the flow's result keep their keys, in their order
    assert list(summary.model_dump()) == [
        "world_size", "ranks", "split_digests", "train_size", "val_size", "history", "best_epoch", "best_val_acc",
        "selected_by", "final_val_acc", "final_val_loss", "time", "pruned_at", "attempts", "unreadable", "recipe",
        "comparison", "files"]


def test_ranks_that_disagree_on_global_metrics_are_an_error():
    with pytest.raises(ValueError, match="Rank 1 reports other global metrics than rank 0"):
        global_history([rank(0, history(0.5)), rank(1, history(0.6))])


def test_ranks_whose_loss_diverged_to_nan_together_agree_and_a_difference_names_its_epoch():
    def diverged():  # a NaN object of each rank's own, as each rank's all-reduce returns it
        return history(0.5, 0.5) + [{**history(0.5)[0], "epoch": 3, "train_loss": float("nan"), "val_loss": float("nan")}]

    rank_0 = diverged()
    assert global_history([rank(0, rank_0), rank(1, diverged())]) is rank_0
    with pytest.raises(ValueError, match=r"from epoch 2 on .* 2 against 2 epochs"):
        global_history([rank(0, history(0.5, 0.6)), rank(1, history(0.5, 0.7))])
    with pytest.raises(ValueError, match=r"from epoch 2 on \(\[\] vs .* 1 against 2 epochs"):
        global_history([rank(0, history(0.5, 0.6)), rank(1, history(0.5))])


def test_no_results_is_an_error():
    with pytest.raises(ValueError, match="No rank results to aggregate"):
        global_history([])


@pytest.mark.unit
def test_an_epoch_timed_in_another_shape_or_not_at_all_has_no_last_epoch_time():
    """A checkpoint written by an older release and resumed after its last epoch holds that
    epoch's time in the shape of its day: the report goes without it instead of failing the run."""
    assert last_epoch_time([{"epoch": 1}], []) is None
    assert last_epoch_time([{"epoch": 1, "time": {"images_per_s": 3.0, "shares": {}}}], [1.5]) is None


def test_files_that_name_different_best_epochs_fail_the_run_loudly():
    """Issue 56: the result said epoch 2 while model.json (and model.pt) held epoch 1."""
    summary = summarize([rank(0, history(0.5, 0.9), best_epoch=2)],
                        Split(train=list(range(10)), val=[10, 11, 12, 13], seed=0, val_fraction=0.3), {})
    check_one_best_epoch(summary, {"epoch": 2})
    with pytest.raises(EpochsDisagree, match=r"the ranks' result says epoch 2, model.json says epoch 1"):
        check_one_best_epoch(summary, {"epoch": 1})
    scored = summary.model_copy(update={"comparison": {"challenger_epoch": 1}})
    with pytest.raises(EpochsDisagree, match=r"the champion comparison says epoch 1"):
        check_one_best_epoch(scored, {"epoch": 2})
