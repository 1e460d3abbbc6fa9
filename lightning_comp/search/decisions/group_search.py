"""Finding the lowerings that are unsafe with few convergence trials (adaptive group testing).

The search starts with every candidate lowered at once. A group that converges is safe as a whole; a group that
does not is split in two and each part is tried alone, down to single candidates, which are then marked unsafe. When
the first part of a failing group passes, the second is known to fail without a trial and is split at once.

A failing group that mixes dimensions is split by dimension before it is halved: the candidates of its first
dimension (in :data:`~lightning_comp.search.candidates.LEVERS` order: compute, fp8, saved, state, master) apart from
the rest. So the compute lowerings are tried apart from the fp8 ones and the memory levers, then fp8 apart from the
memory levers, the saved levers apart from the state and master ones, then state apart from master; only a group of
one dimension is halved. (fp8 counts as a dimension here: an operator unsafe in fp8 but safe in bf16 is demoted to
bf16, its fp8 candidate dropped alone.) A lever that breaks convergence
(an 8-bit state, say) is then isolated among the levers of its own dimension and dropped alone, without the operator's
compute lowering and without the other dimensions' levers, which passed as a whole; and when the trial budget runs out
the passing groups the fallback chooses among are whole dimensions rather than mixed halves. (A master candidate
computes in low precision with its bf16 parameters, so an operator unsafe in low precision fails its master candidate
too.) A split by dimension is two parts like a halving, so the inference above holds for it unchanged.

With ``u`` unsafe candidates among candidates of ``D`` dimensions, at most ``n`` of any one dimension, this needs at
most ``1 + 2u(D - 1 + ceil(log2 n))`` trials, plus one confirming trial: every failing group is split into two parts
(at most two trials), the groups one level down the splits are disjoint, so at most ``u`` of them fail, and there are
at most ``D - 1`` levels of splits by dimension above ``ceil(log2 n)`` levels of halving. With one dimension that is
``1 + 2u ceil(log2 n)``, as for plain halving; each further dimension adds at most one level, and ``n`` counts one
dimension's candidates, not all. The cost grows with the number of unsafe candidates, not with the number of
operators. Operators that are safe one group at a time may still fail together, so when the safe set was never tried
as a whole, a confirming trial tries it; if that fails (or the safe set is a group that already failed), the passing
group with the largest estimated gain is used. A candidate that names a group of
operators playing the same part in repeated blocks (one glob, :mod:`lightning_comp.search.decisions.groups`) is
tried whole first; when it fails alone, it is split into its members like any failing group (``ceil(log2 m)`` more
levels for ``m`` members), so one unsafe block does not keep the others in FP32.

The class is a small explicit state machine with ``state_dict``/``from_state`` so a search interrupted by a crash
resumes where it was. The split rule decides only which groups are queued, so a state written before splits by
dimension (the same keys) resumes too: its queued halves are tried as they are, and the groups that fail from then
on are split by dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_comp.errors import UsageError
from lightning_comp.search.candidates import LEVERS, Candidate, candidates_from_plain, candidates_to_plain

__all__ = ["Group", "GroupSearch", "dimensions_of", "split"]

Group = tuple[Candidate, ...]


def dimensions_of(group: Sequence[Candidate]) -> tuple[str, ...]:
    """The levers ``group``'s candidates pull (dimensions, and fp8 beside compute), in :data:`LEVERS` order."""
    present = {candidate.lever for candidate in group}
    return tuple(lever for lever in LEVERS if lever in present)


def _named(group: Sequence[Candidate]) -> str:
    return "+".join(dimensions_of(group))


