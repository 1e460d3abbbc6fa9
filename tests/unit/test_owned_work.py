"""Operators found by tracing: modules computing between their children, their own work lowered, their children's
plan entries held inside them, the floating-point work counted, and the warning about work left unplanned."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_comp import PlanMismatchError, PrecisionPlan
from lightning_comp.execution.executor import PlanExecutor, StepKind
from lightning_comp.execution.unplanned_work import unplanned_work
from lightning_comp.numerics import ComputePrecision
from lightning_comp.operators import OperatorKind, discover_operators
from lightning_comp.operators.owned_work import OUTSIDE, WorkRecorder
from tests.helpers.recording import DtypeRecorder

BF16, FP32 = torch.bfloat16, torch.float32


class _Attention(nn.Module):
    """An attention block as modern model code writes it: SDPA and an einsum between its projections."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal=True).squeeze(1)
        scores = torch.einsum("btd,bsd->bts", y, y)
        return self.proj(self.drop(scores.softmax(-1) @ y))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()
        self.unused = nn.ModuleList()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _step(executor: PlanExecutor, model: nn.Module, x: torch.Tensor, recorder: DtypeRecorder | None = None) -> None:
    with executor.step(StepKind.TRAIN):
        if recorder is None:
            model(x).float().square().mean().backward()
        else:
            with recorder:
                model(x).float().square().mean().backward()


def test_a_container_computing_between_its_children_becomes_an_operator_and_an_empty_list_none() -> None:
    model = _Model()
    assert [i.name for i in discover_operators(model)] == ["attn.qkv", "attn.proj", "attn.drop", "head"]
    with WorkRecorder(model) as recorder:
        model(torch.randn(2, 5, 8)).sum().backward()
    infos = {i.name: i for i in discover_operators(model)}
    assert list(infos) == ["attn", "attn.qkv", "attn.proj", "attn.drop", "head"]  # the container before its children
    assert infos["attn"].kind is OperatorKind.FUNCTIONAL and infos["attn"].type_name == "_Attention"
    owned = dict(recorder.work.by_module["attn"].ops)
    assert owned["bmm"] == 2 and any(op.startswith("_scaled_dot_product") for op in owned)  # einsum, @, SDPA
    assert dict(recorder.work.by_module["attn.qkv"].ops) == {"addmm": 1}  # the children's work stays theirs


def test_flops_are_counted_per_owner_by_formula() -> None:
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 5)  # addmm: 2 * (7*3) * 5
            self.conv = nn.Conv1d(2, 4, 3)  # conv: 2 * out(1*4*8) * (2*3)
            self.w = nn.Parameter(torch.randn(5, 6))

        def forward(self, x: torch.Tensor, signal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = torch.randn(1, 2, 4, 8)
            a = F.scaled_dot_product_attention(q, q, q)  # 2 * (1*2) * 4 * 4 * (8 + 8)
            return self.lin(x) @ self.w + a.sum(), self.conv(signal)  # mm: 2 * (7*5) * 6

    model = Functional()
    with WorkRecorder(model) as recorder:
        model(torch.randn(7, 3), torch.randn(1, 2, 10))
    flops = {name: work.flops for name, work in recorder.work.by_module.items()}
    assert flops == {"": 2 * 7 * 5 * 6 + 2 * 2 * 4 * 4 * 16, "lin": 2 * 21 * 5, "conv": 2 * 32 * 6}
    assert recorder.work.total_flops == sum(flops.values())


def test_work_outside_every_module_is_its_own_owner() -> None:
    model = nn.Linear(4, 4)
    with WorkRecorder(model) as recorder:
        model(torch.randn(2, 4)) @ torch.randn(4, 3)
    assert recorder.work.by_module[OUTSIDE].flops == 2 * 8 * 3


def test_all_bf16_lowers_the_containers_own_work_from_the_first_step(dtype_recorder: DtypeRecorder) -> None:
    model = _Model()
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({}, default="bf16"))
    dtype_recorder.attach(model)
    x = torch.randn(2, 5, 8)
    for _ in range(3):  # tracing (provisional operators), calibrating, chained
        dtype_recorder.clear()
        _step(executor, model, x, dtype_recorder)
        heavy = [r for r in dtype_recorder.ops if r.op in ("addmm", "mm", "bmm") or r.op.startswith("_scaled_dot")]
        assert heavy and all(set(r.inputs[:3]) == {BF16} for r in heavy), [(r.module, r.op, r.inputs) for r in heavy]
    assert executor.precisions()["attn"] is ComputePrecision.BF16  # the container's own work, an operator of the plan
    assert "attn.qkv" in executor.chained_operators(StepKind.TRAIN)  # consumed by the bf16 attention's own work


def test_children_keep_their_entries_inside_a_lowered_container(dtype_recorder: DtypeRecorder) -> None:
    model = _Model()
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({"attn": "bf16"}))  # its projections stay fp32 (the default)
    dtype_recorder.attach(model)
    x = torch.randn(2, 5, 8)
    for _ in range(2):
        dtype_recorder.clear()
        _step(executor, model, x, dtype_recorder)
        assert all(r.inputs == [FP32] * 3 for r in dtype_recorder.ops_of("attn.qkv", "addmm"))
        assert all(r.inputs == [FP32] * 3 for r in dtype_recorder.ops_of("attn.proj", "addmm"))
        own = [r for r in dtype_recorder.ops_of("attn", "bmm") + dtype_recorder.ops_of("attn")
               if r.op == "bmm" or r.op.startswith("_scaled_dot")]
        assert own and all(r.inputs[0] == BF16 for r in own)
    # and the other way round: an fp32 container with bf16 children
    model = _Model()
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({"attn.qkv": "bf16", "attn.proj": "bf16"}))
    recorder = DtypeRecorder().attach(model)
    for _ in range(2):
        recorder.clear()
        _step(executor, model, x, recorder)
        assert all(r.inputs[1:] == [BF16, BF16] for r in recorder.ops_of("attn.qkv", "addmm"))
        own = [r for r in recorder.ops_of("attn") if r.op == "bmm" or r.op.startswith("_scaled_dot")]
        assert own and all(set(r.inputs[:3]) == {FP32} for r in own)


def test_a_linear_only_plan_leaves_attention_in_fp32_and_says_so() -> None:
    model = _Model()
    executor = PlanExecutor()
    plan = executor.apply(model, PrecisionPlan.from_dict({"type:Linear": "bf16"}))
    _step(executor, model, torch.randn(2, 5, 8))
    assert executor.work is not None
    report = unplanned_work(executor.work, executor.plan or plan, model, executor.precisions(), by_default=True)
    assert report.by_default and report.by_default[0][:2] == ("attn", "_Attention")
    assert report.share > 0.05
    message = report.message()
    assert "attn (_Attention," in message and "'type:_Attention': 'bf16'" in message
    # a search's plan decides every operator on purpose: only work outside every operator is reported for it
    assert unplanned_work(executor.work, plan, model, executor.precisions(), by_default=False).share == 0.0


def test_an_entry_naming_a_container_that_computes_nothing_fails_after_the_trace() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    executor = PlanExecutor()
    executor.apply(model, PrecisionPlan.from_dict({"0": "bf16"}))  # may compute between its children: waits
    with pytest.raises(PlanMismatchError, match=r"1 plan entry matches no operator of Sequential: '0'"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(executor, model, torch.randn(3, 4))
