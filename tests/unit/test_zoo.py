"""Tests of lightning_comp.zoo (data, models) and of the shipped Hydra config tree. No Trainer runs here."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

import lightning_comp.conf
from lightning_comp import SearchConfig
from lightning_comp.search.config import MEASUREMENT_PRESETS
from lightning_comp.zoo import (
    CLASS_NAMES,
    VOCAB_SIZE,
    CharGPT,
    CharLSTM,
    CharTextDataModule,
    Conv1DClassifier,
    ConvNetBN,
    GRUClassifier,
    MNIST1DDataModule,
    NarrowMLP,
    ShapesDataModule,
    load_corpus,
    load_mnist1d,
    make_shapes,
)
from lightning_comp.zoo.images import collate_images
from lightning_comp.zoo.runner import check_compatible
from tests.helpers.paths import REPO

CONF_DIR = REPO / "lightning_comp" / "conf"
REPO_CONF_DIR = REPO / "conf"
PRECISIONS = ("fp32", "bf16-mixed", "16-mixed", "bf16-true", "comp")
MODELS = {"cnn1d": "mnist1d", "gru": "mnist1d", "narrow_mlp": "mnist1d", "char_lstm": "text", "char_gpt": "text"}
MODELS["convnet_bn"] = "shapes"
# libraries' own models, behind extras (integration/test_third_party_models.py, integration/test_examples.py)
THIRD_PARTY_MODELS = {"hf_gpt2": "text", "litgpt": "text", "litgpt_moe": "text", "x_transformer": "text",
                      "tv_resnet": "shapes"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Small ops stall badly when the 2 shared cores are oversubscribed; one thread keeps the tests quick."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------- data


def test_mnist1d_is_generated_deterministically_without_touching_global_rng() -> None:
    random.seed(123)
    np.random.seed(123)
    before = (random.random(), np.random.rand())
    random.seed(123)
    np.random.seed(123)
    x, y = load_mnist1d(200, 7)
    assert (random.random(), np.random.rand()) == before
    assert x.shape == (200, 40) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and set(y.tolist()) == set(range(10))
    x2, _ = load_mnist1d.__wrapped__(200, 7)
    assert torch.equal(x, x2)


def test_mnist1d_rejects_bad_num_samples() -> None:
    with pytest.raises(ValueError, match="num_samples must be an int >= 10, got 3"):
        MNIST1DDataModule(num_samples=3)


def test_mnist1d_datamodule_splits_and_batches() -> None:
    dm = MNIST1DDataModule(num_samples=200, batch_size=16, val_fraction=0.25)
    dm.setup("fit")
    assert len(dm.train_set) == 150 and len(dm.val_set) == 50  # type: ignore[arg-type]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 40) and y.shape == (16,)
    assert len(dm.train_dataloader()) == 150 // 16  # drop_last for training


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be a positive int, got 0"),
        ({"val_fraction": 1.5}, r"val_fraction must be a number in the open interval \(0, 1\), got 1.5"),
        ({"num_workers": -1}, "num_workers must be an int >= 0, got -1"),
    ],
)
def test_datamodule_errors_name_the_bad_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MNIST1DDataModule(num_samples=100, **kwargs)


def test_too_small_training_split_is_explained() -> None:
    dm = MNIST1DDataModule(num_samples=20, batch_size=64)
    with pytest.raises(ValueError, match="fewer than batch_size=64"):
        dm.setup("fit")


def test_pydoc_corpus_ships_with_python() -> None:
    data = load_corpus("pydoc_topics")
    assert isinstance(data, bytes) and len(data) > 100_000
    assert b"for" in data and b"class" in data


def test_corpus_from_file_and_bad_corpus(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("hello world, " * 50, encoding="utf-8")
    dm = CharTextDataModule(seq_len=8, batch_size=4, corpus=str(path))
    dm.setup("fit")
    x, y = next(iter(dm.val_dataloader()))
    assert bytes(x[0].tolist()).decode() in ("hello world, " * 3)
    with pytest.raises(ValueError, match=r"corpus must be one of \['pydoc_topics'\] or the path of a text file"):
        load_corpus("no_such_corpus")


def test_text_windows_are_shifted_by_one_and_validation_is_the_tail() -> None:
    dm = CharTextDataModule(seq_len=64, num_samples=100, batch_size=8, val_fraction=0.1)
    dm.setup("fit")
    x, y = dm.build()
    assert x.shape == (100, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y[:-1, -1], x[1:, 0])
    assert int(x.max()) < VOCAB_SIZE
    val_x, _ = dm.val_set[0]  # type: ignore[index]
    assert torch.equal(val_x, x[90])


def test_shapes_are_balanced_deterministic_and_leave_global_rng_alone() -> None:
    torch.manual_seed(5)
    expected_next = torch.rand(1)
    torch.manual_seed(5)
    x, y = make_shapes(300, 16, 3, 0.1)
    assert torch.equal(torch.rand(1), expected_next)
    assert x.shape == (300, 3, 16, 16) and x.dtype == torch.uint8
    assert torch.bincount(y, minlength=10).tolist() == [30] * 10 and len(CLASS_NAMES) == 10
    x2, y2 = make_shapes.__wrapped__(300, 16, 3, 0.1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = make_shapes.__wrapped__(300, 16, 4, 0.1)
    assert not torch.equal(x, x3)
    # classes differ on average (a generator bug would make them identical)
    means = torch.stack([x[y == c].float().std(dim=(0, 1)).mean() for c in range(10)])
    assert means.std() > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"image_size": 4}, "image_size must be an int >= 8, got 4"), ({"noise": -1.0}, "noise must be a number >= 0")],
)
def test_shapes_errors_name_the_bad_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_shapes(10, **{"image_size": 16, "noise": 0.1, **kwargs})


def test_shapes_batches_are_normalised_float() -> None:
    dm = ShapesDataModule(num_samples=64, batch_size=16, image_size=16)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.dtype == torch.float32 and x.shape == (16, 3, 16, 16) and y.dtype == torch.int64
    assert float(x.min()) >= -2.5 and float(x.max()) <= 2.5
    images, labels = collate_images([(torch.full((3, 8, 8), 255, dtype=torch.uint8), torch.tensor(1))])
    assert torch.allclose(images, torch.full_like(images, 2.0)) and labels.tolist() == [1]


# --------------------------------------------------------------------------------------------------------- models


def _tiny_models() -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB_SIZE, (2, 16))
    signal, labels = torch.randn(4, 40), torch.randint(0, 10, (4,))
    return {
        "cnn1d": (Conv1DClassifier(width=8, depth=2), signal, labels),
        "gru": (GRUClassifier(width=8, depth=2), signal, labels),
        "narrow_mlp": (NarrowMLP(width=8, depth=3), signal, labels),
        "char_lstm": (CharLSTM(width=8, depth=2, embed_dim=8), tokens, tokens),
        "char_gpt": (CharGPT(width=16, depth=2, heads=2, block_size=16), tokens, tokens),
        "convnet_bn": (ConvNetBN(width=4, depth=2), torch.randn(4, 3, 16, 16), labels),
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_models_train_one_step_and_expose_their_operators(name: str) -> None:
    model, x, y = _tiny_models()[name]
    logits = model(x)
    expected = (*y.shape, VOCAB_SIZE) if y.dim() == 2 else (len(y), 10)
    assert logits.shape == expected
    loss = model.loss(logits, y)
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    assert all(p.grad is not None for p in model.parameters())
    kinds = {type(m) for _, m in model.named_modules()}
    assert nn.Linear in kinds or nn.Conv1d in kinds
    for value in model.hparams.values():  # what reaches a checkpoint must be plain Python
        assert not isinstance(value, (DictConfig, ListConfig))


def test_model_operators_are_modules() -> None:
    gpt = CharGPT(width=16, depth=1, heads=2, block_size=8)
    names = {name for name, _ in gpt.named_modules()}
    assert {"blocks.0.attn.qkv", "blocks.0.attn.attn", "blocks.0.attn.proj", "blocks.0.mlp.act", "head"} <= names
    convnet = ConvNetBN(width=4, depth=1)
    assert any(isinstance(m, nn.BatchNorm2d) for m in convnet.modules())
    lstm = CharLSTM(width=8, depth=2, embed_dim=4)
    assert lstm.lstm.num_layers == 2


def test_gpt_is_causal_and_checks_its_arguments() -> None:
    gpt = CharGPT(width=16, depth=2, heads=4, block_size=8).eval()
    x = torch.randint(0, VOCAB_SIZE, (1, 8))
    changed = x.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % VOCAB_SIZE
    assert torch.allclose(gpt(x)[:, :5], gpt(changed)[:, :5], atol=1e-6)
    with pytest.raises(ValueError, match="sequence length 9 exceeds block_size=8"):
        gpt(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="heads must be a positive divisor of the width 16, got heads=3"):
        CharGPT(width=16, heads=3)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: Conv1DClassifier(width=0), "width must be a positive int, got 0"),
        (lambda: Conv1DClassifier(kernel_size=4), "kernel_size must be odd, got 4"),
        (lambda: CharLSTM(depth=-1), "depth must be a positive int, got -1"),
        (lambda: GRUClassifier(dropout=1.0), r"dropout must be a number in \[0, 1\), got 1.0"),
        (lambda: NarrowMLP(lr=0), "lr must be a number > 0, got 0"),
    ],
)
def test_model_errors_name_the_bad_value(factory, message: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        factory()


def test_incompatible_model_and_data_are_explained() -> None:
    with pytest.raises(ValueError, match="model CharGPT takes data of kind \\['tokens'\\].*choose data=text"):
        check_compatible(CharGPT(width=8, depth=1, heads=2), MNIST1DDataModule())
    check_compatible(ConvNetBN(width=4, depth=1), ShapesDataModule())


# ------------------------------------------------------------------------------------------------- config tree


def test_config_tree_has_every_group_and_option() -> None:
    options = {group: {p.stem for p in (CONF_DIR / group).glob("*.yaml")} for group in ("precision", "model", "data")}
    assert options["precision"] == set(PRECISIONS)
    assert options["model"] == set(MODELS) | set(THIRD_PARTY_MODELS)
    assert options["data"] == set(MODELS.values()) | set(THIRD_PARTY_MODELS.values())
    assert (CONF_DIR / "trainer" / "default.yaml").is_file() and (CONF_DIR / "size" / "tiny.yaml").is_file()
    assert (CONF_DIR / "__init__.py").is_file()  # pkg://lightning_comp.conf needs an importable package


def test_default_configuration_is_comp_on_char_gpt() -> None:
    with initialize_config_dir(config_dir=str(REPO_CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["output_dir=/tmp/unused"], return_hydra_config=True)
    assert cfg.hydra.runtime.choices.precision == "comp"
    assert cfg.model._target_ == "lightning_comp.zoo.CharGPT" and cfg.data._target_.endswith("CharTextDataModule")
    assert cfg.seed == 0 and cfg.ckpt_path is None
    assert cfg.trainer.precision is None  # a plugin plus a Trainer precision is a ValueError in Lightning
    assert cfg.trainer.plugins[0]._target_ == "lightning_comp.CoMPPrecision"
    assert cfg.precision.callbacks.comp_search._target_ == "lightning_comp.CoMPSearch"
    assert cfg.model.block_size == cfg.data.seq_len
    assert cfg.callbacks.checkpoint.save_last is True


@pytest.mark.parametrize("precision", PRECISIONS)
def test_precision_options_wire_the_trainer(precision: str) -> None:
    with initialize_config_module(config_module="lightning_comp.conf", version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/tmp/unused", f"precision={precision}"])
    if precision == "comp":
        assert cfg.trainer.precision is None and len(cfg.trainer.plugins) == 1
        search = cfg.precision.callbacks.comp_search  # SearchConfig's fields and Python's defaults (ConfigStore)
        assert set(search) == {"_target_", *SearchConfig.setting_names()} and search.tolerance == SearchConfig.tolerance
        assert dict(search.measurement) == asdict(MEASUREMENT_PRESETS["default"])
        shipped = OmegaConf.load(Path(lightning_comp.conf.__file__).parent / "precision" / "comp.yaml")
        assert dict(shipped.callbacks.comp_search) == {"trial_batches": 0.25} == {"trial_batches": search.trial_batches}
    else:
        expected = {"fp32": "32-true"}.get(precision, precision)
        assert cfg.trainer.precision == expected and cfg.trainer.plugins is None and not cfg.precision.callbacks


def test_the_search_node_instantiates_as_hydra_hands_it_over() -> None:
    """A user's own app may instantiate the node without ``_convert_``: its lists and mappings arrive as OmegaConf
    containers, its choices as enum members; the overrides a user writes on the command line reach the settings."""
    node = "precision.callbacks.comp_search"
    overrides = ["output_dir=/x", "precision=comp", f"{node}.objective=memory", f"{node}.include=[head]",
                 f"{node}.measurement.timing=cpu", f"{node}.include_dimensions={{saved: [body.0]}}",
                 f"{node}.precisions.state=off"]
    with initialize_config_module(config_module="lightning_comp.conf", version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    config = instantiate(cfg.precision.callbacks.comp_search).config
    assert config.objective.value == "memory" and config.include == ("head",) and config.measurement.timing == "cpu"
    assert config.include_dimensions == {"saved": ["body.0"]} and config.precisions["state"] == "off"
    assert config.trial_batches == 0.25  # the app's one override


def test_comp_accepts_a_fixed_plan_from_the_command_line() -> None:
    with initialize_config_module(config_module="lightning_comp.conf", version_base="1.3"):
        cfg = compose("train", overrides=["output_dir=/x", "precision.plan=/runs/a/plan.json"])
    assert cfg.trainer.plugins[0].plan == "/runs/a/plan.json"


def test_size_tiny_shrinks_every_pair() -> None:
    with initialize_config_module(config_module="lightning_comp.conf", version_base="1.3"):
        for model, data in MODELS.items():
            cfg = compose("train", overrides=["output_dir=/x", "size=tiny", f"model={model}", f"data={data}"])
            assert cfg.model.width == 16 and cfg.data.num_samples == 320 and cfg.trainer.max_epochs == 1


def test_a_users_own_app_can_reuse_the_shipped_groups(tmp_path: Path) -> None:
    (tmp_path / "my_app.yaml").write_text(
        "defaults:\n  - precision: comp\n  - _self_\nhydra:\n  searchpath:\n    - pkg://lightning_comp.conf\n"
        "trainer:\n  _target_: lightning.pytorch.Trainer\n  precision: ${precision.trainer_precision}\n"
        "  plugins: ${precision.plugins}\n"
    )
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        cfg = compose("my_app")
        assert cfg.trainer.precision is None and cfg.trainer.plugins[0]._target_ == "lightning_comp.CoMPPrecision"
        cfg = compose("my_app", overrides=["precision=bf16-mixed"])
        assert cfg.trainer.precision == "bf16-mixed"


def test_every_yaml_of_the_tree_is_package_data() -> None:
    pyproject = (CONF_DIR.parents[1] / "pyproject.toml").read_text()
    assert '"conf/**/*.yaml"' in pyproject
    assert len(list(CONF_DIR.glob("**/*.yaml"))) >= 1 + len(PRECISIONS) + len(MODELS) + 3 + 2
