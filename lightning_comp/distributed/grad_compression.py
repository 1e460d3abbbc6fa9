"""Half-precision gradient communication for Lightning DDP, with an honest byte counter.

Synchronous data-parallel training all-reduces every gradient on every optimizer step. Casting the gradient
buckets to a 16-bit type before the all-reduce halves the bytes on the wire (Svyatkovskiy et al., 2017). PyTorch
ships this as DDP communication hooks (``bf16_compress_hook`` and ``fp16_compress_hook`` in
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``) and Lightning's
:class:`~lightning.pytorch.strategies.DDPStrategy` accepts such a hook through ``ddp_comm_hook=``.

Why a strategy subclass and not just ``DDPStrategy(ddp_comm_hook=...)``:
    Lightning 2.6 registers the hook **only when the root device is CUDA** (``DDPStrategy._register_ddp_hooks``
    checks ``self.root_device.type == "cuda"``). On CPU/gloo the hook is silently dropped and the gradients are
    all-reduced in fp32. :class:`HalfPrecisionDDPStrategy` registers the hook on every device type (gloo has
    supported communication hooks for years) and otherwise behaves exactly like ``DDPStrategy``. A strategy is the
    right home because the hook belongs to the ``DistributedDataParallel`` wrapper the strategy creates; a Callback
    would have to reach into ``trainer.strategy.model`` and could collide with a hook already passed to the strategy.

Backend support (checked with torch 2.13 on CPU):
    gloo all-reduces ``float32``, ``float16`` and ``bfloat16`` tensors correctly. However,
    ``DistributedDataParallel.register_comm_hook`` refuses a hook *named* ``bf16_compress_hook`` unless CUDA with
    NCCL >= 2.10 (or XPU) is present (``TypeError: BF16 all reduce communication hook required CUDA 11+ and NCCL
    2.10+``), so plain PyTorch cannot use bf16 compression on gloo. Off CUDA the strategy registers a renamed
    delegate (:func:`bf16_compress_hook_any_backend`), but only after a one-element probe all-reduce in the chosen
    dtype has returned the right value; if the backend cannot do it, an ``UnsupportedSetupError`` names the dtype and
    backend and suggests ``"fp16"``, which gloo has always handled. NCCL supports both.

Numerics:
    The hooks divide by the world size *before* the cast, then sum in 16 bits. ``fp16`` keeps 10 mantissa bits but
    overflows above 65504 and flushes gradients below about 6e-8 to zero; ``bf16`` keeps the fp32 range but only
    8 significant bits. Parameters, optimizer state and the local gradients stay fp32; only the summed update loses
    precision. Gradient-norm clipping (as in the paper) also protects fp16 against overflow.

Usage::

    from lightning_comp.distributed import half_precision_ddp_strategy

    trainer = Trainer(accelerator="cpu", devices=2, strategy=half_precision_ddp_strategy("fp16"))
    # Hydra: trainer.strategy: {_target_: lightning_comp.distributed.half_precision_ddp_strategy, dtype: bf16}

Measuring:
    With ``measure=True`` the hook is wrapped by :func:`counting_comm_hook`, which records, per process, the bytes of
    every tensor the hook actually hands to ``torch.distributed.all_reduce`` (so a hook that compressed nothing would
    be caught) plus the launch-to-completion time of each bucket. For an ``"fp32"`` baseline the documented
    equivalent of DDP's built-in all-reduce (``allreduce_hook``) is counted the same way. The counts are the
    collective's *payload*; the bytes a ring all-reduce puts on the wire per rank are ``2 (N-1)/N`` times the
    payload, the same factor with and without compression.
"""

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_comp.adapters import lightning_internals
from lightning_comp.common.spelled_enum import SpelledEnum
from lightning_comp.errors import ConfigError, UnsupportedSetupError

