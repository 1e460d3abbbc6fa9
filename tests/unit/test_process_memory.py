"""The peak one step needs: live heap peak, OS peak, degrading without /proc."""
from __future__ import annotations

import pytest
import torch

from lightning_comp.search.measurement import process_memory
from lightning_comp.search.measurement.process_memory import heap_in_use, measure_step_peak

SIZE = 64 * 2**20


def _big() -> None:
    x = torch.ones(SIZE // 4)
    y = x * 2
    del x, y


def _small() -> None:
    torch.ones(16) * 2


@pytest.mark.skipif(heap_in_use() is None, reason="needs glibc mallinfo2")
def test_live_peak_rises_by_the_tensor_and_os_peak_is_above_it() -> None:
    small = measure_step_peak(_small)
    big = measure_step_peak(_big)
    assert small.live_bytes is not None and big.live_bytes is not None
    assert big.live_bytes - small.live_bytes >= 2 * SIZE * 0.9
    assert big.os_bytes is not None and big.os_bytes >= big.live_bytes
    assert big.allocator_bytes == big.os_bytes - big.live_bytes
    assert big.reserved_bytes is None and big.allocated_bytes is None


def test_degrades_without_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setattr(process_memory, "PROC_STATUS", "/nonexistent/status")
    monkeypatch.setattr(process_memory, "PROC_CLEAR_REFS", "/nonexistent/clear_refs")
    peak = measure_step_peak(_big)
    assert peak.os_bytes is None
    assert "os: unavailable" in peak.how


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_reserved_is_at_least_allocated() -> None:
    peak = measure_step_peak(lambda: torch.ones(SIZE // 4, device="cuda") * 2, "cuda")
    assert peak.allocated_bytes is not None and peak.reserved_bytes is not None
    assert peak.reserved_bytes >= peak.allocated_bytes >= SIZE
