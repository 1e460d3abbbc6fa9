"""Finding the operators that are unsafe in low precision with few convergence trials (adaptive group testing).

The search starts with every candidate lowered at once. A group that converges is safe as a whole; a group that
does not is split in two and each half is tried alone, down to single operators, which are then marked unsafe. When
the first half of a failing group passes, the second half is known to fail without a trial and is split at once.
With ``u`` unsafe operators among ``n`` candidates this needs at most about ``1 + 2u log2(n)`` trials: the cost grows
with the number of unsafe operators, not with the number of operators. Operators that are safe one group at a
time may still fail together, so when the safe set was never tried as a whole, a confirming trial tries it; if
that fails (or the safe set is a group that already failed), the passing group with the largest estimated gain
is used. A candidate that names a group of operators playing the same part in repeated blocks (one glob,
:mod:`lightning_comp.search.decisions.groups`) is tried whole first; when it fails alone, it is split into its
members like any failing group, so one unsafe block does not keep the others in FP32.

The class is a small explicit state machine with ``state_dict``/``load_state_dict`` so a search interrupted by a
crash resumes where it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_comp.errors import UsageError
from lightning_comp.search.candidates import Candidate, candidates_from_plain, candidates_to_plain

__all__ = ["Group", "GroupSearch"]

Group = tuple[Candidate, ...]


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
        half = len(group) // 2
        first, second = group[:half], group[half:]
        self.siblings[first] = second
        self.queue[0:0] = [first, second]

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
