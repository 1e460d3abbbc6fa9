"""Devices: what a device runs natively, and which way of lowering each operator runs there.

Everything device-dependent is decided here from the device a model trains on: its :class:`DeviceClass` (which 16-bit
precisions are native; :func:`device_class`), the :class:`Lowering` of each operator there (:func:`lowering_for`), and
how much slower an emulated precision computes. Each module's docstring says what it holds.
"""

from lightning_comp.devices.device_classes import DeviceClass, device_class, model_device
from lightning_comp.devices.lowering import Lowering, lowering_for

__all__ = ["DeviceClass", "Lowering", "device_class", "lowering_for", "model_device"]
