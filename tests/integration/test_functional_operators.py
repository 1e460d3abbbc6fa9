"""Every heavy operation can be planned, in models nobody here wrote: litgpt (LLaMA-style and mixture of experts),
x-transformers, Hugging Face GPT-2 and the zoo's GPT, through the Trainer and through Lightning Fabric.

Each model's attention product is a functional call between its modules (SDPA, einsum); a trace of the first step
makes the module that calls it a FUNCTIONAL operator. No ``register_atomic`` anywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_comp import CoMPFabricPrecision, CoMPPrecision, CoMPSearch, PrecisionPlan
from lightning_comp.execution.executor import StepKind
from lightning_comp.operators import OperatorKind, discover_operators
from lightning_comp.zoo import HFGPT2, CharGPT, CharTextDataModule, LitGPT, XTransformerLM
from tests.helpers.recording import DtypeRecorder

BF16, FP32 = torch.bfloat16, torch.float32
_MATMULS = ("mm", "addmm", "bmm", "baddbmm")


def _missing(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure to import means: skip, and say why
        return f"{module} cannot be imported here ({type(error).__name__}: {str(error)[:100]})"
    return None


def _needs(module: str, extra: str) -> pytest.MarkDecorator:
    why = _missing(module)
    return pytest.mark.skipif(why is not None, reason=f"{why}; install the [{extra}] extra")


class HeavyOps(TorchDispatchMode):
    """Records every matmul and attention kernel (forward and backward) with the dtypes of its tensor operands."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _MATMULS or name.startswith(("_scaled_dot_product", "_flash_attention", "_efficient_attention")):
            dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
            if name.endswith("_backward"):  # grad_out, q, k, v, out (the log-sum-exp is fp32 by design)
                dtypes = dtypes[:5]
            self.ops.append((name, dtypes))
        return func(*args, **(kwargs or {}))

    def attention(self) -> list[tuple[str, list[torch.dtype]]]:
        return [(n, d) for n, d in self.ops if n not in _MATMULS]


class RecordSteps(pl.Callback):
    """Records the heavy ops of the first ``steps`` training steps (forward, loss, backward), one recorder each."""

    def __init__(self, steps: int = 2) -> None:
        self.steps = steps
        self.recorded: list[HeavyOps] = []
        self._mode: HeavyOps | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step < self.steps:
            self._mode = HeavyOps()
            self._mode.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self.recorded.append(self._mode)
            self._mode = None


# model factory, the FUNCTIONAL operators it must have, the attention modules' class
MODELS: dict[str, tuple[Callable[[], pl.LightningModule], set[str], str]] = {
    "litgpt": (lambda: LitGPT(width=32, depth=2, heads=4, query_groups=2, block_size=32),
               {"gpt.transformer.h.0.attn", "gpt.transformer.h.1.attn"}, "CausalSelfAttention"),
    "litgpt_moe": (lambda: LitGPT(width=32, depth=2, heads=4, query_groups=2, block_size=32, experts=4),
                   {"gpt.transformer.h.0.attn", "gpt.transformer.h.1.attn"}, "CausalSelfAttention"),
    "x_transformer": (lambda: XTransformerLM(width=32, depth=2, heads=4, block_size=32),
                      {"net.attn_layers.layers.0.1.attend", "net.attn_layers.layers.2.1.attend"}, "Attend"),
    "hf_gpt2": (lambda: HFGPT2(width=32, depth=2, heads=2, block_size=32),
                {"gpt2.transformer.h.0.attn", "gpt2.transformer.h.1.attn"}, "GPT2Attention"),
    "char_gpt": (lambda: CharGPT(width=32, depth=2, heads=2, block_size=32), set(), "ScaledDotProductAttention"),
}
_LIBRARY = {"litgpt": ("litgpt", "litgpt"), "litgpt_moe": ("litgpt", "litgpt"),
            "x_transformer": ("x_transformers", "xtransformers"), "hf_gpt2": ("transformers", "hf")}


def _params(key: str) -> Any:
    marks = [_needs(*_LIBRARY[key])] if key in _LIBRARY else []
    return pytest.param(key, marks=marks, id=key)


def _text() -> CharTextDataModule:
    return CharTextDataModule(seq_len=32, num_samples=96, batch_size=8)


