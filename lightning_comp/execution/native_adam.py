"""The native update: Adam(W)'s step of the managed parameters as one C loop, on a CPU, for every state format.

The compiled update (:mod:`lightning_comp.execution.update_path`) runs the 8-bit step as the kernels ``torch.compile``
generates: four passes over the whole parameter (decode and Adam, each moment's block scales, each moment's codes)
with the new moments written to memory in FP32 between them, and some 0.3 ms of Python and guards per call. Here
the same arithmetic (:func:`~lightning_comp.execution.fused_adam.step_8bit_moments`'s, operation for operation) runs
block by block in ``native_adam.c``: a block's 256 new moments stay in the core's cache from the decode to their
codes, and a call costs a few microseconds. Measured on 2 AMD EPYC cores (AVX2) at 1 Mi elements (2026-12-07,
``benchmarks/update_kernel.py``, side by side): 2.04 ns per parameter against 6.16 compiled and 1.55 for
``torch.optim.AdamW``'s own FP32 step (``docs/benchmark.md``, "Memory at speed, eleventh pass"); with the codes
encoded in AVX2 (the C file says where), 0.98x AdamW's step at 1 Mi and 0.61x at 4 Mi, against 1.43x and 1.01x
before (a loaded machine; "fourteenth pass").

Codes are decoded through the map's own 256 values (:func:`~lightning_comp.numerics.block_quant.value_map`, as the
eager step does: exact) and encoded by :mod:`~lightning_comp.numerics.dynamic_codec`'s arithmetic, whose constants
(:func:`~lightning_comp.numerics.dynamic_codec.encoding_table`) are passed in. BF16 weights (stochastically rounded
masters) are rounded from :func:`~lightning_comp.numerics.stochastic_rounding.round_to_bf16_hashed`'s hash of the same
key and element index, so the native and compiled steps draw the same random bits.

Moments held as FP32 or BF16 tensors (``state="bf16"``, and tensors too small to quantise) take the same Adam(W)
element by element (:func:`~lightning_comp.execution.fused_adam.step_fp32_moments`'s and ``step_bf16_moments``'s
arithmetic), BF16 moments rounded stochastically from the weights' key plus each moment's stream offset, as the
compiled step rounds them. The library is built on first use (:mod:`lightning_comp.execution.native_build`); it covers
CPU tensors only (CUDA runs the compiled step).

Every parameter an optimizer step manages goes into one call (:meth:`NativeAdam.step`; the plugin makes one per
step), each with its own format, hyper-parameters (its group's, its own step count's bias corrections) and rounding
key: their units of 4096 elements (16 blocks of 8-bit codes) are shared among torch's threads in one parallel region,
eight at a time as threads come free, so small tensors share the threads too (32 tensors of 16 K elements, 8-bit, 2
AVX2 cores: 2.54 ms a step against 5.15 in a call each, one thread each; ``benchmarks/update_kernel.py --tensors
32``), a step pays for one region, and a thread that other work on the machine holds up takes fewer units. Bit for
bit what a call per parameter gives (``tests/unit/test_native_adam.py``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from lightning_comp.errors import ConfigError
from lightning_comp.execution import fused_adam
from lightning_comp.execution.native_build import NativeLibrary, load_library
from lightning_comp.numerics import block_quant
from lightning_comp.numerics.dynamic_codec import encoding_table

__all__ = ["GRAIN_SIZE", "SOURCE", "NativeAdam", "NativeStep", "NativeTensor", "native_adam"]

SOURCE = Path(__file__).with_name("native_adam.c")
"""The C source of the step."""

GRAIN_SIZE = 32768
"""Steps of fewer elements (all their tensors together) run on one thread (ATen's grain size for element-wise
work)."""

_BF16_WEIGHTS, _BF16_MOMENTS, _STOCHASTIC, _PACKED = 1, 2, 4, 8  # NativeTensor.flags, as native_adam.c defines them


class NativeTensor(ctypes.Structure):
    """One parameter of a native step, as ``native_adam.c``'s ``Tensor`` lays it out."""

    _fields_ = [("weights", ctypes.c_void_p), ("grad", ctypes.c_void_p), ("exp_avg", ctypes.c_void_p),
                ("exp_avg_sq", ctypes.c_void_p), ("numel", ctypes.c_int64),
                ("hyper", ctypes.c_float * len(fused_adam.HYPER_PARAMETERS)), ("key", ctypes.c_uint32),
                ("flags", ctypes.c_int32)]


class NativeStep(NamedTuple):
    """One parameter's step, as :meth:`NativeAdam.step` takes it.

    Attributes:
        p: the weights, FP32 or BF16, contiguous (updated in place).
        grad: their gradient, of the same dtype and layout.
        exp_avg: the first moment: a packed 8-bit tensor (:func:`~lightning_comp.numerics.block_quant.pack`; ``p``
            then holds a whole number of blocks) or a contiguous FP32 or BF16 tensor of ``p``'s shape.
        exp_avg_sq: the second moment, in the same format.
        hyper: the step's hyper-parameters, in the order of
            :data:`~lightning_comp.execution.fused_adam.HYPER_PARAMETERS`.
        stochastic: whether BF16 weights are rounded stochastically from ``key`` (else to nearest).
        key: the rounding key (:func:`~lightning_comp.numerics.stochastic_rounding.rounding_key`); BF16 moments are
            rounded from its moment streams.
    """

    p: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    hyper: tuple[float, ...]
    stochastic: bool
    key: int


