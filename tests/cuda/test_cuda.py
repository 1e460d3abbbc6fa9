"""The package on a CUDA GPU: run with ``python -m pytest tests/cuda -m cuda`` on a machine with one.

Skipped without a GPU (every test here carries the ``cuda`` marker). What each test checks is what only a GPU can
show: each operator computes in its planned dtype on CUDA kernels, the search runs end to end with CUDA timing,
FP16 plans get a CUDA loss scaler that skips overflowing steps, a checkpoint resumes the plan on the GPU, the
benchmark runs there, a memory budget in bytes is judged by the caching allocator's reserved peak, and an fp32
operator trains with bf16 masters there.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_comp import CoMPPrecision, CoMPSearch, PrecisionPlan
from lightning_comp.devices import device_class
from lightning_comp.numerics import ComputePrecision
from tests.helpers.paths import REPO
from tests.helpers.recording import DtypeRecorder
from tests.helpers.search_models import AdamWMLP, WideMLP, fixed_search, loaders
from tests.scripts.cpu_class_run import LOWERED, SequenceNet

ROOT = REPO

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# aten ops that do an operator's arithmetic on CUDA (cuDNN, cuBLAS and native kernels)
_WORK = re.compile(r"rnn|lstm|gru|conv|addmm|^mm$|bmm|linear|batch_norm|layer_norm")


def _gpu() -> Any:
    return device_class("cuda")


def _low() -> ComputePrecision:
    return ComputePrecision.BF16 if _gpu().is_native(ComputePrecision.BF16) else ComputePrecision.FP16


def _trainer(root: Path, plugin: CoMPPrecision, callbacks: list[Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="gpu", devices=1, plugins=[plugin], callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root), **kwargs)


def _token_loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SequenceNet.VOCAB, (128, SequenceNet.SEQ), generator=g)
    return DataLoader(TensorDataset(tokens, tokens.sum(1) % SequenceNet.CLASSES), batch_size=32)


class _RecordFirstStep(Callback):
    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.recorder = DtypeRecorder()
        self.devices: set[str] = set()
        self.grad_dtypes: set[torch.dtype] = set()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 0:
            self.recorder.attach(pl_module, self.names)
            self.recorder.__enter__()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.devices |= {p.device.type for p in pl_module.parameters()}
        self.grad_dtypes |= {p.grad.dtype for p in pl_module.parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.recorder._handles:  # noqa: SLF001
            self.recorder.__exit__(None, None, None)
            self.recorder.detach()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_each_operator_computes_in_its_planned_dtype_on_cuda(tmp_path: Path, precision: str) -> None:
    wanted = ComputePrecision(precision)
    if not _gpu().runs(wanted):
        pytest.skip(f"{precision} does not run on {_gpu().describe()}")
    pl.seed_everything(0)
    model = SequenceNet()  # built on the CPU: Lightning moves it after convert_module
    plugin = CoMPPrecision({name: precision for name in LOWERED}, allow_slow_fp16=True)
    probe = _RecordFirstStep(LOWERED)
    _trainer(tmp_path, plugin, [probe], max_epochs=1, enable_checkpointing=False).fit(model, _token_loader(1))
    assert plugin.device is not None and plugin.device.type == "cuda"
    assert probe.devices == {"cuda"} and probe.grad_dtypes == {torch.float32}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (plugin.scaler is not None) == (wanted is ComputePrecision.FP16)
    if plugin.scaler is not None:
        assert plugin.scaler._device == "cuda"  # noqa: SLF001
    for name in LOWERED:
        work = [r for r in probe.recorder.ops_of(name) if _WORK.search(r.op)]
        assert work, (name, {r.op for r in probe.recorder.ops_of(name)})
        assert any(wanted.dtype in r.inputs for r in work), (name, [(r.op, r.inputs) for r in work])
        if name not in ("bn", "ln"):  # norms keep fp32 statistics next to the low-precision activation
            heavy = [r for r in work if "norm" not in r.op]
            assert all(torch.float32 not in r.inputs for r in heavy), (name, [(r.op, r.inputs) for r in heavy])


def test_a_search_end_to_end_on_cuda(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search(low_precision="auto", record_dir=str(tmp_path / "record"))
    trainer = _trainer(tmp_path, CoMPPrecision(), [search], max_epochs=4)
    train, val = loaders()
    trainer.fit(WideMLP(width=1024), train, val)
    record = search.record
    assert record is not None and record["low_precision"] == _low().value
    precisions = trainer.precision_plugin.plan.resolve(trainer.lightning_module)
    assert precisions["l3"] is ComputePrecision.FP32, record  # unsafe in 16-bit: the trial rejects it
    assert precisions["l2"] is _low() and precisions["l4"] is _low(), record
    memory = record["memory"]  # CUDA peak memory per profiled configuration
    assert memory and all(isinstance(e["peak_bytes"], int) and e["peak_bytes"] > 0 for e in memory.values())
    assert record["step_ms"] and all(v > 0 for v in record["step_ms"].values())
    assert (tmp_path / "record" / "plan.json").exists()
    plan = PrecisionPlan.load(tmp_path / "record" / "plan.json")
    assert plan.device is not None and plan.device.type == "cuda" and plan.device.capability.startswith("sm")


class _Overflowing(pl.LightningModule):
    """``big`` overflows fp16 on the first batches (inputs x 1e5), so the scaler must skip and back off."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 64)
        self.big = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.big(torch.relu(self.l1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        scale = 1e5 if self.global_step < 2 else 1.0
        return nn.functional.mse_loss(self(x * scale) / scale, y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _regression(n: int = 256) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=32)


def test_an_fp16_plan_scales_the_loss_on_cuda_and_resumes(tmp_path: Path) -> None:
    if not _gpu().runs(ComputePrecision.FP16):
        pytest.skip("no fp16 on this GPU")
    pl.seed_everything(0)
    plugin = CoMPPrecision({"type:Linear": "fp16"}, allow_slow_fp16=True)  # also on a GPU without fast fp16
    trainer = _trainer(tmp_path, plugin, max_steps=8, enable_checkpointing=False)
    trainer.fit(_Overflowing(), _regression())
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler._device == "cuda"  # noqa: SLF001
    assert plugin.skipped_steps >= 1 and plugin.optimizer_steps == 8
    assert plugin.scaler.get_scale() < 65536.0
    path = tmp_path / "fp16.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["lightning_comp"]
    assert state["scaler"]["scale"] == plugin.scaler.get_scale()
    resumed = CoMPPrecision(allow_slow_fp16=True)
    _trainer(tmp_path, resumed, max_steps=10, enable_checkpointing=False).fit(_Overflowing(), _regression(),
                                                                              ckpt_path=str(path))
    assert resumed.plan == plugin.plan and resumed.executor.device is not None
    assert resumed.executor.device.type == "cuda"
    assert resumed.scaler is not None and resumed.scaler._device == "cuda"  # noqa: SLF001
    assert resumed.optimizer_steps == 10


def test_a_checkpoint_resumes_the_plan_on_cuda(tmp_path: Path) -> None:
    pl.seed_everything(0)
    low = _low().value
    plugin = CoMPPrecision({"l2": low, "l4": low})
    trainer = _trainer(tmp_path, plugin, max_epochs=1, enable_checkpointing=False)
    train, val = loaders(n_train=512, n_val=256)
    trainer.fit(WideMLP(width=256), train, val)
    path = tmp_path / "plan.ckpt"
    trainer.save_checkpoint(path)
    resumed = CoMPPrecision()
    again = _trainer(tmp_path, resumed, max_epochs=2, enable_checkpointing=False)
    again.fit(WideMLP(width=256), train, val, ckpt_path=str(path))
    assert resumed.plan == plugin.plan
    assert resumed.executor.precisions()["l2"].value == low and resumed.executor.device.type == "cuda"
    assert math.isfinite(float(again.callback_metrics["val_loss"]))


def test_the_default_search_chooses_a_native_precision_on_cuda(tmp_path: Path) -> None:
    search = CoMPSearch(verbose=False, warmup_epochs=0, measurement="quick", record_dir=str(tmp_path))
    train, val = loaders(n_train=512, n_val=256)
    _trainer(tmp_path, CoMPPrecision(), [search], max_epochs=2, enable_checkpointing=False).fit(
        WideMLP(width=512, offset=False), train, val)
    assert search.record is not None and search.record["low_precision"] == _low().value


@pytest.mark.slow
def test_the_benchmark_smoke_run_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--smoke", "--out", str(out),
                           "--img", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "compare.json").read_text())
    assert report["device"] == "cuda"
    for key, model in report["models"].items():
        for mode, entry in model["modes"].items():
            assert "error" not in entry, f"{key}/{mode}: {entry.get('error')}"