def _trainer(tmp_path: Path, plugin: CoMPPrecision, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("limit_train_batches", 3)
    kwargs.setdefault("limit_val_batches", 1)
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=str(tmp_path), **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("key", [_params(k) for k in MODELS])
def test_an_all_bf16_plan_computes_every_matmul_and_attention_in_bf16(key: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    factory, functional, _ = MODELS[key]
    model, plugin, steps = factory(), CoMPPrecision({"*": "bf16"}), RecordSteps(2)
    _trainer(tmp_path, plugin, [steps]).fit(model, datamodule=_text())
    assert {i.name for i in discover_operators(model) if i.kind is OperatorKind.FUNCTIONAL} == functional
    assert len(steps.recorded) == 2  # the first step (tracing) and the second (calibrating)
    for recorded in steps.recorded:
        if key == "x_transformer":  # einsum: two bmm forward, four backward, per layer
            assert sum(n == "bmm" for n, _ in recorded.ops) == 2 * 6
        else:
            assert sum(n.endswith("_backward") for n, _ in recorded.attention()) == 2  # one per layer, and forward
            assert len(recorded.attention()) == 4
        wrong = [(n, d) for n, d in recorded.ops if set(d) != {BF16}]
        assert not wrong, wrong
    assert all(p.dtype == FP32 for p in model.parameters())  # master weights


@pytest.mark.slow
@pytest.mark.parametrize("key", [_params("litgpt"), _params("x_transformer")])
def test_a_linear_only_plan_leaves_attention_in_fp32_and_warns_naming_it(key: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    factory, functional, attention_type = MODELS[key]
    steps = RecordSteps(1)
    with pytest.warns(UserWarning, match="stays in fp32") as caught:
        _trainer(tmp_path, CoMPPrecision({"type:Linear": "bf16"}), [steps]).fit(factory(), datamodule=_text())
    message = next(str(w.message) for w in caught if "stays in fp32" in str(w.message))
    assert all(name in message for name in functional) and f"'type:{attention_type}': 'bf16'" in message
    recorded = steps.recorded[0]
    assert {n for n, d in recorded.ops if n in ("mm", "addmm") and set(d) == {BF16}}  # the Linears
    attention = recorded.attention() or [(n, d) for n, d in recorded.ops if n == "bmm"]
    assert attention and all(set(d) == {FP32} for _, d in attention)


@pytest.mark.slow
@_needs("litgpt", "litgpt")
def test_a_search_on_litgpt_trials_attention_and_its_plan_round_trips_and_resumes(tmp_path: Path) -> None:
    """Candidates pinned (whether bf16 pays on this CPU is not what is tested): the attention operators are
    profiled and trialled like any other; the chosen plan survives a file and a checkpoint resume."""
    torch.manual_seed(0)
    search = CoMPSearch(low_precision="bf16", include=["type:CausalSelfAttention", "type:Linear"],
                        exclude=["type:RMSNorm", "type:Embedding"], tolerance=0.1, measurement={"profile_steps": 1},
                        max_trials=3, verbose=False)
    factory = MODELS["litgpt"][0]
    trainer = _trainer(tmp_path, CoMPPrecision(), [search], max_epochs=4, limit_train_batches=4,
                       enable_checkpointing=True)
    trainer.fit(factory(), datamodule=_text())
    assert search.phase == "done" and search.chosen_plan is not None
    record = search.record
    assert record is not None
    attention = {"gpt.transformer.h.0.attn", "gpt.transformer.h.1.attn"}
    assert attention <= set(record["operators"]), sorted(record["operators"])  # measured in the batch stage
    trialled = {name for trial in record["trials"] for name in trial["low_operators"]}
    assert attention <= trialled, record["trials"]
    assert {n for n, p in search.chosen_plan["compute"].entries if p.value == "bf16"} & attention  # kept: it converged
    path = search.chosen_plan.save(tmp_path / "litgpt_plan.json")
    assert PrecisionPlan.load(path)["compute"] == search.chosen_plan["compute"]
    ckpt = trainer.checkpoint_callback.last_model_path or trainer.checkpoint_callback.best_model_path
    resumed_plugin, resumed_search = CoMPPrecision(), CoMPSearch(verbose=False)
    _trainer(tmp_path, resumed_plugin, [resumed_search], max_epochs=5, limit_train_batches=4).fit(
        factory(), datamodule=_text(), ckpt_path=ckpt)
    assert resumed_search.phase == "done" and resumed_plugin.plan["compute"] == search.chosen_plan["compute"]
    again = CoMPPrecision(path)
    _trainer(tmp_path, again, [], limit_val_batches=0).fit(factory(), datamodule=_text())
    assert again.executor.precisions() == resumed_plugin.executor.precisions()


class RecordMLP(pl.Callback):
    """Records, in training step ``step``, the dtypes of every op of block 0's MLP (its own code and its Linears)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.recorder: DtypeRecorder | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            mlp = "gpt.transformer.h.0.mlp"
            self.recorder = DtypeRecorder().attach(pl_module, (mlp, f"{mlp}.fc_1", f"{mlp}.fc_2", f"{mlp}.proj"))
            self.recorder.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.recorder is not None and trainer.global_step == self.step + 1:
            self.recorder.__exit__(None, None, None)
            self.recorder.detach()


@pytest.mark.slow
@_needs("litgpt", "litgpt")
def test_litgpts_gated_mlp_computes_its_product_in_bf16_between_bf16_linears(tmp_path: Path) -> None:
    """``LLaMAMLP`` computes ``silu(fc_1(x)) * fc_2(x)`` in its own forward, no operator's work: between Linears
    planned bf16 it runs in bf16 (as under autocast) and keeps bf16 copies for backward, not FP32 ones."""
    torch.manual_seed(0)
    plugin, record = CoMPPrecision({"type:Linear": "bf16"}), RecordMLP(step=2)  # 0 traces, 1 calibrates
    with pytest.warns(UserWarning, match="stays in fp32"):  # the attention, left FP32 by this plan
        _trainer(tmp_path, plugin, [record], limit_train_batches=3).fit(MODELS["litgpt"][0](), datamodule=_text())
    mlp = "gpt.transformer.h.0.mlp"
    assert {f"{mlp}.fc_1", f"{mlp}.fc_2"} <= plugin.executor.chained_operators(StepKind.TRAIN)
    assert record.recorder is not None
    own = [r for r in record.recorder.ops if r.module == mlp and r.op in ("silu", "mul")]
    assert [r.op for r in own] == ["silu", "mul"]
    assert all(set(r.inputs) == {BF16} and r.outputs == [BF16] for r in own), own
    assert not [r for r in record.recorder.ops if r.module == mlp and r.op == "_to_copy"]  # no cast in between
    proj = record.recorder.calls_of(f"{mlp}.proj")
    assert proj and proj[0].inputs == [BF16]


# ----------------------------------------------------------------------------------------------------- Fabric
def _litgpt_model() -> torch.nn.Module:
    import litgpt

    config = litgpt.Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, padded_vocab_size=64,
                           block_size=16, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                           intermediate_size=64, rotary_percentage=1.0, parallel_residual=False)
    return litgpt.GPT(config)


def _fabric_steps(fabric: Fabric, model: Any, optimizer: Any, steps: int, seed: int = 0) -> list[HeavyOps]:
    generator = torch.Generator().manual_seed(seed)
    recorded = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 16), generator=generator)
        with HeavyOps() as mode:
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1))
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        recorded.append(mode)
    return recorded


@_needs("litgpt", "litgpt")
def test_litgpt_trains_under_a_plan_in_a_fabric_loop_and_the_plan_comes_back_from_a_fabric_checkpoint(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    plugin = CoMPFabricPrecision({"*": "bf16", "lm_head": "fp32"})
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(_litgpt_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    for recorded in _fabric_steps(fabric, model, optimizer, 3):
        assert recorded.attention() and all(set(d) == {BF16} for _, d in recorded.attention())
        matmuls = [d for n, d in recorded.ops if n in _MATMULS]
        assert sum(set(d) == {FP32} for d in matmuls) == 3  # lm_head: forward, and its two backward matmuls
        assert all(set(d) == {BF16} for d in matmuls if set(d) != {FP32})
    precisions = plugin.executor.precisions()
    assert precisions["attn" if "attn" in precisions else "transformer.h.0.attn"].value == "bf16"
    assert precisions["lm_head"].value == "fp32"
    assert all(p.dtype == FP32 and p.grad is None for p in model.parameters())  # fp32 masters (zeroed grads)
    state = {"model": model, "optimizer": optimizer, "comp": plugin}
    fabric.save(tmp_path / "fabric.ckpt", state)

    restored = CoMPFabricPrecision()  # no plan of its own: the checkpoint's comes back
    fabric2 = Fabric(accelerator="cpu", devices=1, plugins=[restored])
    model2 = fabric2.setup_module(_litgpt_model())
    optimizer2 = fabric2.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=1e-3))
    fabric2.load(tmp_path / "fabric.ckpt", {"model": model2, "optimizer": optimizer2, "comp": restored})
    assert restored.plan["compute"].entries == plugin.plan["compute"].entries and restored.optimizer_steps == 3
    _fabric_steps(fabric2, model2, optimizer2, 1, seed=1)
    assert restored.executor.precisions() == precisions


@_needs("litgpt", "litgpt")
def test_an_fp16_plan_in_fabric_scales_the_loss_and_skips_an_overflowing_step() -> None:
    torch.manual_seed(0)
    plugin = CoMPFabricPrecision({"type:Linear": "fp16"}, allow_slow_fp16=True)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup_module(_litgpt_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    _fabric_steps(fabric, model, optimizer, 1)
    assert plugin.scaler is not None and plugin.skipped_steps == 0
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 64, (2, 16))
    fabric.backward(model(tokens).float().sum() * float("inf"))  # every gradient overflows
    optimizer.step()
    assert plugin.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.slow
@_needs("litgpt", "litgpt")
def test_the_fabric_example_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.helpers.paths import REPO

    result = subprocess.run([sys.executable, str(REPO / "examples" / "fabric_litgpt.py"), "--steps", "3", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step   2" in result.stdout and "transformer.h.0.attn" in result.stdout
    assert (tmp_path / "fabric.ckpt").exists()
