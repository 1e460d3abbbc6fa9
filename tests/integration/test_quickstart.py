"""The README's main job (examples/quickstart.py) runs end to end in a tiny configuration."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

ROOT = REPO


@pytest.mark.slow
def test_quickstart_runs_search_and_training(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    result = quickstart.main(["--epochs", "3", "--width", "128", "--samples", "800", "--batch-size", "64",
                              "--out", str(tmp_path)])
    assert math.isfinite(result["val_loss"]) and 0.0 <= result["val_acc"] <= 1.0
    records = list(tmp_path.rglob("search_record.json"))
    assert records, "the search record is written next to the logs"
    record = json.loads(records[0].read_text())
    assert record["chosen_plan"]["format"] == "lightning-comp/plan"


def test_readme_opens_with_exactly_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- ci-commands -->", 1)[1].split("<!-- /ci-commands -->", 1)[0]
    commands = [line for line in block.splitlines() if line.startswith(("python", "pip"))]
    assert len(commands) == 2
    assert "pytest" in commands[1] and "pytest" not in commands[0]
    assert text.index("<!-- ci-commands -->") < 40, "the set-up commands open the README"
