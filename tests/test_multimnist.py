"""DiverseMultiMNIST generator, multi-label loss and the paper's top-2 metric."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from capsctl.config import load_preset
from capsctl.data.dataset import ArrayDataset
from capsctl.data.multimnist import CANVAS, diverse_multimnist, multi_hot, top2_correct
from capsctl.engine import evaluate, fit


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
