"""A procedural 10-class RGB image set ("Shapes10"), generated deterministically in memory.

Why a generator and not a real photo set: no image set large enough for training ships inside the packages this project
depends on (matplotlib's sample data holds a handful of pictures; torchvision and scikit-learn are not dependencies, and
their sets are downloaded or tiny 8x8 grey digits), and nothing may be downloaded. A generator gives CIFAR-shaped input
(``3x32x32`` by default, any size on request) of any number of examples, reproducible bit for bit from a seed, and a
task that needs real convolutional features: five shape classes that differ only in outline (under random position,
size, rotation, colours and noise) and five texture classes that differ in orientation or layout of a periodic pattern.
Foreground and background colours are drawn independently, so some examples have poor contrast; with pixel noise this
keeps validation accuracy below 100 % for small models and short training.

Classes: 0 disk, 1 ring, 2 square, 3 triangle, 4 cross, 5 horizontal stripes, 6 vertical stripes, 7 diagonal stripes,
8 checkerboard, 9 dots.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch
from torch.utils.data import Dataset, TensorDataset

from lightning_comp.errors import ConfigError
from lightning_comp.zoo.data import InMemoryDataModule, check_positive_int

__all__ = ["CLASS_NAMES", "ShapesDataModule", "make_shapes"]

CLASS_NAMES: tuple[str, ...] = (
    "disk",
    "ring",
    "square",
    "triangle",
    "cross",
    "hstripes",
    "vstripes",
    "dstripes",
    "checker",
    "dots",
)
_MEAN, _STD = 0.5, 0.25
_CHUNK = 2048


def _shape_masks(label: torch.Tensor, u: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Foreground masks for the shape classes 0-4 in rotated, centred coordinates ``(u, v)`` of radius ``r``."""
    rad = torch.sqrt(u * u + v * v)
    width = 0.35 * r
    masks = torch.stack(
        [
            rad < r,  # disk
            (rad - 0.75 * r).abs() < 0.25 * r,  # ring
            torch.maximum(u.abs(), v.abs()) < 0.8 * r,  # square
            (v < 0.5 * r) & (v > -r + 1.732 * u.abs()),  # triangle (apex up before rotation)
            ((u.abs() < width) & (v.abs() < r)) | ((v.abs() < width) & (u.abs() < r)),  # cross
        ]
    )
    return masks.gather(0, label.clamp(max=4).view(1, -1, 1, 1).expand(1, *u.shape)).squeeze(0)


def _texture_masks(
    label: torch.Tensor, x: torch.Tensor, y: torch.Tensor, freq: torch.Tensor, phase: torch.Tensor
) -> torch.Tensor:
    """Foreground masks for the texture classes 5-9 in image coordinates ``(x, y)`` in [-1, 1]."""
    w = 2 * math.pi * freq
    sx, sy = torch.sin(w * x + phase), torch.sin(w * y + phase)
    masks = torch.stack(
        [
            sy > 0,  # horizontal stripes
            sx > 0,  # vertical stripes
            torch.sin(w * (x + y) / math.sqrt(2) + phase) > 0,  # diagonal stripes
            (sx * sy) > 0,  # checkerboard
            (sx > 0.5) & (sy > 0.5),  # dots
        ]
    )
    return masks.gather(0, (label - 5).clamp(min=0).view(1, -1, 1, 1).expand(1, *x.shape)).squeeze(0)


def _render(label: torch.Tensor, size: int, noise: float, gen: torch.Generator) -> torch.Tensor:
    """Render one chunk of images with the given labels as float ``[n, 3, size, size]`` in [0, 1]."""
    n = label.numel()

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen)

    coords = torch.linspace(-1.0, 1.0, size)
    y, x = torch.meshgrid(coords, coords, indexing="ij")
    x, y = x.expand(n, size, size), y.expand(n, size, size)
    # shapes: random centre, radius and rotation
    r = (0.35 + 0.35 * rand(n)).view(n, 1, 1)
    cx = ((rand(n) * 2 - 1) * (0.9 - r.view(n))).view(n, 1, 1)
    cy = ((rand(n) * 2 - 1) * (0.9 - r.view(n))).view(n, 1, 1)
    angle = (rand(n) * 2 * math.pi).view(n, 1, 1)
    cos, sin = torch.cos(angle), torch.sin(angle)
    u = cos * (x - cx) + sin * (y - cy)
    v = -sin * (x - cx) + cos * (y - cy)
    shape = _shape_masks(label, u, v, r)
    # textures: random frequency and phase, orientation jittered by up to +-10 degrees
    freq = (1.5 + 2.5 * rand(n)).view(n, 1, 1)
    phase = (rand(n) * 2 * math.pi).view(n, 1, 1)
    jitter = ((rand(n) * 2 - 1) * math.radians(10)).view(n, 1, 1)
    tx = torch.cos(jitter) * x + torch.sin(jitter) * y
    ty = -torch.sin(jitter) * x + torch.cos(jitter) * y
    texture = _texture_masks(label, tx, ty, freq, phase)
    mask = torch.where((label < 5).view(n, 1, 1), shape, texture).unsqueeze(1).float()
    background, foreground = rand(n, 3, 1, 1), rand(n, 3, 1, 1)
    image = background * (1 - mask) + foreground * mask
    image = image + noise * torch.randn(n, 3, size, size, generator=gen)
    return image.clamp_(0.0, 1.0)