class NativeAdam:
    """Steps managed CPU parameters through the built C function.

    Raises (at construction):
        NativeBuildError: if the source cannot be built or loaded here.
    """

    def __init__(self) -> None:
        self.build: NativeLibrary = load_library(SOURCE)
        pointer = ctypes.c_void_p
        self._steps = self.build.library.lc_adam_steps
        self._steps.restype = ctypes.c_int
        self._steps.argtypes = [ctypes.POINTER(NativeTensor), ctypes.c_int, pointer, pointer, pointer, pointer,
                                ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int]
        self._encode = self.build.library.lc_encode_blocks
        self._encode.restype = ctypes.c_int
        self._encode.argtypes = [pointer, ctypes.c_int64, pointer, pointer, ctypes.c_int, ctypes.c_int, pointer]
        self.vector_encode: bool = bool(self.build.library.lc_vector_encode())
        """Whether this build encodes 8-bit codes with vector instructions (AVX2 without AVX-512), else by the
        portable loops."""
        cpu = torch.device("cpu")
        self._maps = {signed: block_quant.value_map(signed, cpu).contiguous() for signed in (True, False)}
        tables = {signed: encoding_table(signed) for signed in (True, False)}
        self._tables = {signed: (ctypes.c_float * len(table))(*table) for signed, table in tables.items()}

    def _threads(self, numel: int) -> int:
        """Threads for a step of ``numel`` elements in all: torch's count from :data:`GRAIN_SIZE` elements on, else
        one (a parallel region costs more than it shares below that, and much more on a busy machine, where the
        region waits for its slowest thread)."""
        return torch.get_num_threads() if self.build.threaded and numel >= GRAIN_SIZE else 1

    @staticmethod
    def covers(p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether the native step applies to ``p`` (on a CPU, FP32 or BF16, contiguous, its gradient alike)."""
        return (p.device.type == "cpu" and p.dtype in (torch.float32, torch.bfloat16) and grad.dtype == p.dtype
                and p.is_contiguous() and grad.is_contiguous() and grad.device == p.device)

    def step(self, steps: Sequence[NativeStep]) -> None:
        """One step of every parameter in ``steps`` (each as :class:`NativeStep` describes it), in one call: their
        work is shared among torch's threads as one region (one thread under :data:`GRAIN_SIZE` elements in all)."""
        tensors = (NativeTensor * len(steps))()
        total = 0
        for slot, one in zip(tensors, steps):
            numel = one.p.numel()
            packed = one.exp_avg.dtype == torch.uint8
            slot.weights, slot.grad = one.p.data_ptr(), one.grad.data_ptr()
            slot.exp_avg, slot.exp_avg_sq = one.exp_avg.data_ptr(), one.exp_avg_sq.data_ptr()
            slot.numel, slot.key = numel, one.key & 0xFFFFFFFF
            slot.hyper[:] = one.hyper
            slot.flags = ((_BF16_WEIGHTS if one.p.dtype == torch.bfloat16 else 0)
                          | (_BF16_MOMENTS if one.exp_avg.dtype == torch.bfloat16 else 0)
                          | (_STOCHASTIC if one.stochastic else 0) | (_PACKED if packed else 0))
            total += numel
        self._steps(tensors, len(steps), self._maps[True].data_ptr(), self._maps[False].data_ptr(),
                    ctypes.addressof(self._tables[True]), ctypes.addressof(self._tables[False]),
                    fused_adam.EXP_AVG_STREAM, fused_adam.EXP_AVG_SQ_STREAM, self._threads(total))

    def encode(self, blocks: torch.Tensor, scales: torch.Tensor, signed: bool, *, portable: bool = False
               ) -> torch.Tensor:
        """The codes the step writes for ``blocks`` (FP32, ``(n, 256)``) divided by their ``scales`` (FP32, ``(n,)``),
        with the signed map's table or the unsigned one's: by the loops the step uses, or by the portable ones
        (``portable``; the same where :attr:`vector_encode` is False). For checking the two against each other and
        against :func:`~lightning_comp.numerics.dynamic_codec.encode`.

        Raises:
            ConfigError: if the shapes or dtypes are not those above.
        """
        if blocks.dtype != torch.float32 or blocks.dim() != 2 or blocks.shape[1] != block_quant.BLOCK_SIZE \
                or scales.dtype != torch.float32 or scales.shape != (blocks.shape[0],):
            raise ConfigError(f"encode takes FP32 blocks of shape (n, {block_quant.BLOCK_SIZE}) and FP32 scales of"
                             f" shape (n,); got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype}"
                             f" {tuple(scales.shape)}.")
        blocks, scales = blocks.detach().cpu().contiguous(), scales.detach().cpu().contiguous()
        codes = torch.empty(blocks.shape, dtype=torch.uint8)
        self._encode(blocks.data_ptr(), blocks.shape[0], scales.data_ptr(), ctypes.addressof(self._tables[signed]),
                     int(signed), int(portable), codes.data_ptr())
        return codes


@functools.cache
def native_adam() -> NativeAdam:
    """The process's one :class:`NativeAdam` (building the library on first call).

    Raises:
        NativeBuildError: if the source cannot be built or loaded here.
    """
    return NativeAdam()
