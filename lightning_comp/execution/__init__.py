"""Executing a precision plan on a model: hooks, cast boundaries, weight casts, saved tensors, loss scaling."""
