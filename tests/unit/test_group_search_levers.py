"""Adaptive group testing across dimensions: a failing group that mixes dimensions is split by dimension before it
is halved, so a memory lever that breaks convergence is dropped without the operator's compute lowering.

The oracle is simulated: a set of unsafe candidates (a master candidate computes in low precision with its bf16
parameters, so it fails where its operator's compute candidate is unsafe), and optionally sets of candidates that
fail only together.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Mapping

import pytest

from lightning_comp.errors import UsageError
from lightning_comp.plan.dimensions import Dimension
from lightning_comp.search.candidates import Candidate
from lightning_comp.search.decisions.group_search import Group, GroupSearch, dimensions_of, split

Oracle = Callable[[Group], bool]


def _candidates(operators: int, dimensions: Iterable[Dimension]) -> Group:
    """Each operator's candidates of ``dimensions`` adjacent, in execution order (as the batch stage lists them)."""
    dims = tuple(dimensions)
    return tuple(Candidate(f"op{i}", d) for i in range(operators) for d in dims)


def _lowered(group: Iterable[Candidate], members: Mapping[Candidate, Group]) -> set[Candidate]:
    """What a trial of ``group`` lowers: a glob's members, and the compute of each master candidate's operator."""
    out: set[Candidate] = set()
    for candidate in group:
        for c in members.get(candidate) or (candidate,):
            out.add(c)
            if c.dimension is Dimension.MASTER:
                out.add(Candidate(c.operator))
    return out


def _oracle(unsafe: set[Candidate], members: Mapping[Candidate, Group] | None = None,
            together: Iterable[frozenset[Candidate]] = ()) -> Oracle:
    members = members or {}
    pairs = list(together)

    def converges(group: Group) -> bool:
        lowered = _lowered(group, members)
        return not (lowered & unsafe) and not any(pair <= lowered for pair in pairs)

    return converges


def _run(search: GroupSearch, converges: Oracle, checkpoint: bool = True) -> tuple[GroupSearch, list[Group]]:
    """Answer the search's trials with ``converges`` until it is done (through a checkpoint after every verdict)."""
    tried: list[Group] = []
    start = search.trials
    while not search.done:
        group = search.next_group()
        assert group is not None
        tried.append(group)
        search.report(group, converges(group))
        if checkpoint:
            search = GroupSearch.from_state(json.loads(json.dumps(search.state_dict())))
    assert search.trials == start + len(tried)
    return search, tried


def _bound(search: GroupSearch, failing: int) -> int:
    """The module's bound: ``1 + 2u(D - 1 + ceil(log2 n))`` trials, plus the confirming one."""
    per_dimension = [sum(c.lever == d for c in search.candidates) for d in dimensions_of(search.candidates)]
    levels = len(per_dimension) - 1 + math.ceil(math.log2(max(per_dimension)))
    return 1 + 2 * max(1, failing) * levels + 1


def _safe(candidates: Group, converges: Oracle) -> set[Candidate]:
    return {c for c in candidates if converges((c,))}


def test_one_unsafe_state_lever_among_twenty_operators_keeps_every_compute_lowering() -> None:
    candidates = _candidates(20, (Dimension.COMPUTE, Dimension.SAVED, Dimension.STATE))
    bad = Candidate.state("op7")
    converges = _oracle({bad})
    search, tried = _run(GroupSearch(candidates, max_trials=64), converges)
    compute = tuple(c for c in candidates if c.dimension is Dimension.COMPUTE)
    memory = tuple(c for c in candidates if c.dimension is not Dimension.COMPUTE)
    assert set(search.result or ()) == set(candidates) - {bad}
    assert search.unsafe == [bad]
    assert tried[:2] == [candidates, compute]  # the compute lowerings are tried whole, apart from the levers
    assert memory not in tried and search.inferred[:len(memory)] == list(memory)  # inferred to fail: no trial
    assert tried[2] == tuple(c for c in candidates if c.dimension is Dimension.SAVED)  # then the saved levers whole
    assert all(dimensions_of(g) == (Dimension.STATE,) for g in tried[3:-1])  # halving among the state levers only
    assert search.trials <= _bound(search, 1)


