# ruff: noqa: E402  (torch is imported after the Inductor cache directory is chosen, below)
"""Shared fixtures: seeds, fast Trainer settings, tiny models and data, an aten-level dtype recorder.

What the fixtures hand out lives in ``tests/helpers`` (tests import from there, never from this file). Everything is
small on purpose: the whole suite runs on 2 shared CPU cores.

Two tiers: ``pytest -m "not slow"`` is the inner loop (minutes); CI runs everything. A test is ``slow`` when it takes
more than about 1.5 s here, and every ``multiprocess`` test is (see ``pytest_collection_modifyitems``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.helpers.environment import inductor_cache_for_capability

# before torch is imported: Inductor fixes its cache directory the first time it looks it up
os.environ.update(inductor_cache_for_capability(dict(os.environ)))  # the suite run as an emulated class

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from tests.helpers.models import MixedNet, TinyMLP, regression_loader, token_loader
from tests.helpers.paths import REPO
from tests.helpers.recording import DtypeRecorder, count_forward_hooks, sqnr
from tests.helpers.warm_launch import stop_servers

SEED = 0

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # ``pytest -n N``: each worker gets its share of the cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


#: what a run of the suite may add to the repository's top folder (caches, the package's build metadata)
_REPO_LITTER_ALLOWED = (".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__", ".hypothesis", ".benchmarks")
_REPO_STASH = pytest.StashKey[set[str]]()


def _repo_entries() -> set[str]:
    return {entry.name for entry in REPO.iterdir()
            if entry.name not in _REPO_LITTER_ALLOWED and not entry.name.endswith(".egg-info")}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_REPO_STASH] = _repo_entries()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when a test left a file in the repository's top folder (a Trainer without ``default_root_dir``
    writes its logs, checkpoints and a search's ``plan.json`` into the working folder): tests write into their own
    temporary folders. Checked once, by the process that started the run (not by each xdist worker). Every process
    first stops the warm-start servers it started (``tests/helpers/warm_launch.py``)."""
    stop_servers()
    if hasattr(session.config, "workerinput") or _REPO_STASH not in session.config.stash:
        return
    left = sorted(_repo_entries() - session.config.stash[_REPO_STASH])
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"tests left {left} in the repository ({REPO}): write into tmp_path (a Trainer's default_root_dir)"
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects: a test marked slow here is left out of the fast tier
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every ``multiprocess`` test ``slow`` too (the fast tier, ``-m "not slow"``, starts no worker processes)
    and put them in one ``xdist_group`` (under ``pytest -n 2 --dist loadgroup`` they run one at a time, each already
    using both cores, beside the other worker's one-process tests); skip ``needs_native_bf16`` tests (their point is
    speed) where this CPU emulates BF16, saying so."""
    from lightning_comp.devices import device_class

    for item in items:
        if "multiprocess" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("multiprocess"))
            if "slow" not in item.keywords:
                item.add_marker(pytest.mark.slow)
    cpu = device_class("cpu")
    if cpu.is_native("bf16"):
        return
    skip = pytest.mark.skip(reason=f"BF16 is emulated on this CPU ({cpu.describe()}): the speed-up this test is"
                                   " about does not exist here")
    for item in items:
        if "needs_native_bf16" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything() -> Iterator[None]:
    """Every test starts from the same RNG state (torch, python), so models and data are reproducible."""
    random.seed(SEED)
    torch.manual_seed(SEED)
    yield


@pytest.fixture
def seed() -> int:
    """The seed the RNGs were set to before the test (re-seed with it to rebuild an identical model)."""
    return SEED


@pytest.fixture
def fast_trainer_kwargs(tmp_path: Path) -> dict[str, Any]:
    """Trainer arguments for quick CPU runs without side effects (no logger, bar, summary or checkpoints; what a
    callback writes to the Trainer's log folder, as a search writes ``plan.json``, goes to the test's own folder).

    Add ``devices``, ``max_steps``... at the call site: ``pl.Trainer(max_steps=2, **kw)``.
    """
    return dict(
        accelerator="cpu",
        default_root_dir=str(tmp_path),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


@pytest.fixture
def make_mlp() -> Callable[..., TinyMLP]:
    """Factory of :class:`TinyMLP` (keyword arguments go to its constructor)."""
    return TinyMLP


@pytest.fixture
def make_mixed() -> Callable[..., MixedNet]:
    """Factory of :class:`MixedNet` (keyword arguments go to its constructor)."""
    return MixedNet


@pytest.fixture
def make_regression_loader() -> Callable[..., DataLoader]:
    """Factory of a deterministic regression DataLoader (x: (n, d_in), y: (n, 1))."""
    return regression_loader


@pytest.fixture
def make_token_loader() -> Callable[..., DataLoader]:
    """Factory of a deterministic DataLoader of (tokens (n, MixedNet.SEQ), labels (n,)) for :class:`MixedNet`."""
    return token_loader


@pytest.fixture
def dtype_recorder() -> Iterator[DtypeRecorder]:
    """A fresh :class:`DtypeRecorder`; its hooks are removed after the test."""
    recorder = DtypeRecorder()
    yield recorder
    recorder.detach()


@pytest.fixture
def sqnr_db() -> Callable[[torch.Tensor, torch.Tensor], float]:
    """:func:`sqnr`: ``20 log10(||ref|| / ||ref - out||)`` in dB."""
    return sqnr


@pytest.fixture
def hook_count() -> Callable[[nn.Module], int]:
    """:func:`count_forward_hooks`."""
    return count_forward_hooks


@pytest.fixture(scope="session")
def plain_wide_mlp(tmp_path_factory: pytest.TempPathFactory) -> pl.Trainer:
    """A plain FP32 run of ``WideMLP`` for 4 epochs: the reference the search tests compare with."""
    from tests.helpers.search_models import WideMLP, loaders, search_trainer

    pl.seed_everything(0)
    trainer = search_trainer(tmp_path_factory.mktemp("plain_fp32"), [], max_epochs=4)
    train, val = loaders()
    trainer.fit(WideMLP(), train, val)
    return trainer
