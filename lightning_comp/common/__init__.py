"""Helpers every layer uses: enums spelled in configs, walking nested structures of tensors, plain-text tables,
JSON-able values. They know nothing of plans, models or Lightning."""