def test_a_failing_state_lever_costs_no_compute_lowering_when_the_trial_budget_runs_out() -> None:
    """However few trials are allowed, once the all-candidates trial has failed the next one tries every compute
    lowering whole, and the fallback (the passing group of the largest benefit) keeps it."""
    candidates = _candidates(20, (Dimension.COMPUTE, Dimension.SAVED, Dimension.STATE))
    weight = {Dimension.COMPUTE: 1.0, Dimension.SAVED: 0.3, Dimension.STATE: 0.2}
    benefits = {c: weight[c.dimension] for c in candidates}
    bad = Candidate.state("op7")
    compute = {c for c in candidates if c.dimension is Dimension.COMPUTE}
    exact = None
    for max_trials in range(2, 13):
        search, tried = _run(GroupSearch(candidates, benefits, max_trials=max_trials), _oracle({bad}))
        result = set(search.result or ())
        assert len(tried) <= max_trials
        assert compute <= result and bad not in result, max_trials
        if result == set(candidates) - {bad} and exact is None:
            exact = max_trials
    assert exact is not None and exact <= _bound(GroupSearch(candidates), 1)


@pytest.mark.parametrize("unsafe", [
    set(),
    {Candidate("op3")},
    {Candidate.saved("op1"), Candidate.state("op5")},
    {Candidate("op2"), Candidate.master("op6")},  # op2's master fails with its compute
    {Candidate.state("op0"), Candidate.state("op1"), Candidate.saved("op4")},
    {Candidate.master("op7")},
    {Candidate("op0"), Candidate.saved("op0"), Candidate.state("op0"), Candidate.master("op0")},
])
def test_mixed_unsafe_sets_end_with_exactly_the_safe_candidates(unsafe: set[Candidate]) -> None:
    candidates = _candidates(8, Dimension)
    converges = _oracle(unsafe)
    safe = _safe(candidates, converges)
    search, tried = _run(GroupSearch(candidates, max_trials=64), converges)
    assert set(search.result or ()) == safe
    assert set(search.unsafe) == set(candidates) - safe
    assert search.trials <= _bound(search, len(candidates) - len(safe))
    # every compute candidate whose operator is safe in low precision is kept, whatever its levers do
    assert {c for c in candidates if c.dimension is Dimension.COMPUTE and c not in unsafe} <= safe
    confirming = tuple(c for c in candidates if c in safe)
    for group in tried:  # but the first and the confirming trial, no trial lowers compute beside a lever
        assert group in (candidates, confirming) or dimensions_of(group)[0] != Dimension.COMPUTE or len(
            dimensions_of(group)) == 1


def test_random_unsafe_sets_are_found_exactly_within_the_bound() -> None:
    rng = random.Random(0)
    for case in range(150):
        operators = rng.randint(1, 12)
        dims = tuple(d for d in Dimension if d is Dimension.COMPUTE or rng.random() < 0.6)
        candidates = _candidates(operators, dims)
        unsafe = {c for c in candidates if rng.random() < 0.12}
        converges = _oracle(unsafe)
        safe = _safe(candidates, converges)
        search, _ = _run(GroupSearch(candidates, max_trials=1000), converges, checkpoint=case % 3 == 0)
        assert set(search.result or ()) == safe, (case, unsafe)
        assert search.trials <= _bound(search, len(candidates) - len(safe)), (case, unsafe)


def test_a_search_resumed_from_its_state_midway_ends_as_one_left_alone() -> None:
    candidates = _candidates(10, Dimension)
    converges = _oracle({Candidate.state("op3"), Candidate("op8")})
    alone, tried_alone = _run(GroupSearch(candidates, max_trials=64), converges, checkpoint=False)
    for stop in range(1, len(tried_alone)):
        search = GroupSearch(candidates, max_trials=64)
        for _ in range(stop):
            group = search.next_group()
            assert group is not None
            search.report(group, converges(group))
        resumed, tried_after = _run(GroupSearch.from_state(json.loads(json.dumps(search.state_dict()))), converges)
        assert tried_alone[stop:] == tried_after
        assert resumed.result == alone.result and resumed.unsafe == alone.unsafe and resumed.trials == alone.trials


