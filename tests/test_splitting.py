import pytest

from tasks.manifest import Manifest
from tasks.splitting import stratified_split


def manifest(counts: dict[str, int]) -> Manifest:
    classes = sorted(counts)
    paths, labels = [], []
    for label, name in enumerate(classes):
        for i in range(counts[name]):
            paths.append(f"{name}/{i:03d}.jpg")
            labels.append(label)
    return Manifest(root="s3://b/p", classes=classes, paths=paths, sizes=[1] * len(paths), labels=labels)


def test_split_is_disjoint_complete_and_stratified():
    m = manifest({"a": 50, "b": 30, "c": 20})
    split = stratified_split(m, 0.2, seed=7)
    assert not set(split.train) & set(split.val)
    assert sorted(split.train + split.val) == list(range(len(m)))
    val_per_class = [sum(1 for i in split.val if m.labels[i] == c) for c in range(3)]
    assert val_per_class == [10, 6, 4]


def test_split_is_deterministic_and_independent_of_listing_order():
    m = manifest({"a": 40, "b": 40})
    reordered = m.model_copy(update={
        "paths": m.paths[::-1], "labels": m.labels[::-1], "sizes": m.sizes[::-1],
    })
    first, second = stratified_split(m, 0.25, 3), stratified_split(reordered, 0.25, 3)
    assert first == stratified_split(m, 0.25, 3)
    assert {m.paths[i] for i in first.val} == {reordered.paths[i] for i in second.val}
    assert {m.paths[i] for i in first.train} == {reordered.paths[i] for i in second.train}


def test_seed_changes_the_split():
    m = manifest({"a": 40, "b": 40})
    assert stratified_split(m, 0.25, 1).val != stratified_split(m, 0.25, 2).val


def test_small_classes_still_get_one_image_each_way():
    m = manifest({"a": 2, "b": 3, "c": 100})
    split = stratified_split(m, 0.1, 0)
    for label in (0, 1):
        assert sum(1 for i in split.val if m.labels[i] == label) == 1
        assert sum(1 for i in split.train if m.labels[i] == label) >= 1


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.1])
def test_fraction_out_of_range_is_rejected(fraction):
    with pytest.raises(ValueError, match=f"val_fraction must be between 0 and 1.*got {fraction}"):
        stratified_split(manifest({"a": 5, "b": 5}), fraction, 0)
