"""Numerics: the precisions a plan can assign, and the codecs that store saved tensors at lower precision."""