class _SnapshotDevices(Callback):
    def __init__(self, search: CoMPSearch) -> None:
        self.search = search
        self.devices: set[str] = set()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        snapshot = self.search.state.snapshot
        if snapshot is not None:
            self.devices |= {t.device.type for t in snapshot["model"].values()}


def test_snapshots_stay_on_the_cpu_when_asked(tmp_path: Path) -> None:
    pl.seed_everything(0)
    search = fixed_search(low_precision="auto", snapshot_device="cpu")
    probe = _SnapshotDevices(search)
    trainer = _trainer(tmp_path, CoMPPrecision(), [search, probe], max_epochs=4, enable_checkpointing=False)
    train, val = loaders(n_train=512, n_val=256)
    trainer.fit(WideMLP(width=256), train, val)
    assert probe.devices == {"cpu"}
    assert search.record is not None and any(t["verdict"] == "fail" for t in search.record["trials"])  # rewound
    assert all(p.device.type == "cuda" for p in trainer.lightning_module.parameters())


@pytest.mark.parametrize("saved", ["bf16", "fp8"])
def test_saved_tensors_are_stored_compressed_on_cuda_without_host_synchronisation(saved: str) -> None:
    """The codecs decide scales on the device: packing a step's activations never waits for the GPU."""
    from lightning_comp.execution.executor import PlanExecutor, StepKind
    from tests.helpers.recording import sqnr

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 10)).cuda()
    x, y = torch.randn(512, 256, device="cuda"), torch.randint(0, 10, (512,), device="cuda")

    def grads(plan: PrecisionPlan) -> list[torch.Tensor]:
        executor = PlanExecutor(min_saved_bytes=0)
        executor.apply(model, plan)
        model.zero_grad()
        with executor.step(StepKind.TRAIN):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        executor.remove()
        return [p.grad.clone() for p in model.parameters()]

    reference = grads(PrecisionPlan())
    torch.cuda.set_sync_debug_mode("error")  # any implicit device-to-host synchronisation raises
    try:
        lowered = grads(PrecisionPlan.from_dict({}, default={"saved": saved}))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert min(sqnr(r, g) for r, g in zip(reference, lowered)) > (35.0 if saved == "bf16" else 15.0)


