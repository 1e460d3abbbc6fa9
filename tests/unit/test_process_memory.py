"""The peak one step needs: live heap peak, OS peak, degrading without /proc."""
from __future__ import annotations

import pytest
import torch

from lightning_comp.search.measurement import process_memory
from lightning_comp.search.measurement.process_memory import StepPeakRecorder, heap_in_use, measure_step_peak

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


@pytest.mark.skipif(heap_in_use() is None, reason="needs glibc mallinfo2")
def test_the_recorder_measures_a_step_entered_and_left_from_different_hooks() -> None:
    """A training loop's step is not one callable: the recorder is entered at the batch's start and left at its end."""
    recorder = StepPeakRecorder()
    assert recorder.peak is None
    recorder.__enter__()
    _big()
    recorder.__exit__(None, None, None)
    small = measure_step_peak(_small)
    assert recorder.peak is not None and recorder.peak.live_bytes is not None and small.live_bytes is not None
    assert recorder.peak.live_bytes - small.live_bytes >= 2 * SIZE * 0.9


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


def test_step_timer_measures_each_configs_peak_under_that_config() -> None:
    from contextlib import contextmanager

    from lightning_comp.search.measurement.step_timing import StepTimer

    active: list[str] = []

    @contextmanager
    def config(name: str):  # type: ignore[no-untyped-def]
        active.append(name)
        yield
        active.pop()

    def step() -> None:
        (_big if active == ["big"] else _small)()

    peaks = StepTimer("cpu").step_peaks({"small": lambda: config("small"), "big": lambda: config("big")}, step)
    assert set(peaks) == {"small", "big"}
    if heap_in_use() is not None:
        assert peaks["big"].live_bytes is not None and peaks["small"].live_bytes is not None
        assert peaks["big"].live_bytes - peaks["small"].live_bytes >= 2 * SIZE * 0.9


def test_step_memory_round_trips_and_the_record_text_prints_the_process_peaks() -> None:
    from lightning_comp.common.typed_plain import from_plain, to_plain
    from lightning_comp.search.decisions.batch_result import StepMemory
    from lightning_comp.search.record.text import format_record

    memory = StepMemory(64, 3 * 2**20, reserved_bytes=4 * 2**20, live_bytes=10 * 2**20, os_bytes=12 * 2**20,
                        how="live: x; os: y")
    assert from_plain(StepMemory, to_plain(memory)) == memory
    text = format_record({"memory": {"fp32": {"saved_bytes": 64, "peak_bytes": memory.peak_bytes,
                                              "reserved_bytes": memory.reserved_bytes,
                                              "live_bytes": memory.live_bytes, "os_bytes": memory.os_bytes,
                                              "how": memory.how}}})
    assert "reserved 4.0 MiB" in text and "live peak 10.0 MiB" in text
    assert "OS peak 12.0 MiB (allocator adds 2.0 MiB)" in text


def test_held_tensor_bytes_counts_weights_gradients_and_state_once() -> None:
    from lightning_comp.search.measurement.process_memory import held_tensor_bytes

    model = torch.nn.Linear(100, 10)  # 1010 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    assert held_tensor_bytes(model, [optimizer]) == 1010 * 4  # no gradient, no state yet
    model(torch.ones(3, 100)).sum().backward()
    optimizer.step()
    # weights, gradients, two moments each, and the two scalar step counters
    assert held_tensor_bytes(model, [optimizer]) == 4 * 1010 * 4 + 2 * 4
    tied = torch.nn.Sequential(model, torch.nn.Linear(10, 10))
    tied[1].weight = torch.nn.Parameter(model.weight.data[:, :10])  # shares model.weight's storage
    assert held_tensor_bytes(tied, []) == 2 * 1010 * 4 + 10 * 4  # model's weights and grads, and the new bias


@pytest.mark.skipif(heap_in_use() is None, reason="needs glibc mallinfo2")
def test_the_tensor_peak_is_what_the_step_starts_with_plus_its_rise() -> None:
    from lightning_comp.search.measurement.step_timing import StepTimer

    held = torch.ones(SIZE // 4)  # held across the step: counted once, by what the step starts with
    peaks = StepTimer("cpu").step_peaks({"big": lambda: None, "small": lambda: None}, lambda: _big(),
                                        held=lambda: held.nbytes)
    peak = peaks["big"]
    assert peak.held_bytes == SIZE and peak.rise_bytes is not None
    # _big makes two SIZE tensors live at once: its rise is about 2 SIZE, however large the interpreter's heap
    assert 2 * SIZE * 0.95 <= peak.rise_bytes <= 2 * SIZE * 1.05
    assert peak.tensor_bytes == SIZE + peak.rise_bytes
    assert peak.live_bytes is not None and peak.live_bytes > peak.tensor_bytes  # the heap holds more than tensors
    assert measure_step_peak(_big).tensor_bytes is None  # nothing said what the step starts with
