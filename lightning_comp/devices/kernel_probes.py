"""Which way of lowering a recurrent operator actually runs on a device: tried once on a tiny copy, not assumed.

Recurrent kernels are where devices differ most: CPU autocast runs a BF16 ``nn.LSTM`` through oneDNN on CPUs with
AVX512-BF16, but raises ``could not create a primitive descriptor for the LSTM forward propagation primitive`` on
AVX2-only CPUs (pytorch/pytorch#88136), while the same LSTM with BF16 parameter copies and a BF16 input runs there;
``nn.GRU`` is not on CPU autocast's list at all (it would silently compute in FP32). :func:`recurrent_lowering`
runs forward and backward of a tiny module of the same configuration on the target device through each way in
turn, and returns the first one that runs and computes in the wanted dtype, with why each route before it failed
(:class:`RecurrentProbe`). Probes touch no global RNG and are cached per process.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from lightning_comp.errors import UnsupportedSetupError
from lightning_comp.numerics.precision import ComputePrecision

__all__ = ["RecurrentConfig", "RecurrentProbe", "probe_recurrent"]

# (class name, bidirectional, multi-layer, projections, bias, batch_first, nonlinearity)
RecurrentConfig = tuple[str, bool, bool, bool, bool, bool, str]


def recurrent_config(module: nn.RNNBase) -> RecurrentConfig:
    """What a probe must reproduce of ``module`` (kernels are chosen by these, not by sizes)."""
    return (module.mode, bool(module.bidirectional), module.num_layers > 1, getattr(module, "proj_size", 0) > 0,
            bool(module.bias), bool(module.batch_first), str(getattr(module, "nonlinearity", "")))


def _tiny(config: RecurrentConfig) -> nn.RNNBase:
    """A module of ``config`` on the meta device: built without drawing from the global RNG (the search's rewinds are
    bit-exact), and never moved (its parameters are given to each call, see :func:`_parameters`)."""
    mode, bidirectional, layered, projected, bias, batch_first, nonlinearity = config
    kwargs: dict[str, Any] = dict(input_size=4, hidden_size=4, num_layers=2 if layered else 1, bias=bias,
                                  batch_first=batch_first, bidirectional=bidirectional, device=torch.device("meta"))
    if mode == "LSTM":
        return nn.LSTM(proj_size=2 if projected else 0, **kwargs)
    if mode == "GRU":
        return nn.GRU(**kwargs)
    return nn.RNN(nonlinearity=nonlinearity or "tanh", **kwargs)


def _parameters(module: nn.RNNBase, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Constant parameters for ``module`` made on ``device`` directly. (Moving the meta module there instead would
    swap its parameters, which fails for recurrent modules under a fake-tensor mode: their flat-weight list holds
    weak references to them.)"""
    return {name: torch.full(p.shape, 0.05 * (index + 1), dtype=dtype, device=device, requires_grad=True)
            for index, (name, p) in enumerate(module.named_parameters())}


def _run(module: nn.RNNBase, route: str, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """Forward and backward through ``route``: ``None`` if it computed in ``dtype``, else the dtype it computed in."""
    x = torch.full((2, 3, 4), 0.5, device=device, requires_grad=True)
    if route == "autocast":
        with torch.autocast(device.type, dtype=dtype, cache_enabled=False):
            out = functional_call(module, _parameters(module, torch.float32, device), (x,))[0]
    else:
        with torch.autocast(device.type, enabled=False):
            out = functional_call(module, _parameters(module, dtype, device), (x.to(dtype),))[0]
    out.float().sum().backward()
    if x.grad is None:  # pragma: no cover - autograd always reaches the input
        raise UnsupportedSetupError("backward did not reach the input")  # caught below: the route is ruled out
    return None if out.dtype == dtype else out.dtype


@dataclass(frozen=True)
class RecurrentProbe:
    """What trying each way of lowering a recurrent module on a device found.

    Attributes:
        route: ``"autocast"`` or ``"params"``, the first way that ran and computed in the wanted dtype; ``None``
            when none did (then the operator cannot compute in that precision there).
        failures: per route tried before it (or every route, when none ran), why it was ruled out: the exception it
            raised (type and message), or the dtype it computed in instead.
    """

    route: str | None
    failures: tuple[tuple[str, str], ...] = ()

    def describe_failures(self) -> str:
        """``"autocast: RuntimeError: could not create a primitive ...; params: ..."`` (empty when none failed)."""
        return "; ".join(f"{route}: {why}" for route, why in self.failures)


_ROUTES = ("autocast", "params")  # autocast first: it is the lowering AMP users get where it works


@functools.cache
def _probe(config: RecurrentConfig, precision: ComputePrecision, device: torch.device) -> RecurrentProbe:
    dtype = precision.dtype
    failures = []
    with warnings.catch_warnings(), torch.enable_grad():
        warnings.simplefilter("ignore")
        for route in _ROUTES:
            try:
                computed = _run(_tiny(config), route, dtype, device)
            except Exception as err:  # oneDNN, a missing kernel, an unusable device: the route is ruled out
                failures.append((route, _first_line(err)))
                continue
            if computed is None:
                return RecurrentProbe(route, tuple(failures))
            failures.append((route, f"computed in {computed} instead of {dtype}"))
    return RecurrentProbe(None, tuple(failures))


def _first_line(err: BaseException) -> str:
    """``"RuntimeError: <first line of the message>"``."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def probe_recurrent(module: nn.RNNBase, precision: ComputePrecision, device: torch.device | str) -> RecurrentProbe:
    """Which way of lowering ``module`` runs on ``device`` in ``precision`` (tried once per configuration, device
    and precision in a process; ``probe_recurrent.cache_clear()`` forgets the answers)."""
    target = torch.device(device)
    if target.type == "cuda" and target.index is None and torch.cuda.is_available():
        target = torch.device("cuda", torch.cuda.current_device())
    return _probe(recurrent_config(module), precision, target)


probe_recurrent.cache_clear = _probe.cache_clear  # type: ignore[attr-defined]