@functools.lru_cache(maxsize=4)
def make_shapes(
    num_samples: int = 10000, image_size: int = 32, seed: int = 0, noise: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate the Shapes10 image set (cached in memory per argument tuple).

    Labels cycle through the ten classes and are then shuffled, so classes are balanced to within one example. The
    result depends only on the arguments (a private ``torch.Generator`` is used; the global RNG is untouched).

    Args:
        num_samples: Number of images.
        image_size: Height and width in pixels (>= 8).
        seed: Seed of the private generator.
        noise: Standard deviation of the Gaussian pixel noise (pixel values lie in [0, 1]).

    Returns:
        ``(x, y)``: ``x`` is ``uint8[N, 3, S, S]`` (8-bit like real images, a quarter of the memory of float32),
        ``y`` is ``int64[N]`` in 0..9.

    Raises:
        ConfigError: If an argument is out of range (the message names it).
    """
    check_positive_int("num_samples", num_samples)
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
        raise ConfigError(f"image_size must be an int >= 8, got {image_size!r}")
    if not isinstance(noise, (int, float)) or noise < 0:
        raise ConfigError(f"noise must be a number >= 0, got {noise!r}")
    gen = torch.Generator().manual_seed(seed)
    labels = (torch.arange(num_samples) % len(CLASS_NAMES))[torch.randperm(num_samples, generator=gen)]
    chunks = [
        _render(labels[i : i + _CHUNK], image_size, float(noise), gen).mul_(255).round_().to(torch.uint8)
        for i in range(0, num_samples, _CHUNK)
    ]
    return torch.cat(chunks), labels


def collate_images(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``uint8`` images into a normalised ``float32`` batch (about zero mean, unit-ish scale).

    Conversion happens here, in the ``DataLoader``, so that the batch is already floating point when Lightning's
    precision plugin converts inputs (``bf16-true`` casts float inputs only, and does so before
    ``on_after_batch_transfer``).
    """
    images = torch.stack([item[0] for item in batch]).float().div_(255.0).sub_(_MEAN).div_(_STD)
    labels = torch.stack([item[1] for item in batch])
    return images, labels


class ShapesDataModule(InMemoryDataModule):
    """Shapes10: procedurally generated RGB images of 5 shapes and 5 textures (see the module docstring).

    A batch is ``(x: float32[B, 3, S, S], y: int64[B])``. 10 000 images of 32x32 take about a second to generate.

    Args:
        num_samples: Images before the split.
        batch_size: Images per batch.
        val_fraction: Held-out part for validation.
        image_size: Height and width in pixels.
        noise: Pixel-noise standard deviation.
        seed: Seed of the generator (fixed per data set, independent of the training seed).
        num_workers: ``DataLoader`` workers.
    """

    kind: ClassVar[str] = "image"
    num_classes: ClassVar[int] = len(CLASS_NAMES)

    def __init__(
        self,
        num_samples: int = 10000,
        batch_size: int = 128,
        val_fraction: float = 0.2,
        image_size: int = 32,
        noise: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, val_fraction=val_fraction, num_workers=num_workers)
        self.num_samples = check_positive_int("num_samples", num_samples)
        self.image_size = image_size
        self.noise = noise
        self.seed = seed
        self.save_hyperparameters()

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the cached ``uint8`` images and their labels."""
        return make_shapes(self.num_samples, self.image_size, self.seed, self.noise)

    def make_dataset(self, x: torch.Tensor, y: torch.Tensor) -> Dataset[Any]:
        """Keep the images as ``uint8``; :func:`collate_images` converts each batch."""
        return TensorDataset(x, y)

    def collate_fn(self) -> Any:
        """Return :func:`collate_images`."""
        return collate_images
