"""Operators: the units of work of a model that a plan assigns a precision to."""