def test_a_state_written_by_plain_halving_resumes_and_splits_by_dimension_from_then_on() -> None:
    """A checkpoint from before splits by dimension has the same keys; its queued mixed halves are tried as they
    are, and a half that fails is split by dimension."""
    a, b = Candidate("a"), Candidate("b")
    sa, sb = Candidate.state("a"), Candidate.state("b")
    root = (a, sa, b, sb)
    old = GroupSearch(root, max_trials=16).state_dict()
    first, second = [a.to_plain(), sa.to_plain()], [b.to_plain(), sb.to_plain()]
    old.update(queue=[first, second], failed=[[c.to_plain() for c in root]], siblings=[[first, second]], trials=1)
    search = GroupSearch.from_state(old)
    assert search.describe((a, sa)) == "group of 2"  # a half of the old split, not a split by dimension
    search, tried = _run(search, _oracle({sb}))
    assert tried == [(a, sa), (b,), (a, sa, b)]  # (b, sb) inferred to fail, split by dimension; (sb,) inferred
    assert search.result == (a, sa, b) and search.unsafe == [sb]


def test_the_parts_of_a_split_by_dimension_say_so_and_halves_do_not() -> None:
    candidates = _candidates(20, (Dimension.COMPUTE, Dimension.SAVED, Dimension.STATE))
    search = GroupSearch(candidates, max_trials=64)
    search.report(candidates, False)
    compute = search.next_group()
    assert compute is not None
    assert search.describe(compute) == ("compute of 20, split by dimension from a failing compute+saved+state group"
                                        " of 60")
    search.report(compute, True)  # the levers are inferred to fail and split at once: saved apart from state
    saved = search.next_group()
    assert saved is not None
    assert search.describe(saved) == "saved of 20, split by dimension from a failing saved+state group of 40"
    search.report(saved, False)
    assert search.describe(search.next_group() or ()) == "group of 10"  # a half of the saved levers


def test_a_glob_is_split_into_its_members_within_its_dimension() -> None:
    glob, head = Candidate("blocks.*.fc"), Candidate("head")
    names = [f"blocks.{i}.fc" for i in range(4)]
    members = {glob: tuple(Candidate(n) for n in names)}
    states = tuple(Candidate.state(n) for n in names)
    candidates = (glob, *states[:1], *states[1:], head)
    unsafe = {Candidate("blocks.2.fc"), Candidate.state("blocks.0.fc")}
    search, tried = _run(GroupSearch(candidates, {glob: 8.0, head: 1.0}, max_trials=64, members=members),
                         _oracle(unsafe, members))
    assert tried[1] == (glob, head)  # the compute lowerings whole, the glob with them
    result = set(search.result or ())
    assert result == {head, *(Candidate(n) for n in names if n != "blocks.2.fc"), *states[1:]}
    assert glob not in search.unsafe and set(search.unsafe) == unsafe


def test_lowerings_that_fail_only_together_fall_back_to_the_compute_lowerings_by_benefit() -> None:
    candidates = _candidates(6, (Dimension.COMPUTE, Dimension.STATE))
    benefits = {c: 1.0 if c.dimension is Dimension.COMPUTE else 0.5 for c in candidates}
    pair = frozenset({Candidate("op1"), Candidate.state("op4")})  # each converges without the other
    search, tried = _run(GroupSearch(candidates, benefits, max_trials=64), _oracle(set(), together=[pair]))
    compute = tuple(c for c in candidates if c.dimension is Dimension.COMPUTE)
    # the state levers were tried without the compute lowerings: a part passing implies its sibling fails, which
    # isolates op5's state lever by inference; the safe set together fails its confirming trial
    assert search.unsafe == [Candidate.state("op5")]
    assert tried[-1] == tuple(c for c in candidates if c != Candidate.state("op5"))
    assert search.result == compute  # the passing group with the largest benefit


def test_only_a_group_of_two_or_more_is_split() -> None:
    with pytest.raises(UsageError, match=r"two or more candidates.*Candidate\(operator='a'"):
        split((Candidate("a"),))
    a, b, c = Candidate("a"), Candidate("b"), Candidate("c")
    assert split((a, b, c)) == ((a,), (b, c))  # one dimension: halves
    master, saved = Candidate.master("a"), Candidate.saved("b")
    assert split((master, saved, a)) == ((a,), (master, saved))  # by dimension, compute first, in the group's order
    assert split((master, saved)) == ((saved,), (master,))
