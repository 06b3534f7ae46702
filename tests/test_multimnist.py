"""DiverseMultiMNIST generator, multi-label loss and the paper's top-2 metric."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from capsctl.config import load_preset
from capsctl.data import load_dataset, split_train_val
from capsctl.data.dataset import ArrayDataset, stratified_val_mask
from capsctl.data.multimnist import (
    CANVAS,
    SEEDS,
    CompositeDataset,
    diverse_multimnist,
)
from capsctl.data.prepare import prepare_data
from capsctl.errors import DataError
from capsctl.evaluation import evaluate
from capsctl.losses import multi_hot, top2_correct
from capsctl.training import fit


def fake_mnist(n: int = 300) -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    images = torch.zeros(n, 1, 28, 28, dtype=torch.uint8)
    labels = torch.arange(n) % 10
    for i in range(n):  # a bright bar whose row encodes the class
        images[i, 0, 4 + 2 * int(labels[i]), 4:24] = 200 + int(
            torch.randint(0, 50, (1,), generator=g)
        )
    return ArrayDataset(images, labels, [str(i) for i in range(10)], "mnist")


def test_generator_is_deterministic_and_follows_the_recipe() -> None:
    mnist = fake_mnist()
    a = diverse_multimnist(mnist, 600, seed=3)
    b = diverse_multimnist(mnist, 600, seed=3)
    c = diverse_multimnist(mnist, 600, seed=4)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, c.images)
    assert a.images.shape == (600, 1, CANVAS, CANVAS) and a.labels.shape == (600, 2)
    single = a.labels[:, 1] < 0
    assert 0.10 < single.float().mean() < 0.24  # about 1/6 single digits
    pairs = a.labels[~single]
    assert bool((pairs[:, 0] != pairs[:, 1]).all())  # two different classes
    assert a.multi_label


def test_shifts_stay_within_four_pixels() -> None:
    mnist = fake_mnist(50)
    ds = diverse_multimnist(mnist, 400, seed=1)
    for i in range(400):
        if ds.labels[i, 1] >= 0:
            continue
        ys, xs = torch.nonzero(ds.images[i, 0], as_tuple=True)
        # the bar spans source columns 4..23, placed at 4 + dx with |dx| <= 4
        assert 4 <= int(xs.min()) <= 12 and 23 <= int(xs.max()) <= 31


def test_one_image_per_mnist_digit_by_default() -> None:
    mnist = fake_mnist(120)
    ds = diverse_multimnist(mnist, seed=0)
    assert len(ds) == 120
    assert torch.equal(ds.labels[:, 0], mnist.labels)


def test_top2_metric_and_multi_hot() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0], [5.0, 0.0, 4.0], [0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    y = torch.tensor([[1, 0], [0, 1], [1, -1], [2, -1]])
    assert top2_correct(logits, y).tolist() == [True, False, True, False]
    assert multi_hot(y, 3).tolist() == [[1, 1, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1]]


def test_multi_label_training_and_evaluation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import capsctl.data.sources as sources

    fake = fake_mnist(400)
    monkeypatch.setattr(sources, "_load_idx_dataset", lambda *a, **k: (fake, "fake"))
    p = load_preset("multimnist-caps")
    p.model.primary_types = 4
    for layer in p.model.layers:
        layer.types = 4
    p.data.val_size = 50
    p.train.epochs, p.train.batch_size, p.train.steps_per_epoch = 1, 16, 3
    res = fit(p, tmp_path, handle_sigint=False)
    assert res.test is not None and res.test.metric.startswith("top-2")
    # an image with two labels is one image: 3 steps of 16
    assert res.history[0]["images"] == 48
    assert res.test.confusion == [] and len(res.test.per_class) == 10
    from capsctl.checkpoint import load_checkpoint

    model, meta = load_checkpoint(tmp_path / "best.safetensors")
    ds = diverse_multimnist(fake, 64, seed=9)
    ev = evaluate(
        model,
        ds,
        batch_size=32,
        device=torch.device("cpu"),
        mean=[0.1307],
        std=[0.3081],
        classes=meta["classes"],
    )
    with torch.no_grad():
        x = (ds.images.float() / 255 - 0.1307) / 0.3081
        manual = top2_correct(model(x), ds.labels).float().mean().item()
    assert ev.accuracy == pytest.approx(manual)


# --------------------------------------------------------------------------------------------
# Validation split: held-out source digits


def id_mnist(n: int = 250) -> ArrayDataset:
    """MNIST-like digits whose pixels name them: digit ``i`` is a bar of value ``i + 1``."""
    assert n <= 255
    images = torch.zeros(n, 1, 28, 28, dtype=torch.uint8)
    labels = torch.arange(n) % 10
    for i in range(n):  # the bar's row encodes the class, its value the digit
        images[i, 0, 4 + 2 * int(labels[i]), 4:24] = i + 1
    return ArrayDataset(images, labels, [str(i) for i in range(10)], "mnist")


def visible_digits(ds: ArrayDataset) -> set[int]:
    """Ids of the source digits whose pixels appear in ``ds`` (read from the images only)."""
    values = ds.images.unique()
    return {int(v) - 1 for v in values if int(v) > 0}


def recorded_digits(ds: CompositeDataset) -> set[int]:
    """Ids of the source digits ``ds`` says it used (first and second digits)."""
    return set(ds.first.tolist()) | {i for i in ds.second.tolist() if i >= 0}


def test_validation_composites_use_only_held_out_digits() -> None:
    mnist = id_mnist(250)
    full = diverse_multimnist(mnist, seed=SEEDS["train"])
    train, val = split_train_val(full, 50, seed=0)
    # sizes: one composite per digit on each side
    assert (len(train), len(val)) == (200, 50)
    assert train.images.shape == (200, 1, CANVAS, CANVAS) and val.labels.shape == (50, 2)
    # read from the pixels: no digit of a validation image is drawn in a training image
    assert visible_digits(val).isdisjoint(visible_digits(train))
    assert len(visible_digits(val)) >= 50 and len(visible_digits(train)) >= 200


def test_old_split_of_composites_leaks_digits() -> None:
    # The check above fails for what split_train_val did before: pick composites, not digits.
    mnist = id_mnist(250)
    full = diverse_multimnist(mnist, seed=SEEDS["train"])
    is_val = stratified_val_mask(full.labels[:, 0], 10, 50, seed=0)
    old_train, old_val = full.subset(~is_val), full.subset(is_val)
    assert not visible_digits(old_val).isdisjoint(visible_digits(old_train))


def test_split_records_disjoint_sources_stratified_and_consistent() -> None:
    mnist = id_mnist(250)
    full = diverse_multimnist(mnist, seed=SEEDS["train"])
    train, val = split_train_val(full, 50, seed=0)
    assert isinstance(train, CompositeDataset) and isinstance(val, CompositeDataset)
    assert recorded_digits(val).isdisjoint(recorded_digits(train))
    # every digit is the first digit of exactly one image, on exactly one side
    assert sorted(train.first.tolist() + val.first.tolist()) == list(range(250))
    assert torch.bincount(mnist.labels[val.first], minlength=10).tolist() == [5] * 10
    for part in (train, val):
        pair = part.second >= 0
        assert torch.equal(part.labels[:, 0], mnist.labels[part.first])
        assert torch.equal(part.labels[pair, 1], mnist.labels[part.second[pair]])
        assert bool((part.labels[~pair, 1] == -1).all())
        assert bool((part.labels[pair, 0] != part.labels[pair, 1]).all())
        for i in range(len(part)):  # the pixels come from the recorded digits only
            digits = {int(part.first[i])} | ({int(part.second[i])} if pair[i] else set())
            assert visible_digits(part.subset(torch.tensor([i]))) <= digits


def test_split_is_deterministic_and_leaves_the_full_set_alone() -> None:
    mnist = id_mnist(250)
    full = diverse_multimnist(mnist, seed=SEEDS["train"])
    before = full.images.clone()
    train, val = split_train_val(full, 50, seed=4)
    torch.manual_seed(1234)  # the global RNG does not matter
    train2, val2 = split_train_val(full, 50, seed=4)
    for a, b in ((train, train2), (val, val2)):
        assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.first, b.first) and torch.equal(a.second, b.second)
    _, val3 = split_train_val(full, 50, seed=5)
    assert set(val3.first.tolist()) != set(val.first.tolist())
    assert torch.equal(full.images, before)
    # val_size 0: no hold-out, the composites as they are
    whole, empty = split_train_val(full, 0, seed=4)
    assert torch.equal(whole.images, full.images) and len(empty) == 0


def test_split_of_a_fixed_size_composite_set() -> None:
    mnist = id_mnist(250)
    full = diverse_multimnist(mnist, 400, seed=2)
    train, val = split_train_val(full, 60, seed=1)
    assert (len(train), len(val)) == (340, 60)
    assert recorded_digits(val).isdisjoint(recorded_digits(train))
    assert visible_digits(val).isdisjoint(visible_digits(train))
    assert len(recorded_digits(val)) <= 60  # only the 60 held-out digits


def test_one_class_pool_is_an_error_not_a_hang() -> None:
    mnist = id_mnist(50)
    with pytest.raises(DataError, match="two classes"):
        diverse_multimnist(mnist, 30, seed=0, pool=torch.nonzero(mnist.labels == 3)[:, 0])


def test_trainer_data_uses_the_held_out_split(monkeypatch: pytest.MonkeyPatch) -> None:
    import capsctl.data.sources as sources

    mnist = id_mnist(250)
    monkeypatch.setattr(sources, "_load_idx_dataset", lambda *a, **k: (mnist, "fake"))
    p = load_preset("multimnist-caps")
    p.data.val_size = 40
    data = prepare_data(p)
    assert (len(data.train), len(data.val)) == (210, 40)
    assert visible_digits(data.val).isdisjoint(visible_digits(data.train))


def test_real_multimnist_split(data_root: Path) -> None:
    full = load_dataset("diverse-multimnist", "train", data_root, download=False)
    train, val = split_train_val(full, 5000, seed=0)
    assert (len(train), len(val)) == (55000, 5000)

    def used(ds: CompositeDataset) -> torch.Tensor:
        return torch.cat([ds.first, ds.second[ds.second >= 0]]).unique()

    assert not bool(torch.isin(used(val), used(train)).any())
    assert val.first.unique().numel() == 5000
    counts = torch.bincount(full.digits.labels[val.first], minlength=10)
    expected = torch.bincount(full.digits.labels, minlength=10) * 5000 / 60000
    assert bool(((counts - expected).abs() <= 1).all())  # stratified by class