__all__ = [
    "CommStats",
    "GradCommDtype",
    "HalfPrecisionDDPStrategy",
    "bf16_compress_hook_any_backend",
    "counting_comm_hook",
    "half_precision_ddp_strategy",
]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class GradCommDtype(SpelledEnum):
    """The dtype gradients travel in during the DDP all-reduce (also spelled ``float32``/``32``/``32-true``/``none``,
    ``bfloat16``, ``float16``/``half``/``16``, or as a torch dtype)."""

    FP32 = "fp32"
    """No compression (DDP's default all-reduce)."""
    BF16 = "bf16"
    """``torch.bfloat16``: fp32 range, 8 significant bits."""
    FP16 = "fp16"
    """``torch.float16``: 11 significant bits, max 65504."""

    @property
    def torch_dtype(self) -> torch.dtype:
        """The matching ``torch.dtype``."""
        return {
            GradCommDtype.FP32: torch.float32,
            GradCommDtype.BF16: torch.bfloat16,
            GradCommDtype.FP16: torch.float16,
        }[self]

    dtype = torch_dtype

    @classmethod
    def aliases(cls) -> "Mapping[str, str]":
        return {"float32": "fp32", "32": "fp32", "32-true": "fp32", "none": "fp32", "bfloat16": "bf16",
                "float16": "fp16", "half": "fp16", "16": "fp16"}

    @classmethod
    def noun(cls) -> str:
        return "gradient communication dtype"


@dataclass
class CommStats:
    """Per-process counters filled by :func:`counting_comm_hook`.

    Attributes:
        steps: Synchronising backward passes seen (buckets flagged ``is_last``); accumulation steps under
            ``no_sync`` do not communicate and are not counted.
        buckets: Gradient buckets handed to the hook.
        sent_bytes: Bytes of all tensors the hook passed to ``torch.distributed.all_reduce`` (the payload).
        grad_bytes: Bytes of the uncompressed gradient buckets.
        hook_seconds: Wall time spent inside the hook call (cast plus launching the collective).
        comm_seconds: Sum over buckets of launch-to-completion wall time; it overlaps backward compute, so it is an
            upper bound on the time communication adds to a step.
        sent_dtypes: Names of the dtypes seen on the wire.
    """

    steps: int = 0
    buckets: int = 0
    sent_bytes: int = 0
    grad_bytes: int = 0
    hook_seconds: float = 0.0
    comm_seconds: float = 0.0
    sent_dtypes: set[str] = field(default_factory=set)

    @property
    def bytes_per_step(self) -> float:
        """Mean all-reduce payload per synchronising step (``nan`` before the first step)."""
        return self.sent_bytes / self.steps if self.steps else float("nan")

    @property
    def compression_ratio(self) -> float:
        """``sent_bytes / grad_bytes``: 1.0 without compression, 0.5 for a 16-bit hook."""
        return self.sent_bytes / self.grad_bytes if self.grad_bytes else float("nan")

    def reset(self) -> None:
        """Zero all counters (e.g. after warm-up steps)."""
        fresh = CommStats()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    def as_dict(self) -> dict[str, Any]:
        """Plain-python snapshot, JSON-serialisable, including the derived fields."""
        out = asdict(self)
        out["sent_dtypes"] = sorted(self.sent_dtypes)
        out["bytes_per_step"] = self.bytes_per_step
        out["compression_ratio"] = self.compression_ratio
        return out


_TAP_LOCK = threading.Lock()


