"""Decisions of the search, made from measurements and trial verdicts (no Trainer needed to test them): per operator,
per saved precision and parameter format, per whole step, per trial; the objectives' policies and adaptive group
testing. Each module's docstring says what it decides.
"""
