"""Run one training job from a composed Hydra config (the body of ``examples/train.py``, reusable by benchmarks).

The config is the one in ``lightning_comp/conf/train.yaml``: groups ``precision``, ``model``, ``data``, ``trainer``
(and optionally ``size``), plus the top-level keys ``seed``, ``ckpt_path``, ``output_dir``, ``num_threads``,
``float32_matmul_precision`` and ``callbacks``. :func:`run` trains and writes into ``output_dir``:

* ``checkpoints/`` (from the ``callbacks.checkpoint`` ModelCheckpoint: best by ``val_loss`` and ``last.ckpt``),
* ``logs/`` (CSVLogger metrics),
* ``plan.json`` and ``search_record.json`` when the precision is ``comp``: a ``CoMPSearch`` writes both itself (its
  ``record_dir`` is the run directory unless the config sets one); the plan in force is written here where no search
  wrote one (a fixed plan),
* ``results.json``: the one-run summary (metrics, times, paths) that benchmarks read.

Under DDP every process runs :func:`run`; only global rank 0 writes files and prints.

An app of your own does not need this module to use the ``precision`` group: each of its options instantiates into
the Trainer's arguments (``instantiate(cfg.trainer, **instantiate(cfg.precision))``, see
:mod:`lightning_comp.conf.arguments` and ``examples/hydra_app.py``). This app wires the group's keys through
``trainer/default.yaml`` instead, so that ``trainer.precision`` and ``trainer.plugins`` stay overridable here.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import get_class, instantiate
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig, OmegaConf

from lightning_comp.devices import Lowering, device_class, lowering_for
from lightning_comp.errors import ConfigError
from lightning_comp.numerics import ComputePrecision
from lightning_comp.search import CoMPSearch
from lightning_comp.zoo.callbacks import EpochTimer

__all__ = ["DATA_OPTIONS", "check_compatible", "check_lightning_precision", "run"]

log = logging.getLogger(__name__)

#: The data options of the shipped config tree, by the data kind they yield (for error messages).
DATA_OPTIONS: dict[str, str] = {"signal": "mnist1d", "tokens": "text", "image": "shapes"}


def check_compatible(model: pl.LightningModule, datamodule: pl.LightningDataModule) -> None:
    """Raise if the model cannot consume the data module's batches.

    Both sides are duck-typed: a model with a ``data_kinds`` tuple and a data module with a ``kind`` string are
    checked; anything else (a user's own classes) passes.

    Raises:
        ConfigError: Naming the model, the data, and the data options the model accepts.
    """
    kinds = getattr(model, "data_kinds", None)
    kind = getattr(datamodule, "kind", None)
    if kinds and kind and kind not in kinds:
        options = [DATA_OPTIONS.get(k, k) for k in kinds]
        raise ConfigError(
            f"model {type(model).__name__} takes data of kind {list(kinds)}, but data {type(datamodule).__name__} "
            f"yields {kind!r}; choose data={' or data='.join(options)}"
        )


def _check_precision_wiring(cfg: DictConfig) -> None:
    """Explain the one invalid combination before Lightning raises its terser error."""
    plugins = cfg.precision.get("plugins")
    trainer_precision = cfg.trainer.get("precision")
    if plugins and trainer_precision is not None:
        name = cfg.precision.get("name", "this precision option")
        raise ConfigError(
            f"precision={name} supplies a Precision plugin, so trainer.precision must be null, got "
            f"trainer.precision={trainer_precision!r}; drop that override, or pick precision=fp32, bf16-mixed, "
            "16-mixed or bf16-true instead"
        )


def _instantiate_callbacks(group: Any, where: str, out: Path) -> list[Callback]:
    """Instantiate a mapping ``name -> callback config``.

    ``null`` entries are switched-off callbacks. Entries without ``_target_`` are settings for a callback that the
    selected option does not define; they are skipped, so that ``++precision.callbacks.comp_search.trial_epochs=2``
    can be given to a multirun over ``precision=fp32,bf16-mixed,comp`` (it only affects the ``comp`` jobs). A
    ``CoMPSearch`` without a ``record_dir`` writes its record and plan into the run directory ``out``.
    """
    if group is None:
        return []
    if not isinstance(group, Mapping):
        raise ConfigError(f"{where} must be a mapping of name -> callback config, got {type(group).__name__}")
    callbacks = []
    for name, node in group.items():
        if node is None:
            continue
        if isinstance(node, Mapping) and "_target_" not in node:
            log.info("%s.%s has no _target_ (not defined by the selected option); ignored", where, name)
            continue
        extra = {}
        if _is_search(node) and node.get("record_dir") is None:
            extra["record_dir"] = str(out)
        callback = instantiate(node, _convert_="all", **extra)
        if not isinstance(callback, Callback):
            raise ConfigError(f"{where}.{name} must build a lightning Callback, got {type(callback).__name__}")
        callbacks.append(callback)
    return callbacks


def _is_search(node: Any) -> bool:
    try:
        target = get_class(str(node["_target_"])) if isinstance(node, Mapping) else None
    except (ImportError, ValueError):  # a function target, or one Hydra fails to load later with its own message
        return False
    return isinstance(target, type) and issubclass(target, CoMPSearch)


def _choices(cfg: DictConfig) -> dict[str, str]:
    """The selected option of each config group, when Hydra's runtime info is available."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return {k: str(v) for k, v in HydraConfig.get().runtime.choices.items() if v is not None}
    except (ImportError, ValueError):  # pragma: no cover - Hydra internals
        pass
    hydra_node = cfg.get("hydra") if isinstance(cfg, DictConfig) else None
    if hydra_node is not None:  # compose(..., return_hydra_config=True)
        return {k: str(v) for k, v in hydra_node.runtime.choices.items() if v is not None}
    return {}


def _multirun_sweep_dir() -> Path | None:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
            return Path(HydraConfig.get().sweep.dir)
    except (ImportError, ValueError):  # pragma: no cover
        pass
    return None


def _scalar_metrics(trainer: pl.Trainer) -> dict[str, float]:
    return {
        name: float(value)
        for name, value in trainer.callback_metrics.items()
        if isinstance(value, torch.Tensor) and value.numel() == 1
    }


def _export_comp(trainer: pl.Trainer, out: Path) -> dict[str, str]:
    """Print the CoMP plan in force; returns the paths of ``plan.json`` and ``search_record.json``.

    A search wrote both into its ``record_dir``; the plan in force is written here only where no search wrote one.
    """
    paths: dict[str, str] = {}
    plugin = trainer.precision_plugin
    plan = getattr(plugin, "plan", None) if any(c.__name__ == "CoMPPrecision" for c in type(plugin).__mro__) else None
    if plan is None:
        return paths
    print("CoMP precision plan:\n" + str(plan.summary()), flush=True)
    search = next((c for c in trainer.callbacks if isinstance(c, CoMPSearch)), None)  # type: ignore[attr-defined]
    directory = out if search is None else Path(search.config.record_dir or out)
    if not (directory / "plan.json").is_file():  # no search, or one that chose no plan (nothing to search here)
        plan.save(directory / "plan.json")
    paths["plan_path"] = str(directory / "plan.json")
    if (directory / "search_record.json").is_file():
        paths["search_record_path"] = str(directory / "search_record.json")
    return paths


def _summary_line(result: Mapping[str, Any]) -> str:
    metric = result["val_metric"]
    value = result["metrics"].get(metric, math.nan)
    return (
        f"precision={result['precision']} model={result['model']} data={result['data']} "
        f"val_loss={result['metrics'].get('val_loss', math.nan):.4f} {metric}={value:.4f} "
        f"fit_time_s={result['fit_time_s']:.1f} epochs={result['epochs']} out={result['output_dir']}"
    )


def _plain_config(cfg: DictConfig) -> Any:
    """The resolved config as plain Python, without Hydra's own node (present with ``return_hydra_config``)."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [str(k) for k in cfg if k != "hydra"]), resolve=True)


def check_lightning_precision(trainer: pl.Trainer, model: pl.LightningModule) -> None:
    """Fail before training where Lightning's ``bf16-mixed`` would die inside oneDNN: CPU autocast has no BF16
    ``nn.LSTM`` kernel on CPUs without AVX512-BF16 (pytorch/pytorch#88136). ``precision=comp`` lowers LSTMs there
    through BF16 parameter copies instead.

    Raises:
        ConfigError: naming the LSTM, the device and the precisions that work.
    """
    device = trainer.strategy.root_device
    if trainer.precision not in ("bf16-mixed", "16-mixed") or device.type != "cpu":
        return
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.LSTM)
                and lowering_for(module, ComputePrecision.BF16, device) is not Lowering.AUTOCAST):
            raise ConfigError(
                f"precision={trainer.precision} runs {type(model).__name__}.{name} (nn.LSTM) under CPU autocast, which"
                f" has no BF16 LSTM kernel on this CPU ({device_class(device).describe()}): Lightning would fail"
                " inside oneDNN. Use precision=comp (it lowers the LSTM through BF16 parameter copies) or"
                " precision=fp32"
            )


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train the configured model on the configured data with the configured precision.

    Args:
        cfg: A composed config (see the module docstring). ``cfg.output_dir`` must resolve to a directory path
            (``${hydra:runtime.output_dir}`` under ``@hydra.main``; set it explicitly with the compose API).

    Returns:
        The results dict that is also written to ``results.json`` (on every rank; only rank 0 writes).

    Raises:
        ConfigError: If model and data do not fit together, or Lightning's precision cannot run the model here.
        ConfigError: If a configured callback does not build a Lightning ``Callback``.
    """
    start = time.perf_counter()
    out = Path(str(cfg.output_dir)).expanduser().resolve()
    num_threads = cfg.get("num_threads")
    if num_threads:
        torch.set_num_threads(int(num_threads))
    matmul_precision = cfg.get("float32_matmul_precision")
    if matmul_precision:
        torch.set_float32_matmul_precision(str(matmul_precision))
    pl.seed_everything(int(cfg.seed), workers=True)

    _check_precision_wiring(cfg)
    datamodule = instantiate(cfg.data, _convert_="all")
    model = instantiate(cfg.model, _convert_="all")
    check_compatible(model, datamodule)
    callbacks = _instantiate_callbacks(cfg.get("callbacks"), "callbacks", out)
    callbacks += _instantiate_callbacks(cfg.precision.get("callbacks"), "precision.callbacks", out)
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, _convert_="all")
    check_lightning_precision(trainer, model)

    ckpt_path = cfg.get("ckpt_path")
    fit_start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    fit_time = time.perf_counter() - fit_start

    choices = _choices(cfg)
    timer = next((cb for cb in callbacks if isinstance(cb, EpochTimer)), None)
    checkpoint = trainer.checkpoint_callback
    result: dict[str, Any] = {
        "precision": choices.get("precision") or str(cfg.precision.get("name", "?")),
        "model": choices.get("model") or type(model).__name__,
        "data": choices.get("data") or type(datamodule).__name__,
        "size": choices.get("size"),
        "seed": int(cfg.seed),
        "val_metric": getattr(model, "val_metric", "val_loss"),
        "val_metric_mode": getattr(model, "val_metric_mode", "min"),
        "metrics": _scalar_metrics(trainer),
        "fit_time_s": fit_time,
        "wall_time_s": time.perf_counter() - start,
        "epochs": int(trainer.current_epoch),
        "global_step": int(trainer.global_step),
        "world_size": int(trainer.world_size),
        "trainer_precision": str(trainer.precision),
        "precision_plugin": type(trainer.precision_plugin).__name__,
        "epoch_times": timer.epochs if timer is not None else [],
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "resumed_from": None if ckpt_path is None else str(ckpt_path),
        "best_checkpoint": getattr(checkpoint, "best_model_path", None) or None,
        "last_checkpoint": getattr(checkpoint, "last_model_path", None) or None,
        "output_dir": str(out),
        "torch": torch.__version__,
        "device": str(trainer.strategy.root_device.type),
        "config": _plain_config(cfg),
    }
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        result.update(_export_comp(trainer, out))
        (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
        line = _summary_line(result)
        print(f"RESULT {line}", flush=True)
        sweep_dir = _multirun_sweep_dir()
        if sweep_dir is not None:
            with open(sweep_dir / "summary.txt", "a") as handle:
                handle.write(line + "\n")
    return result
