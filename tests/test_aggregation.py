import pytest

from tasks.aggregation import global_history, summarize
from tasks.splitting import Split


def history(*val_accs):
    return [{"epoch": i + 1, "train_loss": 1.0, "train_acc": 0.5, "val_loss": 1 - acc, "val_acc": acc,
             "train_samples": 10, "val_samples": 4, "lr": 0.1, "seconds": 1.0} for i, acc in enumerate(val_accs)]


def rank(r, hist, local=(5, 5)):
    return {"rank": r, "worker_address": f"tcp://h:{r}", "split_digest": "abc", "history": hist,
            "local_train_samples": list(local)}


def test_best_epoch_and_final_metrics_over_the_gang():
    summary = summarize([rank(0, history(0.5, 0.9, 0.8)), rank(1, history(0.5, 0.9, 0.8))],
                        Split(train=list(range(10)), val=[10, 11, 12, 13], seed=0, val_fraction=0.3))
    assert (summary["best_epoch"], summary["best_val_acc"], summary["final_val_acc"]) == (2, 0.9, 0.8)
    assert summary["world_size"] == 2 and summary["split_digests"] == ["abc"]


def test_ranks_that_disagree_on_global_metrics_are_an_error():
    with pytest.raises(ValueError, match="Rank 1 reports other global metrics than rank 0"):
        global_history([rank(0, history(0.5)), rank(1, history(0.6))])


def test_no_results_is_an_error():
    with pytest.raises(ValueError, match="No rank results to aggregate"):
        global_history([])