def split(group: Sequence[Candidate]) -> tuple[Group, Group]:
    """The two parts a failing group of two or more candidates is tried in: by dimension where it mixes them (its
    first dimension's candidates apart from the others'), else in halves; each part in the group's order.

    Raises:
        UsageError: if ``group`` has fewer than two candidates (a single failing candidate is unsafe, not split).
    """
    group = tuple(group)
    if len(group) < 2:
        raise UsageError(f"Only a group of two or more candidates is split, got {group!r}.")
    dimensions = dimensions_of(group)
    if len(dimensions) > 1:
        return (tuple(c for c in group if c.lever == dimensions[0]),
                tuple(c for c in group if c.lever != dimensions[0]))
    half = len(group) // 2
    return group[:half], group[half:]


@dataclass
class GroupSearch:
    """Adaptive group testing over candidate operators.

    Attributes:
        candidates: the lowerings that may be trialled, in execution order.
        benefits: the estimated benefit of each lowering, in the objective's unit (ms per step, bytes saved for
            backward, or the balanced score's gain): ranks the fallback groups.
        max_trials: most trials to run; when reached the best passing group so far is taken.
        members: per candidate naming a group of operators, the candidates of its members (split into when it
            fails alone).
    """

    candidates: Group
    benefits: Mapping[Candidate, float] = field(default_factory=dict)
    max_trials: int = 16
    members: Mapping[Candidate, Group] = field(default_factory=dict)
    queue: list[Group] = field(default_factory=list)
    safe: list[Candidate] = field(default_factory=list)
    unsafe: list[Candidate] = field(default_factory=list)
    passed: list[Group] = field(default_factory=list)
    failed: list[Group] = field(default_factory=list)
    siblings: dict[Group, Group] = field(default_factory=dict)
    inferred: list[Candidate] = field(default_factory=list)
    trials: int = 0
    confirming: Group | None = None
    result: Group | None = None

    def __post_init__(self) -> None:
        self.candidates = tuple(self.candidates)
        if not self.queue and self.result is None and self.confirming is None and self.trials == 0:
            self.queue = [self.candidates] if self.candidates else []
            if not self.candidates:
                self.result = ()

    @property
    def done(self) -> bool:
        """Whether the search has reached a result."""
        return self.result is not None

    def next_group(self) -> Group | None:
        """The group of lowerings to trial (alone) next, or ``None`` when done."""
        if self.done:
            return None
        if self.confirming is not None:
            return self.confirming
        return self.queue[0] if self.queue else None

    def report(self, group: Sequence[Candidate], passed: bool) -> None:
        """Record the verdict of the trial of ``group``.

        Raises:
            UsageError: if ``group`` is not the group :meth:`next_group` asked for.
        """
        group = tuple(group)
        expected = self.next_group()
        if group != expected:
            raise UsageError(f"Verdict for group {group!r}, but the search is waiting for {expected!r}.")
        self.trials += 1
        if self.confirming is not None:
            self.result = group if passed else self._best_passed()
            if passed:
                self.passed.append(group)
            self.confirming = None
            return
        self.queue.pop(0)
        if passed:
            self.safe.extend(group)
            self.passed.append(group)
            second = self.siblings.pop(group, None)
            if second is not None and self.queue and self.queue[0] == second:
                # the failing parent minus a passing half: the other half must hold the unsafe operator(s)
                self.queue.pop(0)
                self.inferred.extend(second)
                self._fail(second)
        else:
            self._fail(group)
        if self.trials >= self.max_trials and self.queue:
            self.unsafe.extend(c for g in self.queue for c in g if c not in self.unsafe)
            self.queue.clear()
            self.result = self._best_passed()
            return
        if not self.queue:
            union = tuple(c for candidate in self.candidates for c in (candidate, *self.members.get(candidate, ()))
                          if c in self.safe)
            if not union or union in self.passed:
                self.result = union
            elif union in self.failed or self.trials >= self.max_trials:
                self.result = self._best_passed()
            else:
                self.confirming = union

    def _fail(self, group: Group) -> None:
        self.failed.append(group)
        if len(group) == 1 and len(self.members.get(group[0], ())) > 1:
            self._fail(tuple(self.members[group[0]]))  # a group of operators that fails whole: try its members
            return
        if len(group) == 1:
            self.unsafe.extend(group)
            return
        first, second = split(group)
        self.siblings[first] = second
        self.queue[0:0] = [first, second]

    def describe(self, group: Sequence[Candidate]) -> str:
        """How a trial of ``group`` is named in the record: ``"group of 4"``, or, for a part of a split by
        dimension, its dimensions and the failing group it was split from, e.g. ``"state of 20, split by dimension
        from a failing saved+state group of 40"`` (the failing group mixed dimensions, so its levers are tried apart
        from each other and from the compute lowerings)."""
        group = tuple(group)
        parent = self._parent(group)
        if parent is None or len(dimensions_of(parent)) < 2 or group not in split(parent):  # halved
            return f"group of {len(group)}"
        return (f"{_named(group)} of {len(group)}, split by dimension from a failing {_named(parent)} group of"
                f" {len(parent)}")

    def _parent(self, group: Group) -> Group | None:
        """The failing group ``group`` was split from: the smallest failed group holding all of it, and more."""
        wanted = set(group)
        holders = [g for g in self.failed if len(g) > len(group) and wanted.issubset(g)]
        return min(holders, key=len) if holders else None

    def _best_passed(self) -> Group:
        if not self.passed:
            return ()
        return max(self.passed, key=lambda g: (sum(self._benefit(c) for c in g), len(g)))

    def _benefit(self, candidate: Candidate) -> float:
        """A candidate's benefit; a member of a split group's, its share of the group's."""
        if candidate in self.benefits:
            return self.benefits[candidate]
        for group, members in self.members.items():
            if candidate in members:
                return self.benefits.get(group, 0.0) / len(members)
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        """Plain-typed state (candidates as ``[operator, dimension]`` pairs)."""
        def groups(items: Sequence[Group]) -> list[list[list[str]]]:
            return [candidates_to_plain(g) for g in items]

        return {
            "candidates": candidates_to_plain(self.candidates),
            "benefits": [[c.to_plain(), float(v)] for c, v in self.benefits.items()],
            "max_trials": self.max_trials,
            "members": [[c.to_plain(), candidates_to_plain(m)] for c, m in self.members.items()],
            "queue": groups(self.queue),
            "safe": candidates_to_plain(self.safe),
            "unsafe": candidates_to_plain(self.unsafe),
            "passed": groups(self.passed),
            "failed": groups(self.failed),
            "siblings": [[candidates_to_plain(a), candidates_to_plain(b)] for a, b in self.siblings.items()],
            "inferred": candidates_to_plain(self.inferred),
            "trials": self.trials,
            "confirming": None if self.confirming is None else candidates_to_plain(self.confirming),
            "result": None if self.result is None else candidates_to_plain(self.result),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> GroupSearch:
        """Rebuild a search from :meth:`state_dict`."""
        return cls(
            candidates=candidates_from_plain(state["candidates"]),
            benefits={Candidate.from_plain(c): float(v) for c, v in state["benefits"]},
            max_trials=int(state["max_trials"]),
            members={Candidate.from_plain(c): candidates_from_plain(m) for c, m in state.get("members", [])},
            queue=[candidates_from_plain(g) for g in state["queue"]],
            safe=list(candidates_from_plain(state["safe"])),
            unsafe=list(candidates_from_plain(state["unsafe"])),
            passed=[candidates_from_plain(g) for g in state["passed"]],
            failed=[candidates_from_plain(g) for g in state["failed"]],
            siblings={candidates_from_plain(a): candidates_from_plain(b) for a, b in state["siblings"]},
            inferred=list(candidates_from_plain(state["inferred"])),
            trials=int(state["trials"]),
            confirming=None if state["confirming"] is None else candidates_from_plain(state["confirming"]),
            result=None if state["result"] is None else candidates_from_plain(state["result"]),
        )
