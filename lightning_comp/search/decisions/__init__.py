"""Decisions of the search, made from measurements and trial verdicts."""
