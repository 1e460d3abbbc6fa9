"""Rewinding trials: snapshots of a run, the loop budget, paused callbacks."""
