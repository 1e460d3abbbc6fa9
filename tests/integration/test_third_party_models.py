"""Models nobody here wrote: Hugging Face GPT-2 and Llama, a torchvision ResNet: trained under CoMP unchanged.

Each test needs its library (extras ``[hf]``/``[vision]``) and is skipped, saying why, where it is absent or cannot
be imported beside this torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_comp import CoMPPrecision, CoMPSearch, PrecisionPlan
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.operators import OperatorKind, discover_operators
from lightning_comp.zoo import HFGPT2, CharTextDataModule, LitGPT, ShapesDataModule, TorchvisionResNet, XTransformerLM
from tests.helpers.recording import DtypeRecorder


def _importable(module: str) -> str | None:
    """``None`` if ``module`` imports, else why not (a torchvision built for another torch raises RuntimeError)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure to import means: skip, and say why
        return f"{module} cannot be imported here ({type(error).__name__}: {str(error)[:120]})"
    return None


needs_hf = pytest.mark.skipif(_importable("transformers") is not None,
                              reason=str(_importable("transformers")) + "; install the [hf] extra")
needs_vision = pytest.mark.skipif(_importable("torchvision") is not None,
                                  reason=str(_importable("torchvision")) + "; install the [vision] extra")


def _gpt2() -> HFGPT2:
    torch.manual_seed(0)
    return HFGPT2(width=64, depth=2, heads=2, block_size=64)


def _text() -> CharTextDataModule:
    return CharTextDataModule(seq_len=64, num_samples=256, batch_size=16)


def _resnet() -> TorchvisionResNet:
    torch.manual_seed(0)
    return TorchvisionResNet(small_images=False)


def _shapes() -> ShapesDataModule:
    return ShapesDataModule(num_samples=320, batch_size=32)


def _trainer(tmp_path: Path, plugin: CoMPPrecision, callbacks: list[Any] | None = None, **kwargs: Any) -> pl.Trainer:
    kwargs.setdefault("max_epochs", 1)
    kwargs.setdefault("limit_train_batches", 4)
    kwargs.setdefault("limit_val_batches", 2)
    return pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], callbacks=callbacks, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=str(tmp_path), **kwargs)


def test_a_missing_library_is_named_with_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake(name: str, *args: Any) -> Any:
        if name.startswith(("transformers", "torchvision", "litgpt", "x_transformers")):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r'transformers is not installed.*pip install "lightning-comp\[hf\]"'):
        HFGPT2()
    with pytest.raises(ImportError, match=r'litgpt is not installed.*"lightning-comp\[litgpt\]"'):
        LitGPT()
    with pytest.raises(ImportError, match=r'x_transformers is not installed.*"lightning-comp\[xtransformers\]"'):
        XTransformerLM()
    with pytest.raises(ImportError, match=r'torchvision.models is not installed.*"lightning-comp\[vision\]"'):
        TorchvisionResNet()


# ----------------------------------------------------------------------------------------------------- GPT-2
@needs_hf
def test_gpt2_heavy_operators_are_found_conv1d_and_attention_included() -> None:
    model = _gpt2()
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan(), "cpu")
    with executor.step(StepKind.TRAIN):  # the first step traces the work each module does itself
        model(torch.randint(0, 256, (2, 16)))
    operators = {info.name: info for info in discover_operators(model)}
    compute = {name for name, info in operators.items() if info.kind is OperatorKind.COMPUTE}
    blocks = [f"gpt2.transformer.h.{i}" for i in range(2)]
    # Conv1D is not an nn.Linear but computes as one
    assert compute == {"gpt2.lm_head", *(f"{b}.{p}" for b in blocks for p in ("attn.c_attn", "attn.c_proj",
                                                                             "mlp.c_fc", "mlp.c_proj"))}
    # GPT2Attention calls sdpa between its projections: an operator for that work, its children operators too
    assert {n for n, i in operators.items() if i.kind is OperatorKind.FUNCTIONAL} == {f"{b}.attn" for b in blocks}
    assert operators[f"{blocks[0]}.mlp.c_fc"].type_name == "Conv1D"
    assert {operators[f"{b}.ln_1"].kind for b in blocks} == {OperatorKind.NORM}
    assert operators["gpt2.transformer.wte"].kind is OperatorKind.EMBEDDING


