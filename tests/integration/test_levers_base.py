"""Where the levers' base rule chooses an alternative to the candidates, the memory search spends the levers on both
on the Trainer path and keeps the better end; the record names the other.

The rule's choice is pinned (the policy is told AMP's plan won) and so are the candidates (``fixed_search``), so the
path taken does not depend on how fast bf16 is on this CPU; which end is kept does, and the test checks that the one
kept is the better by the policy's own rule, that the trialled plan is the kept base and that the plan trained is the
search's chosen one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_comp import CoMPPrecision
from lightning_comp.search.decisions.objectives import MemoryPolicy
from lightning_comp.search.decisions.whole_step import ComparedPlan, StepComparison
from lightning_comp.search.record.text import format_record
from lightning_comp.search.stages import batch_stage
from tests.helpers.search_models import AdamWMLP, fixed_search, loaders, search_trainer

AMP = ComparedPlan.AMP


@pytest.mark.slow
def test_the_levers_are_spent_on_the_candidates_beside_the_rules_choice_and_the_better_end_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = MemoryPolicy.winner

    def amp_wins(self: MemoryPolicy, steps: StepComparison, saved: dict[ComparedPlan, float],
                 labels: list[ComparedPlan], have_candidates: bool) -> ComparedPlan | None:
        return AMP if AMP in labels else original(self, steps, saved, labels, have_candidates)

    monkeypatch.setattr(MemoryPolicy, "winner", amp_wins)
    monkeypatch.setattr(batch_stage, "measured_beside",
                        lambda policy, steps, saved, labels, have, base: base if base is AMP and have else None)
    pl.seed_everything(0)
    search = fixed_search(objective="memory", precisions={"saved": "bf16", "master": "off"}, max_trials=3,
                          exclude=["a?"])
    plugin = CoMPPrecision()
    search_trainer(tmp_path, [search], max_epochs=3, plugin=plugin).fit(AdamWMLP(), *loaders())
    record: dict[str, Any] | None = search.record
    assert record is not None
    spending, other = record["memory_spending"], record["memory_spending"]["other_base"]
    assert other is not None, spending
    kept_candidates = other["base"] != "the candidate plan"
    assert record["trialled_plan"]["from"] == ("candidates" if kept_candidates else "amp")
    if other["why"].startswith("leaner"):
        assert spending["final_mib"] < other["final_mib"]
    else:  # a tie keeps the candidates; a bound or a budget decides otherwise
        assert other["why"] == "no worse (a tie keeps the candidates)" and kept_candidates \
            or other["why"].startswith("within its bound")
    assert f"The levers were also spent on {other['base']}" in format_record(record)
    # the plan trained is the search's chosen plan, built on the kept base
    lowered = {name for name, precision in plugin.executor.precisions().items() if precision.is_low}
    named = {name for name in record["lowered_operators"] if "*" not in name}  # (groups are listed by pattern too)
    assert lowered == named, (lowered, record["lowered_operators"])
