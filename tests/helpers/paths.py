"""Where the repository, its examples and the tests' subprocess scripts are."""

from __future__ import annotations

from pathlib import Path

__all__ = ["REPO", "SCRIPTS"]

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "scripts"