@needs_hf
def test_gpt2_computes_each_heavy_operator_in_bf16_under_an_all_bf16_plan() -> None:
    model = _gpt2()
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({}, default="bf16"), "cpu")
    recorder = DtypeRecorder()
    recorder.attach(model)
    with executor.step(StepKind.TRAIN), recorder:  # the first step: the attention's own work is already planned
        model(torch.randint(0, 256, (2, 64)))
    recorder.detach()
    block = "gpt2.transformer.h.0"
    for name in (f"{block}.mlp.c_fc", f"{block}.mlp.c_proj", f"{block}.attn.c_attn", f"{block}.attn.c_proj",
                 "gpt2.lm_head"):
        matmuls = recorder.ops_of(name, "addmm", "mm", "linear", "matmul")
        assert matmuls and all(r.outputs == [torch.bfloat16] for r in matmuls), name
    products = [r for r in recorder.ops_of(f"{block}.attn") if r.op.startswith("_scaled_dot_product")]
    assert products and all(r.outputs[0] == torch.bfloat16 for r in products)


@needs_hf
def test_a_llama_mlps_gated_product_computes_in_bf16_between_its_bf16_projections() -> None:
    """Hugging Face's ``LlamaMLP`` multiplies ``act_fn(gate_proj(x)) * up_proj(x)`` in its own forward: under an
    all-bf16 plan the product runs in bf16 and its inputs stay bf16 (no cast back to FP32 between operators)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({}, default="bf16"), "cpu")
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(2):  # the first step traces the modules' own work, the second calibrates the cast boundaries
        with executor.step(StepKind.TRAIN):
            model(input_ids=tokens, labels=tokens).loss.backward()
    mlp = "model.layers.0.mlp"
    assert {f"{mlp}.gate_proj", f"{mlp}.up_proj", f"{mlp}.act_fn"} <= executor.chained_operators(StepKind.TRAIN)
    recorder = DtypeRecorder()
    recorder.attach(model, (mlp, f"{mlp}.gate_proj", f"{mlp}.up_proj", f"{mlp}.act_fn", f"{mlp}.down_proj"))
    with executor.step(StepKind.TRAIN), recorder:
        model(input_ids=tokens, labels=tokens)
    recorder.detach()
    products = recorder.ops_of(mlp, "mul")
    assert products and all(r.inputs == [torch.bfloat16] * 2 and r.outputs == [torch.bfloat16] for r in products)
    assert not recorder.ops_of(mlp, "_to_copy")  # nothing cast between the projections


@pytest.mark.slow
@needs_hf
def test_gpt2_search_chooses_a_plan_that_round_trips_and_resumes(tmp_path: Path) -> None:
    """The search on GPT-2 as shipped: candidates pinned to its compute operators (convergence is what is tested
    here, not whether BF16 pays on this CPU); the plan is written to the checkpoint, to a file, and read back."""
    search = CoMPSearch(low_precision="bf16", include=["type:Conv1D", "type:GPT2Attention", "gpt2.lm_head"],
                        exclude=["type:LayerNorm", "type:Embedding", "type:Dropout", "type:NewGELUActivation"],
                        tolerance=0.05, measurement={"profile_steps": 1}, max_trials=3, verbose=False)
    trainer = _trainer(tmp_path, CoMPPrecision(), [search], max_epochs=4, enable_checkpointing=True)
    trainer.fit(_gpt2(), datamodule=_text())
    assert search.phase == "done" and search.chosen_plan is not None
    record = search.record
    assert record is not None and record["trials"]
    lowered = {n for n, p in search.chosen_plan["compute"].entries if p.value == "bf16"}
    assert lowered, record["trials"]  # a 2-layer GPT-2 at 4 steps per trial converges in bf16
    path = search.chosen_plan.save(tmp_path / "gpt2_plan.json")
    loaded = PrecisionPlan.load(path)
    assert loaded["compute"].entries == search.chosen_plan["compute"].entries
    again = CoMPPrecision(path)
    _trainer(tmp_path, again, limit_val_batches=0).fit(_gpt2(), datamodule=_text())
    assert {n for n, p in again.executor.precisions().items() if p.value == "bf16"} >= lowered
    ckpt = trainer.checkpoint_callback.best_model_path or trainer.checkpoint_callback.last_model_path
    resumed_plugin, resumed_search = CoMPPrecision(), CoMPSearch(verbose=False)
    _trainer(tmp_path, resumed_plugin, [resumed_search], max_epochs=5).fit(_gpt2(), datamodule=_text(),
                                                                           ckpt_path=ckpt)
    assert resumed_search.phase == "done" and resumed_plugin.plan["compute"] == search.chosen_plan["compute"]


# --------------------------------------------------------------------------------------------------- ResNet
@needs_vision
def test_resnet_heavy_operators_are_found_and_lowered() -> None:
    model = _resnet()
    operators = discover_operators(model)
    convs = [i for i in operators if i.type_name == "Conv2d"]
    assert len(convs) == 20 and all(i.kind is OperatorKind.COMPUTE for i in convs)  # resnet18: 17 + 3 downsample
    PlanExecutor().apply(model, PrecisionPlan.from_dict({}, default="bf16"), "cpu")
    recorder = DtypeRecorder()
    recorder.attach(model)
    with recorder:
        model(torch.randn(2, 3, 32, 32))
    recorder.detach()
    for info in convs:
        ops = recorder.ops_of(info.name, "convolution", "mkldnn_convolution", "_convolution", "conv2d")
        assert ops and all(r.outputs == [torch.bfloat16] for r in ops), info.name
    relu = recorder.calls_of("resnet.layer1.0.relu")
    assert len(relu) == 2  # one ReLU module, called twice per block: both calls run under the plan


@needs_vision
def test_resnet_search_chooses_a_plan_that_round_trips(tmp_path: Path) -> None:
    search = CoMPSearch(low_precision="bf16", include=["type:Conv2d", "resnet.fc"],
                        exclude=["type:BatchNorm2d", "type:ReLU", "type:MaxPool2d", "type:AdaptiveAvgPool2d"],
                        tolerance=0.1, measurement={"profile_steps": 1}, max_trials=3, verbose=False)
    _trainer(tmp_path, CoMPPrecision(), [search], max_epochs=4).fit(_resnet(), datamodule=_shapes())
    assert search.phase == "done" and search.chosen_plan is not None
    path = search.chosen_plan.save(tmp_path / "resnet_plan.json")
    assert PrecisionPlan.load(path)["compute"] == search.chosen_plan["compute"]


@pytest.mark.slow
@needs_hf
def test_gpt2_traces_under_a_plan_into_one_graph() -> None:
    """Compiled, the all-bf16 plan adds no graph break to GPT-2 (Dynamo traces Conv1D, the attention and the hooks)."""
    from tests.helpers.compile import graph_breaks

    model, tokens = _gpt2(), torch.randint(0, 256, (2, 64))
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({}, default="bf16"), "cpu", compiled=True)
    for _ in range(2):  # traces the model's own work, then calibrates cast boundaries (both eagerly)
        with executor.step(StepKind.TRAIN):
            model(tokens)
    with executor.step(StepKind.TRAIN):
        graphs, breaks, reasons = graph_breaks(model, tokens)
    assert (graphs, breaks) == (1, 0), reasons


def test_litgpt_and_x_transformers_settings_are_checked() -> None:
    if _importable("litgpt") is None:
        with pytest.raises(ValueError, match=r"LitGPT\(width=30, heads=4, query_groups=2\)"):
            LitGPT(width=30)
        with pytest.raises(ValueError, match=r"experts=1, experts_per_token=2"):
            LitGPT(experts=1)
    if _importable("x_transformers") is None:
        with pytest.raises(ValueError, match=r"XTransformerLM\(width=30, heads=4\)"):
            XTransformerLM(width=30)
