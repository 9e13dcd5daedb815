import pytest

from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import stratified_split

pytestmark = pytest.mark.unit


def manifest(counts: dict[str, int]) -> Manifest:
    classes = sorted(counts)
    paths, labels = [], []
    for label, name in enumerate(classes):
        for i in range(counts[name]):
            paths.append(f"{name}/{i:03d}.jpg")
            labels.append(label)
    return Manifest(root="s3://b/p", classes=classes, paths=paths, sizes=[1] * len(paths), labels=labels)


@pytest.mark.parametrize("counts", [{"a": 50, "b": 30, "c": 20}, {"a": 1000, "b": 3000, "c": 500}])
def test_split_is_disjoint_complete_and_stratified_within_binomial_noise(counts):
    m = manifest(counts)
    split = stratified_split(m, 0.2, seed=7)
    assert not set(split.train) & set(split.val)
    assert sorted(split.train + split.val) == list(range(len(m)))
    for label, n in enumerate(counts.values()):
        share = sum(1 for i in split.val if m.labels[i] == label) / n
        assert abs(share - 0.2) <= 3 * (0.2 * 0.8 / n) ** 0.5, (label, n, share)


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


@pytest.mark.parametrize("fraction", [0.1, 0.9])  # tiny classes all kept, or all held out, by their draws
def test_small_classes_still_get_one_image_each_way(fraction):
    m = manifest({"a": 2, "b": 3, "c": 100})
    split = stratified_split(m, fraction, 0)
    for label in (0, 1):
        assert sum(1 for i in split.val if m.labels[i] == label) >= 1
        assert sum(1 for i in split.train if m.labels[i] == label) >= 1


@pytest.mark.parametrize("fraction", [0, 1, 1.5, -0.1])
def test_fraction_out_of_range_is_rejected(fraction):
    with pytest.raises(ValueError, match=f"val_fraction must be between 0 and 1.*got {fraction}"):
        stratified_split(manifest({"a": 5, "b": 5}), fraction, 0)


def grown(m: Manifest, counts: dict[str, int]) -> Manifest:
    """`m` with more images per class, listed in another order, as a bucket grows."""
    bigger = manifest(counts)
    order = sorted(range(len(bigger)), key=lambda i: bigger.paths[i][::-1])
    return bigger.model_copy(update={k: [getattr(bigger, k)[i] for i in order] for k in ("paths", "sizes", "labels")})


@pytest.mark.parametrize("before, after", [(1000, 1010), (1000, 1100), (40, 44)])
def test_a_growing_folder_never_moves_a_trained_image_into_validation(before, after):
    first_manifest = manifest({"a": before, "b": before, "c": before})
    first = stratified_split(first_manifest, 0.2, seed=5)
    second_manifest = grown(first_manifest, {"a": after, "b": after, "c": after})
    second = stratified_split(second_manifest, 0.2, seed=5)
    trained = {first_manifest.paths[i] for i in first.train}
    validated_later = {second_manifest.paths[i] for i in second.val}
    assert not trained & validated_later, f"{len(trained & validated_later)} trained images moved into validation"
    # Images that were held out stay held out: the new run's validation is the old one plus new images.
    assert {first_manifest.paths[i] for i in first.val} <= validated_later