def _fp8_native() -> bool:
    return _gpu().is_native(ComputePrecision.FP8)


@pytest.mark.parametrize("recipe", ["fp8", "fp8-rowwise"])
def test_an_fp8_plan_trains_on_cuda_with_scaled_matmuls_within_tolerance_of_bf16(tmp_path: Path, recipe: str) -> None:
    """On sm89+: every Linear of the zoo GPT computes through ``_scaled_mm`` with float8 operands, masters and
    gradients stay fp32, and the validation loss ends within the search's default tolerance of a bf16 plan's."""
    if not _fp8_native():
        pytest.skip(f"fp8 matmuls need CUDA sm89+; this is {_gpu().describe()}")
    from lightning_comp.search.config import SearchConfig
    from lightning_comp.zoo import CharGPT, CharTextDataModule
    from tests.helpers.recording import ScaledMatmulRecorder

    def fit(plan: dict[str, str]) -> tuple[float, pl.LightningModule]:
        pl.seed_everything(0, workers=True)
        model = CharGPT(width=128, depth=2, heads=4, block_size=64, lr=3e-3)
        trainer = _trainer(tmp_path, CoMPPrecision(plan), max_epochs=1, limit_train_batches=40, limit_val_batches=4,
                           num_sanity_val_steps=0, enable_checkpointing=False)
        trainer.fit(model, datamodule=CharTextDataModule(seq_len=64, num_samples=1024, batch_size=16))
        return float(trainer.callback_metrics["val_loss"]), model

    reference, _ = fit({"type:Linear": "bf16"})
    with ScaledMatmulRecorder() as scaled:
        got, model = fit({"type:Linear": recipe})
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert len(scaled.calls) >= 3 * linears and all(c.devices[0].startswith("cuda") for c in scaled.calls)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert abs(got - reference) <= SearchConfig().tolerance * abs(reference), (got, reference)


