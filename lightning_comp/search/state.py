"""The search's state and trial records: typed while the search runs, plain containers in a checkpoint.

:meth:`SearchState.to_dict` writes every field, in plain Python types and tensors, so checkpoints load with
``torch.load(weights_only=True)``; :meth:`SearchState.from_dict` reads exactly that form and refuses anything else,
naming it. There is one format, :data:`STATE_VERSION`: a state of another version (or with other keys) is refused
with the keys it lacks or has in excess, never read in part. The batch stage's result travels in the typed plain form
of :mod:`lightning_comp.common.typed_plain`.
The state is the one owner of what the search decided: the searched precision, the batch stage's measurements and
candidates, their group testing, the trials, the chosen plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from lightning_comp.common.typed_plain import from_plain, to_plain
from lightning_comp.errors import ConfigError, SearchConfigError
from lightning_comp.numerics.precision import ComputePrecision
from lightning_comp.search.candidates import Candidate, candidates_from_plain, candidates_to_plain
from lightning_comp.search.decisions.batch_result import BatchStageResult
from lightning_comp.search.decisions.group_search import GroupSearch
from lightning_comp.search.decisions.trial_plans import CheapRun, Choices
from lightning_comp.search.decisions.trials import TrialVerdict

__all__ = ["STATE_VERSION", "Phase", "Restore", "SearchState", "TrialRecord"]

# the one checkpoint form of the search's state this version writes and reads (2: groups, flips, trialled plan)
STATE_VERSION = 5


class Phase(str, Enum):
    """The search's phases."""

    PENDING = "pending"  # the FP32 warm-up
    MEASURING = "measuring"  # the FP32 reference trial has started; the batch stage runs at its first batch
    SEARCHING = "searching"  # the trials
    DONE = "done"  # a plan is chosen


class Restore(str, Enum):
    """The rewind the next epoch start applies once the search is done."""

    SNAPSHOT = "snapshot"  # back to the search's start
    REFERENCE_END = "reference_end"  # on from the end of the FP32 reference trial


