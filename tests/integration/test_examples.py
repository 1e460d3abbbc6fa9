"""End-to-end tests of the Hydra app: every model/data pair under every precision (tiny), resume, multirun, DDP.

In-process runs compose the repo's ``conf/config.yaml`` with Hydra's compose API and call
:func:`lightning_comp.zoo.runner.run` (what ``examples/train.py`` does); a few tests run ``examples/train.py`` itself in
a subprocess. Tests of ``precision=comp`` are skipped while the engine (``CoMPPrecision`` and ``CoMPSearch``) is not
importable from ``lightning_comp``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig

import lightning_comp
from lightning_comp.zoo.runner import run
from tests.helpers.paths import REPO

CONF_DIR = REPO / "conf"
TRAIN_PY = REPO / "examples" / "train.py"
HYDRA_APP_PY = REPO / "examples" / "hydra_app.py"
PAIRS = [
    ("cnn1d", "mnist1d"),
    ("gru", "mnist1d"),
    ("narrow_mlp", "mnist1d"),
    ("char_lstm", "text"),
    ("char_gpt", "text"),
    ("convnet_bn", "shapes"),
]
LIGHTNING_PRECISIONS = ["fp32", "bf16-mixed", "16-mixed", "bf16-true"]
EXPECTED_TRAINER_PRECISION = {
    "fp32": {"32-true"},
    "bf16-mixed": {"bf16-mixed"},
    "16-mixed": {"16-mixed", "bf16-mixed"},  # Lightning turns 16-mixed into bf16-mixed on CPU
    "bf16-true": {"bf16-true"},
}
# a short search for tiny runs (1 epoch of 4 training batches): no warm-up epoch, 2 profiled steps
COMP_FAST = ["precision.callbacks.comp_search.warmup_epochs=0", "precision/callbacks/comp_search/measurement=quick"]

_MISSING = [name for name in ("CoMPPrecision", "CoMPSearch") if not hasattr(lightning_comp, name)]
requires_engine = pytest.mark.skipif(
    bool(_MISSING), reason=f"engine not importable yet: lightning_comp lacks {', '.join(_MISSING)}"
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Small ops stall badly when the 2 shared cores are oversubscribed; one thread keeps the tests quick."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cpu_autocast_runs_bf16_lstm() -> bool:
    from lightning_comp.devices.lowering import Lowering, lowering_for
    from lightning_comp.numerics import ComputePrecision

    return lowering_for(torch.nn.LSTM(2, 2), ComputePrecision.BF16, "cpu") is Lowering.AUTOCAST


def _compose(out: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = (f"output_dir={out}", "size=tiny", "num_threads=1", *overrides)
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def _check_plain(obj: Any, where: str = "checkpoint") -> None:
    """Fail if an OmegaConf container hides anywhere in ``obj`` (it would break weights_only loading)."""
    assert not isinstance(obj, (DictConfig, ListConfig)), where
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")


def _check_run_dir(out: Path, result: dict[str, Any]) -> None:
    saved = json.loads((out / "results.json").read_text())
    assert saved["precision"] == result["precision"] and saved["model"] == result["model"]
    assert math.isfinite(saved["metrics"]["val_loss"]) and result["val_metric"] in saved["metrics"]
    last = out / "checkpoints" / "last.ckpt"
    assert last.is_file() and saved["last_checkpoint"] == str(last)
    checkpoint = torch.load(last, weights_only=True)  # torch 2.13's default for Trainer.fit(ckpt_path=...)
    _check_plain(checkpoint)
    assert (out / "logs").is_dir()


@pytest.mark.parametrize("precision", LIGHTNING_PRECISIONS)
@pytest.mark.parametrize(("model", "data"), PAIRS)
def test_every_pair_trains_under_lightning_precisions(tmp_path: Path, model: str, data: str, precision: str) -> None:
    cfg = _compose(tmp_path, f"model={model}", f"data={data}", f"precision={precision}")
    if precision in ("bf16-mixed", "16-mixed") and model == "char_lstm" and not _cpu_autocast_runs_bf16_lstm():
        with pytest.raises(ValueError, match=r"nn\.LSTM\) under CPU autocast, which has no BF16 LSTM kernel"):
            run(cfg)  # an AVX2-only CPU: a clear error before training instead of oneDNN's
        return
    result = run(cfg)
    assert (result["model"], result["data"], result["precision"]) == (model, data, precision)
    assert result["trainer_precision"] in EXPECTED_TRAINER_PRECISION[precision]
    assert result["epochs"] == 1 and result["global_step"] == 4
    _check_run_dir(tmp_path, result)
    assert not (tmp_path / "plan.json").exists()


@requires_engine
@pytest.mark.parametrize(("model", "data"), PAIRS)
def test_every_pair_trains_under_comp(tmp_path: Path, model: str, data: str) -> None:
    result = run(_compose(tmp_path, f"model={model}", f"data={data}", "precision=comp", *COMP_FAST))
    assert result["precision"] == "comp" and result["precision_plugin"] == "CoMPPrecision"
    assert result["trainer_precision"] == "32-true"
    _check_run_dir(tmp_path, result)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan
    assert json.loads((tmp_path / "search_record.json").read_text())


def test_resume_from_last_checkpoint(tmp_path: Path) -> None:
    first = run(_compose(tmp_path / "a", "model=cnn1d", "data=mnist1d", "precision=fp32"))
    resumed = run(
        _compose(
            tmp_path / "b",
            "model=cnn1d",
            "data=mnist1d",
            "precision=fp32",
            f"ckpt_path={first['last_checkpoint']}",
            "trainer.max_epochs=2",
        )
    )
    assert resumed["resumed_from"] == first["last_checkpoint"]
    assert resumed["epochs"] == 2 and resumed["global_step"] == 2 * first["global_step"]
    assert (tmp_path / "b" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.slow
@requires_engine
def test_resume_under_comp_keeps_the_plan(tmp_path: Path) -> None:
    first = run(_compose(tmp_path / "a", "model=char_gpt", "data=text", "precision=comp", *COMP_FAST))
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    checkpoint = torch.load(first["last_checkpoint"], weights_only=True)
    assert "lightning_comp" in checkpoint  # the plugin state, under the one key of every plugin class
    resumed = run(
        _compose(
            tmp_path / "b",
            "model=char_gpt",
            "data=text",
            "precision=comp",
            *COMP_FAST,
            f"ckpt_path={first['last_checkpoint']}",
            f"trainer.max_epochs={first['epochs'] + 1}",
        )
    )
    assert resumed["global_step"] > first["global_step"]
    assert json.loads((tmp_path / "b" / "plan.json").read_text()) == plan


def test_settings_of_a_callback_the_option_lacks_are_ignored(tmp_path: Path) -> None:
    cfg = _compose(tmp_path, "model=narrow_mlp", "data=mnist1d", "precision=fp32", "++precision.callbacks.x.a=1")
    assert run(cfg)["precision_plugin"] != "CoMPPrecision"


def test_incompatible_model_and_data_fail_early(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="choose data=text"):
        run(_compose(tmp_path, "model=char_gpt", "data=mnist1d", "precision=fp32"))


def test_comp_with_a_trainer_precision_is_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trainer.precision must be null, got trainer.precision='bf16-mixed'"):
        run(_compose(tmp_path, "precision=comp", "trainer.precision=bf16-mixed"))


def _library(module: str) -> str | None:
    """``None`` if ``module`` imports, else why not (torchvision built for another torch raises RuntimeError)."""
    try:
        __import__(module)
    except Exception as error:  # noqa: BLE001 - any failure to import means: skip, and say why
        return f"{module} cannot be imported here ({type(error).__name__}: {str(error)[:100]})"
    return None


# The README's commands for the models nobody here wrote, shortened: `python examples/train.py model=hf_gpt2 data=text`
# and `model=tv_resnet data=shapes` (the ResNet takes no width/depth knobs, so no size=tiny: explicit limits instead).
THIRD_PARTY = [
    pytest.param("hf_gpt2", "text", ("size=tiny", "model.heads=2"), "transformers", id="hf_gpt2"),
    pytest.param("litgpt", "text", ("size=tiny", "model.heads=2", "model.query_groups=1"), "litgpt", id="litgpt"),
    pytest.param("litgpt_moe", "text", ("size=tiny", "model.heads=2", "model.query_groups=1"), "litgpt",
                 id="litgpt_moe"),
    pytest.param("x_transformer", "text", ("size=tiny", "model.heads=2"), "x_transformers", id="x_transformer"),
    pytest.param("tv_resnet", "shapes", ("trainer.max_epochs=1", "trainer.limit_train_batches=4",
                                         "trainer.limit_val_batches=2", "trainer.num_sanity_val_steps=0",
                                         "trainer.enable_progress_bar=false", "data.num_samples=320",
                                         "data.batch_size=32"), "torchvision", id="tv_resnet"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "data", "overrides", "library"), THIRD_PARTY)
def test_models_nobody_here_wrote_train_under_comp(tmp_path: Path, model: str, data: str,
                                                    overrides: tuple[str, ...], library: str) -> None:
    why = _library(library)
    if why is not None:
        pytest.skip(f"{why}; install the extra ([hf] or [vision])")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"output_dir={tmp_path}", "num_threads=1", f"model={model}",
                                           f"data={data}", "precision=comp", *COMP_FAST, *overrides,
                                           # pinned: the search runs on every CPU class, emulated BF16 included
                                           "precision.callbacks.comp_search.low_precision=bf16"],
                      return_hydra_config=True)
    result = run(cfg)
    assert (result["model"], result["data"], result["precision"]) == (model, data, "comp")
    _check_run_dir(tmp_path, result)
    assert json.loads((tmp_path / "search_record.json").read_text())["num_operators"] > 0


# ------------------------------------------------------------------------------------------ examples/train.py


def _train_py(*args: str, cwd: Path, timeout: float = 300, script: Path = TRAIN_PY) -> subprocess.CompletedProcess[str]:
    python_path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
    # own process group: on a timeout, DDP workers that Lightning started are killed too (not left in a collective)
    with subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            pytest.fail(f"examples/{script.name} {' '.join(args)} timed out after {timeout} s:\n{stderr[-5000:]}")
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
def test_a_users_own_hydra_app_switches_every_precision_on_its_command_line(tmp_path: Path) -> None:
    """``examples/hydra_app.py``: its own model and primary config, the package's precision group, no wiring."""
    sweep = tmp_path / "sweep"
    precisions = ["fp32", "bf16-mixed", "16-mixed", "bf16-true"] + ([] if _MISSING else ["comp"])
    proc = _train_py("-m", f"precision={','.join(precisions)}", "trainer.max_epochs=1", f"hydra.sweep.dir={sweep}",
                     "++precision.callbacks.comp_search.warmup_epochs=0",  # else one epoch ends before it starts
                     cwd=tmp_path, script=HYDRA_APP_PY)
    results = [line.split()[1:4] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    plugins = {"fp32": "Precision", "bf16-mixed": "MixedPrecision", "16-mixed": "MixedPrecision",
               "bf16-true": "HalfPrecision", "comp": "CoMPPrecision"}
    assert [(name, plugin) for name, _, plugin in results] == [
        (f"precision={p}", f"plugin={plugins[p]}") for p in precisions]
    for (_, trainer_precision, _), precision in zip(results, precisions):
        expected = EXPECTED_TRAINER_PRECISION.get(precision, {"32-true"})  # comp: FP32 master weights
        assert trainer_precision.removeprefix("trainer_precision=") in expected
    if "comp" in precisions:  # CoMPSearch wrote its record into the job's Trainer log dir
        assert list((sweep / str(precisions.index("comp"))).glob("lightning_logs/version_0/search_record.json"))


@pytest.mark.slow
def test_multirun_compares_precisions(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    precisions = ["fp32", "bf16-mixed"] + ([] if _MISSING else ["comp"])
    proc = _train_py(
        "-m",
        f"precision={','.join(precisions)}",
        "++precision.callbacks.comp_search.warmup_epochs=0",  # only the comp job has that callback
        "size=tiny",
        "num_threads=1",
        "model=narrow_mlp",
        "data=mnist1d",
        f"hydra.sweep.dir={sweep}",
        cwd=tmp_path,
    )
    assert proc.stdout.count("RESULT precision=") == len(precisions)
    lines = (sweep / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in lines] == [f"precision={p}" for p in precisions]
    for job in map(str, range(len(precisions))):
        assert json.loads((sweep / job / "results.json").read_text())["model"] == "narrow_mlp"
        assert (sweep / job / "checkpoints" / "last.ckpt").is_file()
        assert (sweep / job / ".hydra" / "config.yaml").is_file()


@requires_engine
@pytest.mark.slow
def test_default_command_runs_comp_and_leaves_plan_and_record(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _train_py("size=tiny", "num_threads=1", *COMP_FAST, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert "RESULT precision=comp model=char_gpt data=text" in proc.stdout
    for name in ("results.json", "plan.json", "search_record.json", "checkpoints/last.ckpt"):
        assert (run_dir / name).is_file(), name


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["fp32", pytest.param("comp", marks=requires_engine)])
def test_ddp_two_processes_on_cpu(tmp_path: Path, precision: str) -> None:
    run_dir = tmp_path / "run"
    proc = _train_py(
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "trainer.accelerator=cpu",
        "size=tiny",
        "num_threads=1",
        f"precision={precision}",
        *(COMP_FAST if precision == "comp" else []),
        "model=cnn1d",
        "data=mnist1d",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=240,
    )
    assert proc.stdout.count("RESULT precision=") == 1  # rank 0 only
    result = json.loads((run_dir / "results.json").read_text())
    assert result["world_size"] == 2 and result["epochs"] >= 1
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    if precision == "comp":
        assert (run_dir / "plan.json").is_file() and (run_dir / "search_record.json").is_file()
