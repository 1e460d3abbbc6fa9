"""The search's state and trial records: typed while the search runs, plain dictionaries in a checkpoint.

:meth:`SearchState.to_dict` writes exactly the keys that checkpoints of format version 1 hold, so checkpoints
written before the state was typed still resume, and new ones stay loadable with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_comp.errors import SearchConfigError

__all__ = ["STATE_VERSION", "Phase", "SearchState", "TrialRecord"]

STATE_VERSION = 1


class Phase:
    """The search's phases: ``pending`` (warm-up) -> ``searching`` -> ``done``."""

    PENDING = "pending"
    SEARCHING = "searching"
    DONE = "done"


@dataclass
class TrialRecord:
    """One convergence trial: the plan it trained with, what it measured, and its verdict.

    Attributes:
        label: unique within a search (``"fp32 reference"``, ``"all candidates"``, ``"trial 3: group of 2"``).
        group: the candidate operators it lowered (``None`` for the FP32 reference).
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
        verdict: ``"pass"``/``"fail"`` once closed.
        reason: why.
        metric: the metric that judged it.
        steps: optimizer steps it took.
        skipped_steps: steps the FP16 loss scaler skipped during it.
        median_step_ms: median of ``batch_ms``.
        profiling_seconds: the batch stage's time, run inside the reference trial's first batch.
    """

    label: str
    group: tuple[str, ...] | None
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
    verdict: str | None = None
    reason: str | None = None
    metric: float | None = None
    steps: int | None = None
    skipped_steps: int = 0
    median_step_ms: float | None = None
    profiling_seconds: float = 0.0

    @property
    def is_reference(self) -> bool:
        """Whether this is the FP32 reference trial."""
        return self.group is None

    def to_dict(self) -> dict[str, Any]:
        """Plain types only (the group as a list)."""
        out = asdict(self)
        out["group"] = None if self.group is None else list(self.group)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRecord:
        """Read :meth:`to_dict`'s dictionary (or a version-1 checkpoint's trial, which has the same keys).

        Raises:
            SearchConfigError: on unknown keys or missing required ones, naming them.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SearchConfigError(f"Unknown keys {unknown} in a CoMPSearch trial record {data.get('label')!r}.")
        missing = sorted(k for k in ("label", "group", "plan", "start_epoch", "start_step") if k not in data)
        if missing:
            raise SearchConfigError(f"CoMPSearch trial record {data!r} lacks {missing}.")
        values = dict(data)
        values["group"] = None if data["group"] is None else tuple(data["group"])
        values["metrics"] = {str(k): float(v) for k, v in (data.get("metrics") or {}).items()}
        values["batch_ms"] = [float(v) for v in data.get("batch_ms") or []]
        return cls(**values)


@dataclass
class SearchState:
    """Where the search stands; everything a resumed run needs to go on exactly where it stopped.

    Attributes:
        phase: see :class:`Phase`.
        search_start_epoch: the epoch the first trial started in.
        snapshot: the run's state at the search's start (``TrainingSnapshot.to_state()``), while trials may rewind.
        reference_end: the run's state at the end of the FP32 reference trial, while it may be continued from.
        pending_restore: ``None``, ``"snapshot"`` or ``"reference_end"``: the rewind the next epoch start applies.
        profile: the batch stage's measurements (per operator, whole-step times and bytes).
        runs: runs of cheap operators lowered between two lowered ones.
        group_search: the adaptive group testing state.
        trials: the trials so far, in order.
        extension_epochs: epochs added to ``max_epochs`` (rejected trials).
        extension_steps: steps added to ``max_steps`` (rejected trials).
        chosen: the chosen plan (``PrecisionPlan.to_dict()``), once done.
        chosen_label: the label of the trial whose plan was chosen.
        low_precision: the 16-bit precision searched.
        profiling_seconds: the batch stage's time.
        fit_seconds: time spent in ``fit`` with this callback, over all fits.
        kept_trial: index of the trial whose progress was kept, if any.
        finish_reason: why the search ended as it did.
        warmup_batches: training batches before the search started.
        saved_choices: operator -> saved precision of the saved-precision candidates (keys ``"saved:<name>"``).
    """

    phase: str = Phase.PENDING
    search_start_epoch: int | None = None
    snapshot: dict[str, Any] | None = None
    reference_end: dict[str, Any] | None = None
    pending_restore: str | None = None
    profile: dict[str, Any] | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    group_search: dict[str, Any] | None = None
    trials: list[TrialRecord] = field(default_factory=list)
    extension_epochs: int = 0
    extension_steps: int = 0
    chosen: dict[str, Any] | None = None
    chosen_label: str | None = None
    low_precision: str | None = None
    profiling_seconds: float = 0.0
    fit_seconds: float = 0.0
    kept_trial: int | None = None
    finish_reason: str | None = None
    warmup_batches: int = 0
    saved_choices: dict[str, str] = field(default_factory=dict)

    @property
    def current_trial(self) -> TrialRecord | None:
        """The trial running now (the last one, until its verdict)."""
        if self.trials and self.trials[-1].verdict is None:
            return self.trials[-1]
        return None

    @property
    def in_search(self) -> bool:
        """Whether trials run, or one's state is still to be rewound (EarlyStopping stays paused meanwhile)."""
        return self.phase == Phase.SEARCHING or (self.phase == Phase.DONE and self.pending_restore is not None)

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint form: plain containers and tensors, with the state version."""
        out: dict[str, Any] = {"version": STATE_VERSION}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        out["trials"] = [t.to_dict() for t in self.trials]
        if not self.saved_choices:  # searches of the compute dimension only write exactly version 1's keys
            del out["saved_choices"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SearchState:
        """Read :meth:`to_dict`'s dictionary (checkpoints written before the state was typed included).

        Raises:
            SearchConfigError: on another state version, or unknown keys (named), so nothing is silently dropped.
        """
        if data.get("version") != STATE_VERSION:
            raise SearchConfigError(
                f"Cannot resume a CoMPSearch state of version {data.get('version')!r}; this version reads"
                f" {STATE_VERSION}."
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"version"})
        if unknown:
            raise SearchConfigError(
                f"Unknown keys {unknown} in a CoMPSearch checkpoint state: it was written by another version of"
                f" lightning-comp. Known keys: {sorted(known)}."
            )
        values = {k: v for k, v in data.items() if k in known}
        values["trials"] = [TrialRecord.from_dict(t) for t in data.get("trials") or []]
        values["runs"] = list(data.get("runs") or [])
        return cls(**values)