@dataclass
class TrialRecord:
    """One convergence trial: the plan it trained with, what it measured, and its verdict.

    Attributes:
        label: unique within a search (``"fp32 reference"``, ``"all candidates"``, ``"group of 2 (trial 3)"``).
        group: the candidates it lowered (``None`` for the FP32 reference).
        plan: the plan it trained with (:meth:`PrecisionPlan.to_dict`).
        start_epoch: the epoch it started in.
        start_step: ``global_step`` at its start.
        batches: batches it trains (``None``: whole epochs).
        metrics: the monitored metric per epoch (keys are epoch numbers as strings, as in a checkpoint).
        batch_ms: its measured batch times (the first batches of an epoch are skipped).
        nonfinite_loss: whether a training loss was NaN/Inf.
        skipped_steps_before: the plugin's skipped-step counter at its start.
        steps_before: the plugin's optimizer-step counter at its start.
        started: wall-clock time at its start (``time.time()``).
        seconds: how long it trained (the batch stage not counted), once closed.
        verdict: once closed.
        reason: why.
        metric: the metric that judged it.
        steps: optimizer steps it took.
        skipped_steps: steps the FP16 loss scaler skipped during it.
        median_step_ms: median of ``batch_ms``.
    """

    label: str
    group: tuple[Candidate, ...] | None
    plan: dict[str, Any]
    start_epoch: int
    start_step: int
    batches: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    batch_ms: list[float] = field(default_factory=list)
    nonfinite_loss: bool = False
    skipped_steps_before: int = 0
    steps_before: int = 0
    started: float = 0.0
    seconds: float | None = None
    verdict: TrialVerdict | None = None
    reason: str | None = None
    metric: float | None = None
    steps: int | None = None
    skipped_steps: int = 0
    median_step_ms: float | None = None

    @property
    def is_reference(self) -> bool:
        """Whether this is the FP32 reference trial."""
        return self.group is None

    def to_dict(self) -> dict[str, Any]:
        """Plain types only."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["group"] = None if self.group is None else candidates_to_plain(self.group)
        out["verdict"] = None if self.verdict is None else self.verdict.value
        out["metrics"], out["batch_ms"] = dict(self.metrics), list(self.batch_ms)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialRecord:
        """Read :meth:`to_dict`'s form.

        Raises:
            SearchConfigError: on unknown or missing keys, naming them.
        """
        _check_keys(data, cls, f"trial record {data.get('label')!r}")
        values = dict(data)
        values["group"] = None if data["group"] is None else candidates_from_plain(data["group"])
        values["verdict"] = None if data["verdict"] is None else TrialVerdict(data["verdict"])
        values["metrics"] = {str(k): float(v) for k, v in data["metrics"].items()}
        values["batch_ms"] = [float(v) for v in data["batch_ms"]]
        return cls(**values)


@dataclass
class SearchState:
    """Where the search stands; everything a resumed run needs to go on exactly where it stopped.

    Attributes:
        phase: see :class:`Phase`.
        low_precision: the 16-bit precision searched (decided when the search starts, read back on resume).
        fp8_precision: the fp8 precision searched on top of it (``None``: no fp8; decided and kept likewise).
        search_start_epoch: the epoch the first trial started in.
        snapshot: the run's state at the search's start (``TrainingSnapshot.to_state()``), while trials may rewind.
        reference_end: the run's state at the end of the FP32 reference trial, while it may be continued from.
        pending_restore: the rewind the next epoch start applies, if any.
        num_operators: the model's operators (counted when the search starts or ends at once).
        batch: the batch stage's measurements, decisions and candidates, once it ran.
        group_search: the adaptive group testing over the candidates.
        trials: the trials so far, in order.
        extension_epochs: epochs added to ``max_epochs`` (rejected trials).
        extension_steps: steps added to ``max_steps`` (rejected trials).
        chosen: the chosen plan (``PrecisionPlan.to_dict()``), once done.
        chosen_label: the label of the trial whose plan was chosen.
        finish_reason: why the search ended as it did.
        kept_trial: index of the trial whose progress was kept, if any.
        profiling_seconds: the batch stage's time (run inside the FP32 reference trial's first batch).
        snapshot_seconds: the time each snapshot took to capture (on rank 0; its shards only, under FSDP).
        rewind_seconds: the time each rewind to a snapshot took (on rank 0).
        fit_seconds: time spent in ``fit`` with this callback, over all fits.
        warmup_batches: training batches before the search started.
    """

    phase: Phase = Phase.PENDING
    low_precision: ComputePrecision | None = None
    fp8_precision: ComputePrecision | None = None
    search_start_epoch: int | None = None
    snapshot: dict[str, Any] | None = None
    reference_end: dict[str, Any] | None = None
    pending_restore: Restore | None = None
    num_operators: int = 0
    batch: BatchStageResult | None = None
    group_search: GroupSearch | None = None
    trials: list[TrialRecord] = field(default_factory=list)
    extension_epochs: int = 0
    extension_steps: int = 0
    chosen: dict[str, Any] | None = None
    chosen_label: str | None = None
    finish_reason: str | None = None
    kept_trial: int | None = None
    profiling_seconds: float = 0.0
    snapshot_seconds: list[float] = field(default_factory=list)
    rewind_seconds: list[float] = field(default_factory=list)
    fit_seconds: float = 0.0
    warmup_batches: int = 0

    @property
    def current_trial(self) -> TrialRecord | None:
        """The trial running now (the last one, until its verdict)."""
        if self.trials and self.trials[-1].verdict is None:
            return self.trials[-1]
        return None

    @property
    def searching(self) -> bool:
        """Whether a trial runs (the reference's first batch, where the batch stage measures, included)."""
        return self.phase in (Phase.MEASURING, Phase.SEARCHING)

    @property
    def in_search(self) -> bool:
        """Whether trials run, or one's state is still to be rewound (EarlyStopping stays paused meanwhile)."""
        return self.searching or (self.phase is Phase.DONE and self.pending_restore is not None)

    @property
    def runs(self) -> list[CheapRun]:
        """The runs of cheap operators lowered between two lowered candidates (none before the batch stage)."""
        return [] if self.batch is None else self.batch.runs

    @property
    def choices(self) -> Choices:
        """Per saved, state and master dimension, operator -> the value of its candidate (none before the batch
        stage)."""
        return {} if self.batch is None else self.batch.choices

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint form: plain containers and tensors, with the state version."""
        out: dict[str, Any] = {"version": STATE_VERSION}
        out.update({f.name: getattr(self, f.name) for f in fields(self)})
        out["phase"] = self.phase.value
        out["low_precision"] = None if self.low_precision is None else self.low_precision.value
        out["fp8_precision"] = None if self.fp8_precision is None else self.fp8_precision.value
        out["pending_restore"] = None if self.pending_restore is None else self.pending_restore.value
        out["batch"] = None if self.batch is None else to_plain(self.batch)
        out["group_search"] = None if self.group_search is None else self.group_search.state_dict()
        out["trials"] = [t.to_dict() for t in self.trials]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SearchState:
        """Read :meth:`to_dict`'s form.

        Raises:
            SearchConfigError: on another state version, or unknown or missing keys (named), so nothing is dropped.
        """
        if data.get("version") != STATE_VERSION:
            raise SearchConfigError(
                f"Cannot resume a CoMPSearch state of version {data.get('version')!r}; this version reads"
                f" {STATE_VERSION}."
            )
        values = {k: v for k, v in data.items() if k != "version"}
        _check_keys(values, cls, "checkpoint state")
        values["phase"] = Phase(values["phase"])
        low = values["low_precision"]
        values["low_precision"] = None if low is None else ComputePrecision.parse(low)
        fp8 = values["fp8_precision"]
        values["fp8_precision"] = None if fp8 is None else ComputePrecision.parse(fp8)
        values["pending_restore"] = None if values["pending_restore"] is None else Restore(values["pending_restore"])
        values["num_operators"] = int(values["num_operators"])
        values["batch"] = None if values["batch"] is None else _read_batch(values["batch"])
        values["group_search"] = None if values["group_search"] is None else GroupSearch.from_state(
            values["group_search"])
        values["trials"] = [TrialRecord.from_dict(t) for t in values["trials"]]
        return cls(**values)


def _check_keys(data: Mapping[str, Any], kind: type, what: str, known: set[str] | None = None) -> None:
    known = {f.name for f in fields(kind)} if known is None else known
    unknown, missing = sorted(set(data) - known), sorted(known - set(data))
    if unknown or missing:
        found = " and ".join(part for part in (f"Unknown keys {unknown}" if unknown else "",
                                               f"missing keys {missing}" if missing else "") if part)
        raise SearchConfigError(
            f"{found[0].upper()}{found[1:]} in a CoMPSearch {what}: it was written by another version of"
            f" lightning-comp. Known keys: {sorted(known)}."
        )


def _read_batch(data: Any) -> BatchStageResult:
    """The batch stage's result from its checkpoint form.

    Raises:
        SearchConfigError: where ``data`` does not have the form of a :class:`BatchStageResult`.
    """
    try:
        return from_plain(BatchStageResult, data)  # type: ignore[no-any-return]
    except ConfigError as err:
        raise SearchConfigError(f"Malformed CoMPSearch checkpoint state (its batch stage's result): {err}") from None
