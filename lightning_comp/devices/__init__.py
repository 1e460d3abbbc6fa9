"""Devices: what a device runs natively, and which way of lowering an operator runs there."""
