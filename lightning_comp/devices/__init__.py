"""Devices: what a device runs natively, and which way of lowering each operator runs there.

===================  ==========================================================================================
module               what it holds
===================  ==========================================================================================
``cpu_features``     the CPU's vector ISA, native 16-bit features and name
``device_class``     :class:`DeviceClass` and :func:`device_class`: which 16-bit precisions a device runs natively
``emulation_speed``  how much slower an emulated 16-bit precision computes there, and why nothing pays, in words
``kernel_probes``    which way of lowering a recurrent module runs on a device, tried on a tiny copy
``lowering``         :class:`Lowering` and :func:`lowering_for`: how each operator is lowered on each device
===================  ==========================================================================================
"""

from lightning_comp.devices.device_classes import DeviceClass, device_class, model_device
from lightning_comp.devices.lowering import Lowering, lowering_for

__all__ = ["DeviceClass", "Lowering", "device_class", "lowering_for", "model_device"]
