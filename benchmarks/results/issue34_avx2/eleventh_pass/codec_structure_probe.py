"""Where the compiled 8-bit step's time goes, and the native step beside it (issue 34, eleventh pass).

One parameter of 1 Mi elements (4096 blocks), side by side in one process, interleaved rounds of 20 steps each, ns
per element, medians and minima over 9 rounds:

- ``compiled``: ``fused_adam.step_8bit_moments`` under ``torch.compile(dynamic=True, fullgraph=True)`` (the
  compiled path's kernel, called directly: no plugin bookkeeping);
- ``compiled, trivial codec``: the same graph with decode ``codes * (1/127)`` and encode ``x * 127 + 127``: the
  structure's floor (the passes over memory, Adam, the block scales), the codec's arithmetic removed;
- ``compiled, trivial decode`` / ``compiled, trivial encode``: one half of the codec removed;
- ``native``: ``NativeAdam8bit.step`` (the C loop over blocks), FP32 weights;
- ``torch AdamW``: ``torch.optim.AdamW`` (single tensor, FP32 moments) on the same size.

    PYTHONPATH=. python benchmarks/results/issue34_avx2/eleventh_pass/codec_structure_probe.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lightning_comp.execution import fused_adam
from lightning_comp.execution.native_adam import native_adam_8bit
from lightning_comp.execution.update_path import _block_aliases
from lightning_comp.numerics import block_quant, dynamic_codec

N = 1 << 20
HYPER = (1.0, 0.0, 1.0 - 1e-5, 0.1, 0.999, 0.001, 1e-3, 0.03, 1e-8)


def _state() -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    p, g = torch.randn(N) * 0.1, torch.randn(N) * 1e-2
    m = block_quant.pack(block_quant.QuantisedMoment.quantise(torch.randn(N) * 1e-3, True))
    v = block_quant.pack(block_quant.QuantisedMoment.quantise(torch.rand(N) * 1e-5, False))
    return p, g, m, v


def _trivial_decode(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    return codes.float() * (1 / 127)


def _trivial_encode(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    return (scaled * 127 + 127).to(torch.uint8)


def _variant(decode: Callable[..., torch.Tensor], encode: Callable[..., torch.Tensor]) -> Callable[..., None]:
    def step(p: torch.Tensor, grad: torch.Tensor, m_codes: torch.Tensor, m_scales: torch.Tensor,
             v_codes: torch.Tensor, v_scales: torch.Tensor, hyper: torch.Tensor) -> None:
        m = decode(m_codes, True) * m_scales.view(torch.float32).view(-1, 1)
        v = decode(v_codes, False) * v_scales.view(torch.float32).view(-1, 1)
        w, m, v = fused_adam._adam(p.float(), grad.float(), m, v, hyper)
        for x, codes, scales, signed in ((m, m_codes, m_scales, True), (v, v_codes, v_scales, False)):
            scale = x.abs().amax(-1).clamp(min=1e-12)
            codes.copy_(encode(x / scale.view(-1, 1), signed))
            scales.copy_(scale.view(torch.uint8))
        p.copy_(w)

    return torch.compile(step, dynamic=True, fullgraph=True)


def main() -> None:
    hyper = torch.tensor(HYPER)
    steps: dict[str, Callable[[], None]] = {}
    compiled = torch.compile(fused_adam.step_8bit_moments, dynamic=True, fullgraph=True)
    aliases = _block_aliases(*_state())
    steps["compiled"] = lambda: compiled(*aliases, hyper, False, 0)
    for name, decode, encode in (("compiled, trivial codec", _trivial_decode, _trivial_encode),
                                 ("compiled, trivial decode", _trivial_decode, dynamic_codec.encode),
                                 ("compiled, trivial encode", dynamic_codec.decode, _trivial_encode)):
        function, tensors = _variant(decode, encode), _block_aliases(*_state())
        steps[name] = lambda f=function, t=tensors: f(*t, hyper)
    native, state = native_adam_8bit(), _state()
    steps["native"] = lambda: native.step(*state, HYPER, False, 0)
    weights = torch.nn.Parameter(_state()[0])
    weights.grad = _state()[1]
    adamw = torch.optim.AdamW([weights], lr=1e-3)
    steps["torch AdamW"] = adamw.step
    for step in steps.values():
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(9):
        for name, step in steps.items():
            started = time.perf_counter()
            for _ in range(20):
                step()
            times[name].append((time.perf_counter() - started) / 20 / N * 1e9)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {N} elements; ns per element")
    for name, values in times.items():
        values.sort()
        print(f"{name:26s} median {values[len(values) // 2]:.2f}  min {values[0]:.2f}")


if __name__ == "__main__":
    main()
