"""Static facts about the datasets capsctl knows: names, descriptions, normalization constants.

This module imports neither torch nor numpy, so a CLI can list datasets cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from capsctl.errors import DataError

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR100_CLASSES",
    "DATASETS",
    "FASHION_MNIST_CLASSES",
    "MNIST_CLASSES",
    "NORMALIZATION",
    "DatasetInfo",
    "dataset_info",
    "normalization_for",
]


@dataclass(frozen=True)
class DatasetInfo:
    """What the CLI needs to know about a dataset name before loading it.

    ``val_size`` is the default number of training images held out for validation by
    :func:`capsctl.data.split_train_val` (0 means: no default hold-out).
    ``channels``/``image_size``/``num_classes`` are ``None`` when they depend on the files.
    """

    name: str
    description: str
    normalization: str
    val_size: int
    channels: int | None
    image_size: int | None
    num_classes: int | None


DATASETS: dict[str, DatasetInfo] = {
    info.name: info
    for info in (
        DatasetInfo(
            "cifar10",
            "CIFAR-10: 50,000 train / 10,000 test 32x32 RGB images in 10 classes",
            "cifar10",
            5000,
            3,
            32,
            10,
        ),
        DatasetInfo(
            "cifar100",
            "CIFAR-100 (fine labels): 50,000 train / 10,000 test 32x32 RGB images in 100 classes",
            "cifar100",
            5000,
            3,
            32,
            100,
        ),
        DatasetInfo(
            "mnist",
            "MNIST: 60,000 train / 10,000 test 28x28 grayscale handwritten digits",
            "mnist",
            5000,
            1,
            28,
            10,
        ),
        DatasetInfo(
            "fashion-mnist",
            "Fashion-MNIST: 60,000 train / 10,000 test 28x28 grayscale clothing images",
            "fashion-mnist",
            5000,
            1,
            28,
            10,
        ),
        DatasetInfo(
            "diverse-multimnist",
            "DiverseMultiMNIST: 36x36 canvases with one (1/6) or two overlapping MNIST digits, "
            "generated deterministically from MNIST",
            "mnist",
            5000,
            1,
            36,
            10,
        ),
        DatasetInfo(
            "expanded-mnist",
            "Expanded MNIST (Sabour et al. 2017): each MNIST digit at a random place on a 40x40 "
            "canvas, generated deterministically from MNIST",
            "mnist",
            5000,
            1,
            40,
            10,
        ),
        DatasetInfo(
            "smallnorb",
            "smallNORB: 24,300 train / 24,300 test stereo pairs of toys in 5 classes, 2x48x48",
            "none",
            2430,
            2,
            48,
            5,
        ),
        DatasetInfo(
            "smallnorb-azimuth",
            "smallNORB novel azimuths (Hinton et al. 2018): train 300-40 degrees, test 60-280",
            "none",
            810,
            2,
            48,
            5,
        ),
        DatasetInfo(
            "smallnorb-elevation",
            "smallNORB novel elevations (Hinton et al. 2018): train the 3 lowest, test the 6 "
            "higher",
            "none",
            810,
            2,
            48,
            5,
        ),
        DatasetInfo(
            "fashion-mnist-quickstart",
            "Fashion-MNIST class-balanced subset shipped inside capsctl (works offline)",
            "fashion-mnist",
            1000,
            1,
            28,
            10,
        ),
        DatasetInfo(
            "imagefolder:<path>",
            "Your own images: <path>/<train|test>/<class>/*.png|jpg, all the same size",
            "none",
            0,
            None,
            None,
            None,
        ),
    )
}

NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # True per-channel statistics of the CIFAR-10 training set (pixels scaled to [0, 1]).
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    # The std that much published CIFAR-10 code uses (a known slip); kept for reproductions.
    "cifar10-authors": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    # "none": mean 0 / std 1 for any number of channels (filled in by normalization_for).
    "none": ((), ()),
}

MNIST_CLASSES: list[str] = [str(i) for i in range(10)]

FASHION_MNIST_CLASSES: list[str] = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]

CIFAR10_CLASSES: list[str] = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]

# CIFAR-100 fine label names in label order (used when no `meta`/classes.txt is present).
CIFAR100_CLASSES: list[str] = [
    "apple",
    "aquarium_fish",
    "baby",
    "bear",
    "beaver",
    "bed",
    "bee",
    "beetle",
    "bicycle",
    "bottle",
    "bowl",
    "boy",
    "bridge",
    "bus",
    "butterfly",
    "camel",
    "can",
    "castle",
    "caterpillar",
    "cattle",
    "chair",
    "chimpanzee",
    "clock",
    "cloud",
    "cockroach",
    "couch",
    "crab",
    "crocodile",
    "cup",
    "dinosaur",
    "dolphin",
    "elephant",
    "flatfish",
    "forest",
    "fox",
    "girl",
    "hamster",
    "house",
    "kangaroo",
    "keyboard",
    "lamp",
    "lawn_mower",
    "leopard",
    "lion",
    "lizard",
    "lobster",
    "man",
    "maple_tree",
    "motorcycle",
    "mountain",
    "mouse",
    "mushroom",
    "oak_tree",
    "orange",
    "orchid",
    "otter",
    "palm_tree",
    "pear",
    "pickup_truck",
    "pine_tree",
    "plain",
    "plate",
    "poppy",
    "porcupine",
    "possum",
    "rabbit",
    "raccoon",
    "ray",
    "road",
    "rocket",
    "rose",
    "sea",
    "seal",
    "shark",
    "shrew",
    "skunk",
    "skyscraper",
    "snail",
    "snake",
    "spider",
    "squirrel",
    "streetcar",
    "sunflower",
    "sweet_pepper",
    "table",
    "tank",
    "telephone",
    "television",
    "tiger",
    "tractor",
    "train",
    "trout",
    "tulip",
    "turtle",
    "wardrobe",
    "whale",
    "willow_tree",
    "wolf",
    "woman",
    "worm",
]


def base_name(name: str) -> str:
    """Strip a ``[variant]`` suffix (``"cifar10[test-jpeg]"`` -> ``"cifar10"``)."""
    return name.split("[", 1)[0]


def dataset_info(name: str) -> DatasetInfo:
    """The :class:`DatasetInfo` of a dataset name (``imagefolder:...``, ``[variant]`` allowed)."""
    if name.startswith("imagefolder:"):
        return DATASETS["imagefolder:<path>"]
    info = DATASETS.get(base_name(name))
    if info is None or info.name == "imagefolder:<path>":
        known = ", ".join(DATASETS)
        raise DataError(f"unknown dataset {name!r}; choose one of: {known}")
    return info


def normalization_for(name: str, channels: int) -> tuple[list[float], list[float]]:
    """Mean and std lists for a normalization name, checked against ``channels``.

    ``name`` is a key of :data:`NORMALIZATION` (``"none"`` gives zeros/ones for any channel
    count); a dataset name (e.g. ``"fashion-mnist-quickstart"``, ``"cifar10[test-jpeg]"``)
    is also accepted and maps to that dataset's default normalization.
    """
    if channels < 1:
        raise DataError(f"normalization needs at least one channel, got {channels}")
    key = name
    if key not in NORMALIZATION:
        try:
            key = dataset_info(name).normalization
        except DataError:
            known = ", ".join(NORMALIZATION)
            raise DataError(f"unknown normalization {name!r}; choose one of: {known}") from None
    if key == "none":
        return [0.0] * channels, [1.0] * channels
    mean, std = NORMALIZATION[key]
    if len(mean) != channels:
        raise DataError(
            f"normalization {key!r} is for {len(mean)}-channel images but the data has "
            f"{channels} channel(s); pick a matching normalization or 'none'"
        )
    return list(mean), list(std)