@contextmanager
def _tap_all_reduce(record: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Report every tensor passed to ``torch.distributed.all_reduce`` by this thread while active.

    The built-in hooks call ``dist.all_reduce`` through the ``torch.distributed`` module attribute, so swapping that
    attribute for the duration of one hook call sees exactly what the hook sends. Calls from other threads pass
    through uncounted. Collectives issued through ``torch.distributed._functional_collectives`` (the
    ``torch.compile`` path of the hooks) are not seen.
    """
    original = dist.all_reduce
    owner = threading.get_ident()

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == owner:
            record(tensor)
        return original(tensor, *args, **kwargs)

    with _TAP_LOCK:
        dist.all_reduce = counting_all_reduce
        try:
            yield
        finally:
            dist.all_reduce = original


def counting_comm_hook(hook: CommHook, stats: CommStats) -> CommHook:
    """Wrap a DDP communication hook so that it records what it sends into ``stats``.

    Args:
        hook: Any DDP communication hook ``(state, bucket) -> Future[Tensor]``, e.g. ``allreduce_hook`` or
            ``bf16_compress_hook``.
        stats: The counters to update (per process).

    Returns:
        A hook with the same behaviour and result as ``hook``.
    """

    def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        sent: list[torch.Tensor] = []
        start = time.perf_counter()
        with _tap_all_reduce(sent.append):
            future = hook(state, bucket)
        stats.hook_seconds += time.perf_counter() - start
        stats.buckets += 1
        stats.steps += int(bucket.is_last())
        stats.grad_bytes += buffer.numel() * buffer.element_size()
        stats.sent_bytes += sum(t.numel() * t.element_size() for t in sent)
        stats.sent_dtypes.update(str(t.dtype).removeprefix("torch.") for t in sent)

        def finished(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            stats.comm_seconds += time.perf_counter() - start
            return fut.value()

        return future.then(finished)

    return counted


def bf16_compress_hook_any_backend(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``bf16_compress_hook`` under another name, so that DDP accepts it on gloo.

    ``DistributedDataParallel.register_comm_hook`` rejects a hook *named* ``bf16_compress_hook`` unless CUDA with
    NCCL >= 2.10 (or XPU) is present, although gloo in torch 2.13 all-reduces ``bfloat16`` correctly. The strategy
    uses this delegate off CUDA only after a probe all-reduce has confirmed the backend handles ``bfloat16``.
    """
    return default_hooks.bf16_compress_hook(process_group, bucket)


def _compression_hook(dtype: GradCommDtype, user_hook: CommHook | None, on_cuda: bool) -> CommHook | None:
    """The hook that sends gradients as ``dtype``, optionally around a user's hook (e.g. PowerSGD)."""
    if dtype is GradCommDtype.FP32:
        return user_hook
    if dtype is GradCommDtype.FP16:
        return default_hooks.fp16_compress_hook if user_hook is None else default_hooks.fp16_compress_wrapper(user_hook)
    if user_hook is not None:
        wrapped = default_hooks.bf16_compress_wrapper(user_hook)
        if on_cuda:
            return wrapped

        def bf16_wrapped_any_backend(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            return wrapped(state, bucket)

        return bf16_wrapped_any_backend
    return default_hooks.bf16_compress_hook if on_cuda else bf16_compress_hook_any_backend


class HalfPrecisionDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that all-reduces gradients in bf16/fp16 on any device, CPU/gloo included.

    Args:
        grad_dtype: Dtype on the wire, anything :meth:`GradCommDtype.parse` accepts. ``"fp32"`` means no
            compression (DDP's built-in all-reduce, or ``allreduce_hook`` when measuring).
        measure: Wrap the hook with :func:`counting_comm_hook`; read the counters from :attr:`comm_stats` in the
            same process (with ``start_method="spawn"`` the counters live in the spawned workers).
        probe_backend: All-reduce one element of ``grad_dtype`` when registering, to fail early and clearly if the
            backend cannot reduce that dtype. All ranks run it at the same point, so it cannot deadlock.
        **kwargs: Everything else ``DDPStrategy`` accepts (``find_unused_parameters``, ``start_method``,
            ``process_group_backend``, ``timeout``, ``ddp_comm_state``, ``ddp_comm_hook`` ...). A user
            ``ddp_comm_hook`` is wrapped with torch's ``*_compress_wrapper`` so that it runs on 16-bit buckets.

    Raises:
        ConfigError: For an unknown ``grad_dtype`` or when ``ddp_comm_wrapper`` is passed (this strategy owns that
            slot; pass the hook alone).
    """

    def __init__(
        self,
        grad_dtype: str | torch.dtype | GradCommDtype = "bf16",
        *,
        measure: bool = False,
        probe_backend: bool = True,
        **kwargs: Any,
    ) -> None:
        self.grad_dtype = GradCommDtype.parse(grad_dtype)
        if kwargs.get("ddp_comm_wrapper") is not None:
            raise ConfigError(
                f"ddp_comm_wrapper={kwargs['ddp_comm_wrapper']!r} cannot be combined with HalfPrecisionDDPStrategy, "
                "which installs the bf16/fp16 compression wrapper itself; pass your hook as ddp_comm_hook instead."
            )
        kwargs.pop("ddp_comm_wrapper", None)
        self._comm_stats: CommStats | None = CommStats() if measure else None
        self._probe_backend = probe_backend
        super().__init__(**kwargs)

    @property
    def comm_stats(self) -> CommStats | None:
        """Counters of this process when built with ``measure=True``, else ``None``."""
        return self._comm_stats

    def _register_ddp_hooks(self) -> None:
        """Register the hook on the DDP wrapper whatever the device (Lightning's version is CUDA-only)."""
        on_cuda = self.root_device.type == "cuda"
        hook = _compression_hook(self.grad_dtype, lightning_internals.ddp_comm_hook(self), on_cuda)
        if self._comm_stats is not None:
            hook = counting_comm_hook(hook or default_hooks.allreduce_hook, self._comm_stats)
        if hook is None:
            return
        if not isinstance(self.model, DistributedDataParallel):
            raise UnsupportedSetupError(
                f"Expected the model to be wrapped in DistributedDataParallel, got {type(self.model).__name__}.")
        bypasses_upstream_check = self.grad_dtype is GradCommDtype.BF16 and not on_cuda
        if self.grad_dtype is not GradCommDtype.FP32 and (self._probe_backend or bypasses_upstream_check):
            self._check_backend_supports(self.grad_dtype)
        self.model.register_comm_hook(state=lightning_internals.ddp_comm_state(self), hook=hook)

    def _check_backend_supports(self, dtype: GradCommDtype) -> None:
        """All-reduce one element of ``dtype``; raise a readable error if the backend rejects it."""
        state = lightning_internals.ddp_comm_state(self)
        group = state if isinstance(state, dist.ProcessGroup) else None
        backend = dist.get_backend(group)
        probe = torch.ones(1, dtype=dtype.torch_dtype, device=self.root_device)
        try:
            dist.all_reduce(probe, group=group)
            problem = None if probe.item() == dist.get_world_size(group) else f"sum of ones gave {probe.item()}"
        except (RuntimeError, ValueError, TypeError) as err:
            problem = f"backend error: {err}"
        if problem is not None:
            hint = " On gloo use grad_dtype='fp16'." if backend == "gloo" and dtype is GradCommDtype.BF16 else ""
            raise UnsupportedSetupError(
                f"The {backend!r} process-group backend cannot all-reduce {dtype.torch_dtype} "
                f"(torch {torch.__version__}), so grad_dtype={dtype.value!r} is unusable here.{hint} "
                f"Valid choices: {[m.value for m in GradCommDtype]}; {problem}."
            )


def half_precision_ddp_strategy(
    dtype: str | torch.dtype | GradCommDtype = "bf16", *, measure: bool = False, **ddp_kwargs: Any
) -> HalfPrecisionDDPStrategy:
    """Build a DDP strategy whose gradient all-reduce runs in ``dtype``.

    A thin, Hydra-friendly factory around :class:`HalfPrecisionDDPStrategy`.

    Args:
        dtype: ``"bf16"`` (default), ``"fp16"`` or ``"fp32"`` (off); see :meth:`GradCommDtype.parse`.
        measure: Count bytes and communication time into ``strategy.comm_stats``.
        **ddp_kwargs: Forwarded to ``DDPStrategy`` (e.g. ``find_unused_parameters=True``,
            ``start_method="spawn"``, ``process_group_backend="gloo"``).

    Returns:
        The strategy, ready for ``Trainer(strategy=...)``.

    Example::

        trainer = Trainer(accelerator="cpu", devices=2, strategy=half_precision_ddp_strategy("fp16"))
    """
    return HalfPrecisionDDPStrategy(grad_dtype=dtype, measure=measure, **ddp_kwargs)
