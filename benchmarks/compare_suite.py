"""The suite of ``benchmarks/compare.py``: its models with their data and run lengths, the precision modes, the paths.

``SUITE`` holds every model the benchmark knows (``DEFAULT_MODELS`` is what runs without ``--models``), ``smoke_spec``
shrinks an entry to seconds for ``--smoke``, and ``MODES`` gives each precision mode its label and the ``Trainer``
precision it runs under (``None``: the ``CoMPPrecision`` plugin, with the mode's ``fixed_plan`` where it has one, else
with the plan of its own ``CoMPSearch``, run with the mode's ``objective``). ``COMP_MODES`` are the searched CoMP modes,
in the order they are searched and trained; ``FIXED_PLAN_MODES`` the CoMP-plugin modes with a fixed plan (the one-line
type rules a user would write: no search); ``FIXED_POLICY_MODES`` the fixed policies CoMP is compared with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
IMG_DIR = ROOT / "docs" / "img"


@dataclass(frozen=True)
class ModelSpec:
    """One model of the suite, its data and its run lengths."""

    key: str
    title: str
    model: str  # class name in lightning_comp.zoo
    model_kwargs: dict[str, Any]
    data: str  # class name in lightning_comp.zoo
    data_kwargs: dict[str, Any]
    steps: int  # optimizer steps per mode in the interleaved run
    segment: int  # steps per turn
    val_every: int  # validate every this many steps (and at the end)
    val_batches: int  # validation batches per validation
    search_batches: int  # training batches per epoch in the search run (0: full epochs, nothing extrapolated)
    default_example: bool = False  # the model/data of ``python examples/train.py`` (the search-cost target)
    search_epochs: int = 0  # max_epochs of the search run (0: just warm-up + one trial); 20 = a real 20-epoch run
    search_overrides: dict[str, Any] = field(default_factory=dict)


def _default_example() -> dict[str, dict[str, Any]]:
    """Model and data keyword arguments of the default example, read from the shipped Hydra config tree."""
    from omegaconf import OmegaConf

    import lightning_comp

    conf = Path(lightning_comp.__file__).resolve().parent / "conf"
    cfg = OmegaConf.create({"model": OmegaConf.load(conf / "model" / "char_gpt.yaml"),
                            "data": OmegaConf.load(conf / "data" / "text.yaml")})
    out = {}
    for group in ("model", "data"):
        node = OmegaConf.to_container(cfg[group], resolve=True)
        assert isinstance(node, dict)
        out[group] = {str(k): v for k, v in node.items() if not str(k).startswith("_")}
    return out


_DEFAULT_EXAMPLE = _default_example()

SUITE: dict[str, ModelSpec] = {
    "cnn": ModelSpec(
        key="cnn", title="ConvNetBN (CNN + BatchNorm, 32-64-128 ch) on Shapes10 32x32, batch 128",
        model="ConvNetBN", model_kwargs={"width": 32, "depth": 3},
        data="ShapesDataModule", data_kwargs={"num_samples": 10000, "batch_size": 128},
        steps=60, segment=5, val_every=20, val_batches=4, search_batches=10,
    ),
    "gpt": ModelSpec(
        key="gpt", title="CharGPT on pydoc text bytes: the default example (python examples/train.py), model and data"
        " as configured in lightning_comp/conf/{model/char_gpt,data/text}.yaml",
        model="CharGPT", model_kwargs=_DEFAULT_EXAMPLE["model"],
        data="CharTextDataModule", data_kwargs=_DEFAULT_EXAMPLE["data"],
        steps=60, segment=5, val_every=15, val_batches=3, search_batches=0, default_example=True, search_epochs=20,
    ),
    "lstm": ModelSpec(
        key="lstm", title="CharLSTM (2-layer LSTM LM, h256, T128) on pydoc text, batch 32",
        model="CharLSTM", model_kwargs={"width": 256, "depth": 2},
        data="CharTextDataModule", data_kwargs={"seq_len": 128, "batch_size": 32},
        steps=64, segment=4, val_every=16, val_batches=3, search_batches=8,
    ),
    "mlp": ModelSpec(
        key="mlp", title="NarrowMLP (8 x Linear width 32: small operators) on MNIST-1D, batch 64",
        model="NarrowMLP", model_kwargs={"width": 32, "depth": 8},
        data="MNIST1DDataModule", data_kwargs={"num_samples": 4000, "batch_size": 64},
        steps=1000, segment=50, val_every=250, val_batches=8, search_batches=40,
    ),
    # Not in the default suite (``--models all`` or by name):
    "cnn1d": ModelSpec(
        key="cnn1d", title="Conv1DClassifier on MNIST-1D",
        model="Conv1DClassifier", model_kwargs={"width": 64, "depth": 3},
        data="MNIST1DDataModule", data_kwargs={"num_samples": 4000, "batch_size": 64},
        steps=1000, segment=50, val_every=250, val_batches=8, search_batches=40,
    ),
    "gru": ModelSpec(
        key="gru", title="GRUClassifier (2-layer GRU, h128) on MNIST-1D",
        model="GRUClassifier", model_kwargs={"width": 128, "depth": 2},
        data="MNIST1DDataModule", data_kwargs={"num_samples": 4000, "batch_size": 64},
        steps=80, segment=10, val_every=20, val_batches=4, search_batches=20,
    ),
    # Models nobody here wrote (optional members: their library is an extra, [hf] / [vision]):
    "hf_gpt2": ModelSpec(
        key="hf_gpt2", title="Hugging Face transformers GPT-2 (2 layers, 4 heads, 128 wide, randomly initialised) on"
        " pydoc text bytes, T128, batch 16",
        model="HFGPT2", model_kwargs={"width": 128, "depth": 2, "heads": 4, "block_size": 128},
        data="CharTextDataModule", data_kwargs={"seq_len": 128, "num_samples": 800, "batch_size": 16},
        steps=60, segment=5, val_every=15, val_batches=3, search_batches=20,
    ),
    "litgpt": ModelSpec(
        key="litgpt", title="litgpt GPT, LLaMA-style (2 layers, 4 heads / 2 KV groups, 128 wide, RMSNorm, SwiGLU, RoPE;"
        " randomly initialised) on pydoc text bytes, T128, batch 16",
        model="LitGPT", model_kwargs={"width": 128, "depth": 2, "heads": 4, "query_groups": 2, "block_size": 128},
        data="CharTextDataModule", data_kwargs={"seq_len": 128, "num_samples": 800, "batch_size": 16},
        steps=60, segment=5, val_every=15, val_batches=3, search_batches=20,
    ),
    "x_transformer": ModelSpec(
        key="x_transformer", title="x-transformers decoder (2 layers, 4 heads, 128 wide, rotary) on pydoc text bytes,"
        " T128, batch 16",
        model="XTransformerLM", model_kwargs={"width": 128, "depth": 2, "heads": 4, "block_size": 128},
        data="CharTextDataModule", data_kwargs={"seq_len": 128, "num_samples": 800, "batch_size": 16},
        steps=60, segment=5, val_every=15, val_batches=3, search_batches=20,
    ),
    "tv_resnet": ModelSpec(
        key="tv_resnet", title="torchvision ResNet-18 (randomly initialised) on Shapes10 32x32, batch 64",
        model="TorchvisionResNet", model_kwargs={"arch": "resnet18"},
        data="ShapesDataModule", data_kwargs={"num_samples": 4000, "batch_size": 64},
        steps=40, segment=5, val_every=20, val_batches=2, search_batches=10,
    ),
}
DEFAULT_MODELS = ("cnn", "gpt", "lstm", "mlp")
OPTIONAL_MODELS = {"hf_gpt2": "transformers", "litgpt": "litgpt", "x_transformer": "x_transformers",
                   "tv_resnet": "torchvision"}  # key -> the library it needs


def unavailable(key: str) -> str | None:
    """Why the suite member ``key`` cannot run here (its optional library does not import), or ``None``."""
    library = OPTIONAL_MODELS.get(key)
    if library is None:
        return None
    import importlib

    try:
        importlib.import_module(library)
    except Exception as error:  # noqa: BLE001 - a library built for another torch raises RuntimeError, not ImportError
        return f"{library} cannot be imported here ({type(error).__name__}: {str(error)[:100]})"
    return None

_SMOKE_SIZES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "cnn": ({"width": 8, "depth": 2}, {"num_samples": 400, "batch_size": 16, "image_size": 16}),
    "gpt": ({"width": 32, "depth": 1, "heads": 2, "block_size": 32}, {"seq_len": 32, "num_samples": 200,
                                                                       "batch_size": 8}),
    "lstm": ({"width": 32, "depth": 2}, {"seq_len": 32, "num_samples": 200, "batch_size": 8}),
    "mlp": ({"width": 16, "depth": 3}, {"num_samples": 400, "batch_size": 16}),
    "cnn1d": ({"width": 8, "depth": 2}, {"num_samples": 400, "batch_size": 16}),
    "gru": ({"width": 16, "depth": 1}, {"num_samples": 400, "batch_size": 16}),
    "hf_gpt2": ({"width": 32, "depth": 1, "heads": 2, "block_size": 32}, {"seq_len": 32, "num_samples": 200,
                                                                          "batch_size": 8}),
    "litgpt": ({"width": 32, "depth": 1, "heads": 2, "query_groups": 1, "block_size": 32},
               {"seq_len": 32, "num_samples": 200, "batch_size": 8}),
    "x_transformer": ({"width": 32, "depth": 1, "heads": 2, "block_size": 32}, {"seq_len": 32, "num_samples": 200,
                                                                                "batch_size": 8}),
    "tv_resnet": ({}, {"num_samples": 400, "batch_size": 16, "image_size": 32}),
}
_SMOKE_SEARCH = {"measurement": {"profile_steps": 1, "profile_warmup": 0}, "max_trials": 2}


def smoke_spec(spec: ModelSpec) -> ModelSpec:
    """The seconds-scale version of a suite entry (same model and data classes)."""
    model_kwargs, data_kwargs = _SMOKE_SIZES[spec.key]
    return replace(spec, model_kwargs={**spec.model_kwargs, **model_kwargs},
                   data_kwargs={**spec.data_kwargs, **data_kwargs}, steps=4, segment=2, val_every=2, val_batches=1,
                   search_batches=3, search_epochs=0, search_overrides=dict(_SMOKE_SEARCH))


@dataclass(frozen=True)
class Mode:
    """A precision mode of the comparison: its key, its label in tables and the Trainer precision it runs.

    A mode with ``trainer_precision`` ``None`` trains under the ``CoMPPrecision`` plugin: with ``fixed_plan``
    (``PrecisionPlan.from_dict(fixed_plan)``, no search) where given, else with the chosen plan of a ``CoMPSearch``
    run with ``objective``.
    """

    key: str
    label: str
    trainer_precision: str | None  # None: CoMPPrecision plugin
    objective: str | None = None  # searched CoMP modes: the CoMPSearch objective whose chosen plan the mode trains
    fixed_plan: dict[str, str] | None = None  # fixed-plan modes: the plan's {selector: precision} (no search)


MODES: dict[str, Mode] = {
    "fp32": Mode("fp32", "FP32 (32-true)", "32-true"),
    "bf16-mixed": Mode("bf16-mixed", "AMP (bf16-mixed)", "bf16-mixed"),
    "bf16-true": Mode("bf16-true", "BF16 (bf16-true)", "bf16-true"),
    "16-mixed": Mode("16-mixed", "AMP FP16 (16-mixed)", "16-mixed"),
    # The one-line type rule a user would write. Like bf16-true it runs wherever the device has BF16, native or
    # emulated (CoMPPrecision warns where emulated); unlike bf16-mixed, nothing here needs autocast's LSTM kernel.
    "type-linear": Mode("type-linear", 'Type rule {"type:Linear": "bf16"}', None, fixed_plan={"type:Linear": "bf16"}),
    "comp": Mode("comp", "CoMP (searched plan)", None, "throughput"),
    "comp-balanced": Mode("comp-balanced", "CoMP (balanced)", None, "balanced"),
    "comp-memory": Mode("comp-memory", "CoMP (memory)", None, "memory"),
}
COMP_MODES = tuple(key for key, mode in MODES.items() if mode.trainer_precision is None and mode.fixed_plan is None)
FIXED_PLAN_MODES = tuple(key for key, mode in MODES.items() if mode.fixed_plan is not None)
# The fixed policies a user could pick instead of a search ("CoMP vs the best fixed policy that converges").
FIXED_POLICY_MODES = ("fp32", "bf16-mixed", "bf16-true", *FIXED_PLAN_MODES)
AXIS_MODES = ("comp-balanced", "comp-memory")  # the CoMP modes that also lower saved-for-backward tensors
