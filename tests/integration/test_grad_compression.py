"""Tests for half-precision gradient communication (in-process gloo group, plus a 2-process Lightning DDP run)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_comp.distributed.grad_compression import (
    CommStats,
    GradCommDtype,
    HalfPrecisionDDPStrategy,
    bf16_compress_hook_any_backend,
    counting_comm_hook,
    half_precision_ddp_strategy,
)
from lightning_comp.errors import ConfigError
from tests.helpers.paths import REPO

# ---------------------------------------------------------------------------------------------- dtype parsing


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("bf16", GradCommDtype.BF16),
        ("BFloat16", GradCommDtype.BF16),
        (torch.bfloat16, GradCommDtype.BF16),
        ("fp16", GradCommDtype.FP16),
        ("16", GradCommDtype.FP16),
        (torch.float16, GradCommDtype.FP16),
        ("fp32", GradCommDtype.FP32),
        (GradCommDtype.FP32, GradCommDtype.FP32),
    ],
)
def test_parse_dtype(value: Any, expected: GradCommDtype) -> None:
    assert GradCommDtype.parse(value) is expected


@pytest.mark.parametrize("value", ["int8", "fp8", torch.float64, 16])
def test_parse_dtype_rejects_unknown(value: Any) -> None:
    valid = r"(valid gradient communication dtypes are 'fp32', 'bf16' and 'fp16'|valid dtypes are torch.float32)"
    with pytest.raises(ConfigError, match=rf"gradient communication dtype.*{valid}"):
        GradCommDtype.parse(value)


def test_strategy_construction() -> None:
    strategy = half_precision_ddp_strategy("fp16", measure=True, find_unused_parameters=True)
    assert isinstance(strategy, HalfPrecisionDDPStrategy)
    assert strategy.grad_dtype is GradCommDtype.FP16
    assert strategy.comm_stats == CommStats()
    assert half_precision_ddp_strategy().comm_stats is None
    with pytest.raises(ValueError, match="ddp_comm_wrapper=.*cannot be combined"):
        HalfPrecisionDDPStrategy(ddp_comm_wrapper=default_hooks.fp16_compress_wrapper)


# ---------------------------------------------------------------------------------------------- single-process gloo


@pytest.fixture
def gloo_world_of_one() -> Iterator[None]:
    """A real gloo process group of size 1 in this process (no network, no ports)."""
    if dist.is_initialized():
        pytest.skip("another test left a process group initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_grads(hook: Any | None, stats: CommStats | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3)))
    if hook is not None:
        model.register_comm_hook(None, counting_comm_hook(hook, stats) if stats is not None else hook)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.zero_grad()
        model(x).square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.usefixtures("gloo_world_of_one")
@pytest.mark.parametrize(
    ("hook", "dtype", "ratio"),
    [
        (default_hooks.allreduce_hook, "float32", 1.0),
        (default_hooks.fp16_compress_hook, "float16", 0.5),
        (bf16_compress_hook_any_backend, "bfloat16", 0.5),
    ],
)
def test_counting_hook_measures_payload(hook: Any, dtype: str, ratio: float) -> None:
    n_params = 16 * 32 + 32 + 32 * 3 + 3
    stats = CommStats()
    grads = _ddp_grads(hook, stats)
    assert stats.steps == 2
    assert stats.grad_bytes == 2 * n_params * 4
    assert stats.sent_bytes == 2 * n_params * 4 * ratio
    assert stats.bytes_per_step == n_params * 4 * ratio
    assert stats.compression_ratio == ratio
    assert stats.sent_dtypes == {dtype}
    assert stats.comm_seconds >= stats.hook_seconds > 0
    reference = _ddp_grads(None)
    tol = 0.0 if ratio == 1.0 else 1e-2
    for g, r in zip(grads, reference, strict=True):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol * 1e-2)
    stats.reset()
    assert stats == CommStats()


@pytest.mark.usefixtures("gloo_world_of_one")
def test_torch_rejects_bf16_hook_by_name_off_cuda() -> None:
    # Why the renamed delegate exists: DDP refuses `bf16_compress_hook` without CUDA+NCCL, though gloo reduces bf16.
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    with pytest.raises(TypeError, match="BF16 all reduce communication hook required"):
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    probe = torch.ones(3, dtype=torch.bfloat16)
    dist.all_reduce(probe)
    assert probe.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.usefixtures("gloo_world_of_one")
def test_backend_probe_failure_is_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = HalfPrecisionDDPStrategy("bf16", parallel_devices=[torch.device("cpu")])

    def unsupported(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Invalid scalar type")

    monkeypatch.setattr(dist, "all_reduce", unsupported)
    with pytest.raises(RuntimeError, match=r"'gloo'.*cannot all-reduce torch.bfloat16.*grad_dtype='fp16'"):
        strategy._check_backend_supports(GradCommDtype.BF16)


# ---------------------------------------------------------------------------------------------- 2 processes

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.data import DataLoader, TensorDataset
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from lightning_comp.distributed.grad_compression import CommStats, counting_comm_hook, half_precision_ddp_strategy

    ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2}

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g))
    n_params = sum(p.numel() for p in Tiny().parameters())
    results = {}
    for name in ["lightning_ddp_comm_hook", "fp32", "bf16", "fp16"]:
        torch.manual_seed(0)
        if name == "lightning_ddp_comm_hook":
            stats = CommStats()
            strategy = DDPStrategy(ddp_comm_hook=counting_comm_hook(allreduce_hook, stats))
        else:
            strategy = half_precision_ddp_strategy(name, measure=True)
            stats = strategy.comm_stats
        model = Tiny()
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            trainer.fit(model, DataLoader(data, batch_size=8))
        profiled = 0  # independent count: gradient-sized all-reduces seen by the profiler
        for event in prof.events():
            if event.name == "gloo:all_reduce" and event.input_shapes and event.input_shapes[0] == [n_params]:
                profiled += n_params * ITEMSIZE[event.input_dtypes[0]]
        results[name] = stats.as_dict() | {
            "profiled_bytes": profiled,
            "params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
        }
    results["n_params"] = n_params
    if torch.distributed.is_initialized():  # Lightning leaves gloo groups to interpreter shutdown, which can abort
        torch.distributed.destroy_process_group()
    with open(f"{sys.argv[1]}.rank{os.environ.get('LOCAL_RANK', '0')}.json", "w") as f:
        json.dump(results, f)
    """
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run the 4 DDP configurations once in 2 gloo processes (Lightning's own popen launcher)."""
    tmp = tmp_path_factory.mktemp("ddp")
    script = tmp / "ddp_bytes.py"
    script.write_text(_SCRIPT)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp / "out")],
        env=env,
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp / f"out.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_half_precision_hook_halves_bytes_per_step(two_rank_results: list[dict[str, Any]]) -> None:
    for rank in two_rank_results:
        fp32_bytes = rank["n_params"] * 4
        assert rank["fp32"]["steps"] == 4
        assert rank["fp32"]["bytes_per_step"] == fp32_bytes
        assert rank["fp32"]["sent_dtypes"] == ["float32"]
        for name, dtype in [("bf16", "bfloat16"), ("fp16", "float16")]:
            assert rank[name]["steps"] == 4
            assert rank[name]["sent_dtypes"] == [dtype]
            assert rank[name]["bytes_per_step"] == fp32_bytes / 2
            assert rank[name]["compression_ratio"] == 0.5
        for name in ["fp32", "bf16", "fp16"]:  # the profiler saw exactly what the counter recorded
            assert rank[name]["profiled_bytes"] == rank[name]["sent_bytes"], name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_lightning_drops_comm_hook_on_cpu(two_rank_results: list[dict[str, Any]]) -> None:
    # Plain DDPStrategy(ddp_comm_hook=...) never calls the hook on CPU (Lightning 2.6 registers it for CUDA only);
    # this is what HalfPrecisionDDPStrategy fixes. If this starts failing, Lightning changed that behaviour.
    for rank in two_rank_results:
        assert rank["lightning_ddp_comm_hook"]["buckets"] == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_agree_and_half_precision_stays_close(two_rank_results: list[dict[str, Any]]) -> None:
    rank0, rank1 = two_rank_results
    for name in ["fp32", "bf16", "fp16"]:
        assert rank0[name]["params"] == rank1[name]["params"], f"{name}: ranks diverged"
    fp32 = torch.tensor(rank0["fp32"]["params"])
    assert torch.tensor(rank0["lightning_ddp_comm_hook"]["params"]).equal(fp32)
    for name in ["bf16", "fp16"]:
        torch.testing.assert_close(torch.tensor(rank0[name]["params"]), fp32, rtol=0, atol=2e-3)
