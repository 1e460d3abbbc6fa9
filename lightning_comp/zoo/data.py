"""In-memory LightningDataModules of the zoo, and MNIST-1D.

Every data module here builds its whole data set in memory from something already on the machine (a generator or a
file shipped with Python). Nothing is downloaded. Each module has:

* ``kind``: what a batch holds. ``"signal"`` is ``(x: float[B, L], y: long[B])``. ``"tokens"`` is
  ``(x: long[B, T], y: long[B, T])``. ``"image"`` is ``(x: float[B, 3, H, W], y: long[B])``. Models state the kinds
  they accept (see :mod:`lightning_comp.zoo.models`).
* the same size knobs, so that one Hydra option (``size=tiny``) can shrink any of them: ``num_samples`` (examples
  before the train/validation split) and ``batch_size``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any, ClassVar

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_comp.errors import ConfigError, UsageError

__all__ = ["DATA_KINDS", "InMemoryDataModule", "MNIST1DDataModule", "load_mnist1d"]

DATA_KINDS: tuple[str, ...] = ("signal", "tokens", "image")


def check_positive_int(name: str, value: Any) -> int:
    """Return ``value`` if it is a positive ``int``, else raise a ``ConfigError`` that names it.

    Args:
        name: The argument's name, used in the message.
        value: The value to check.

    Raises:
        ConfigError: If ``value`` is not an ``int`` (``bool`` excluded) greater than zero.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def check_fraction(name: str, value: Any) -> float:
    """Return ``value`` as a float if it lies strictly between 0 and 1, else raise a ``ConfigError`` that names it.

    Raises:
        ConfigError: If ``value`` is not a number in the open interval (0, 1).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < float(value) < 1.0:
        raise ConfigError(f"{name} must be a number in the open interval (0, 1), got {value!r}")
    return float(value)


class InMemoryDataModule(pl.LightningDataModule):
    """Base class: a data set held in memory as tensors, split into train and validation parts once.

    Subclasses implement :meth:`build`, which returns the whole data set. The last ``val_fraction`` of it becomes the
    validation set (the generators shuffle their examples, and for text the tail of the corpus is held out).

    Under DDP, Lightning swaps the samplers for ``DistributedSampler``s itself. Training batches use ``drop_last=True``,
    so every step has the same shape, which keeps per-batch timings comparable.

    Args:
        batch_size: Examples per training and validation batch.
        val_fraction: Part of the data set held out for validation, in (0, 1).
        num_workers: ``DataLoader`` worker processes. 0 (the default) is right for these small in-memory sets.
    """

    kind: ClassVar[str] = ""

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, num_workers: int = 0) -> None:
        super().__init__()
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.val_fraction = check_fraction("val_fraction", val_fraction)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"num_workers must be an int >= 0, got {num_workers!r}")
        self.num_workers = num_workers
        self.train_set: Dataset[Any] | None = None
        self.val_set: Dataset[Any] | None = None

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the whole data set as ``(inputs, targets)``, first dimension = examples."""
        raise NotImplementedError

    def make_dataset(self, x: torch.Tensor, y: torch.Tensor) -> Dataset[Any]:
        """Wrap one split in a ``Dataset``. Override to store a compact form (see the image module)."""
        return TensorDataset(x, y)

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        """Return the ``DataLoader`` collate function; ``None`` means PyTorch's default."""
        return None

    def setup(self, stage: str | None = None) -> None:
        """Build the data set and split it (only once; later calls are no-ops)."""
        if self.train_set is not None:
            return
        x, y = self.build()
        n_val = max(1, int(round(len(x) * self.val_fraction)))
        if len(x) - n_val < self.batch_size:
            raise ConfigError(
                f"{type(self).__name__}: the training split has {len(x) - n_val} examples, fewer than "
                f"batch_size={self.batch_size}; raise num_samples or lower batch_size"
            )
        self.train_set = self.make_dataset(x[:-n_val], y[:-n_val])
        self.val_set = self.make_dataset(x[-n_val:], y[-n_val:])

    def _loader(self, dataset: Dataset[Any] | None, train: bool) -> DataLoader[Any]:
        if dataset is None:
            raise UsageError(f"{type(self).__name__}.setup() must run before asking for a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=self.collate_fn(),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        """Shuffled training batches of ``batch_size`` (the last partial batch is dropped)."""
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader[Any]:
        """Validation batches in a fixed order."""
        return self._loader(self.val_set, train=False)


@functools.lru_cache(maxsize=4)
def load_mnist1d(num_samples: int = 4000, seed: int = 42) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate the MNIST-1D data set locally (cached in memory per ``(num_samples, seed)``).

    Uses ``mnist1d.data.make_dataset`` with the package's default arguments, which builds the examples from ten
    templates of length 12 by padding, shearing, scaling, shifting and adding correlated and white noise; it never
    downloads anything. ``make_dataset`` reseeds Python's and NumPy's global generators; their states are restored here
    afterwards so that loading data does not change a seeded run's randomness.

    Args:
        num_samples: Examples to generate, rounded down to a multiple of 10 (one tenth per digit).
        seed: The generator's seed (42 is the package's published one).

    Returns:
        ``(x, y)``: ``x`` is ``float32[N, 40]`` (zero mean, unit standard deviation), ``y`` is ``int64[N]`` in 0..9.

    Raises:
        ConfigError: If ``num_samples`` is not an int >= 10.
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 10:
        raise ConfigError(f"num_samples must be an int >= 10 (one example per class at least), got {num_samples!r}")
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    args.seed = seed
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    x = np.concatenate([data["x"], data["x_test"]]).astype(np.float32)
    y = np.concatenate([data["y"], data["y_test"]]).astype(np.int64)
    return torch.from_numpy(x), torch.from_numpy(y)


class MNIST1DDataModule(InMemoryDataModule):
    """MNIST-1D (Greydanus 2020): 10-class classification of length-40 1-D signals, generated on the fly.

    A batch is ``(x: float32[B, 40], y: int64[B])``. 4000 examples take about 1-2 s to generate on one core.

    Args:
        num_samples: Examples before the split (rounded down to a multiple of 10).
        batch_size: Examples per batch.
        val_fraction: Held-out part for validation.
        seed: Seed of the generator (fixed per data set, independent of the training seed).
        num_workers: ``DataLoader`` workers.
    """

    kind: ClassVar[str] = "signal"
    length: ClassVar[int] = 40
    num_classes: ClassVar[int] = 10

    def __init__(
        self,
        num_samples: int = 4000,
        batch_size: int = 64,
        val_fraction: float = 0.2,
        seed: int = 42,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, val_fraction=val_fraction, num_workers=num_workers)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 10:
            raise ConfigError(f"num_samples must be an int >= 10, got {num_samples!r}")
        self.num_samples = num_samples
        self.seed = seed
        self.save_hyperparameters()

    def build(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the cached MNIST-1D examples."""
        return load_mnist1d(self.num_samples, self.seed)