def _memory_search_with_budget(root: Path, trainer: pl.Trainer, budget_bytes: int) -> dict[str, Any]:
    """A memory search of the 8-bit optimizer-state lever alone (compute, saved tensors and masters not searched; one
    state format, so one compiled step on a GPU) with a budget in bytes, on ``trainer``'s device; returns its
    record."""
    pl.seed_everything(0)
    search = CoMPSearch(objective="memory", low_precision="off",
                        precisions={"saved": "off", "master": "off", "state": "8bit"},
                        memory_budget=budget_bytes, verbose=False, measurement={"profile_steps": 3}, max_trials=3,
                        record_dir=str(root / "record"))
    trainer.callbacks.append(search)
    trainer.fit(AdamWMLP(width=1024), *loaders())
    assert search.record is not None
    return search.record


def test_a_memory_budget_is_judged_by_the_allocators_reserved_peak_on_cuda(tmp_path: Path) -> None:
    """Issue 34, point 5 on a GPU: the budget in bytes is judged by the CUDA caching allocator's reserved peak of a
    step (beside its allocated peak), the 8-bit optimizer state is held and stepped on the GPU (compiled, no native
    step), and the record's text names the reserved figure."""
    from lightning_comp.search.record.text import format_record

    trainer = _trainer(tmp_path, CoMPPrecision(), [], max_epochs=3)
    record = _memory_search_with_budget(tmp_path, trainer, budget_bytes=2**20)  # 1 MiB: out of reach
    spending = record["memory_spending"]
    peaks = spending["process_peaks"]
    assert set(peaks) == {"start", "plan"}
    for key in ("start", "plan"):
        reserved, allocated = peaks[key]["reserved_mib"], peaks[key]["allocated_mib"]
        assert reserved is not None and allocated is not None and reserved >= allocated > 0, peaks
    assert peaks["plan"]["allocated_mib"] < peaks["start"]["allocated_mib"]  # the 8-bit state freed bytes
    assert spending["process_met"] is False and not spending["met"]
    plan_peak = peaks["plan"]
    assert f"{plan_peak['reserved_mib']:.1f} / {plan_peak['allocated_mib']:.1f}" in format_record(record)
    updates = trainer.precision_plugin._runtime.optimizer_states.updates  # noqa: SLF001
    assert updates.compiled_steps > 0 and updates.native_steps == 0
    optimizer = trainer.optimizers[0]
    packed = [s["exp_avg"] for s in optimizer.state.values() if s["exp_avg"].dtype == torch.uint8]
    assert packed and all(t.device.type == "cuda" for t in packed)
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


class _MasterDtypes(Callback):
    """What the managed parameters and their gradients are while training (checked before each optimizer step)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.seen: set[tuple[str, torch.dtype, torch.dtype | None]] = set()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        for name in self.names:
            weight = pl_module.get_submodule(name).weight
            self.seen.add((weight.device.type, weight.dtype, None if weight.grad is None else weight.grad.dtype))


def test_fp32_operators_train_with_bf16_masters_on_cuda(tmp_path: Path) -> None:
    """A bf16 master of an operator computing in fp32: bf16 weights and gradients on the GPU (the forward computes
    with fp32 copies), stepped by the compiled update; it learns, and ends within 15 % of FP32's validation loss (the
    same run on a CPU Trainer, stepped natively: 1.367 against 1.276, 7 %)."""
    plan = {"l2": {"master": "bf16", "state": "8bit"}, "l3": {"master": "bf16"}}
    watch = _MasterDtypes(("l2", "l3"))
    losses = []
    for entries in (plan, None):
        pl.seed_everything(0)
        trainer = _trainer(tmp_path, CoMPPrecision(entries), [watch] if entries else [], max_epochs=2)
        trainer.fit(AdamWMLP(width=1024), *loaders())
        losses.append(float(trainer.callback_metrics["val_loss"]))
        if entries:
            assert trainer.precision_plugin.plan.is_all_fp32
            assert watch.seen == {("cuda", torch.bfloat16, torch.bfloat16)}
            updates = trainer.precision_plugin._runtime.optimizer_states.updates  # noqa: SLF001
            assert updates.compiled_steps > 0 and updates.native_steps == 0
    assert losses[0] < 0.9 * math.log(10)  # it learned (chance is ln 10)
    assert losses[0] == pytest.approx(losses[1], rel=0.15)
