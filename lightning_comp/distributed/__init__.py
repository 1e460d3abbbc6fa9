"""Data-parallel training across many workers: half-precision gradient traffic, a worker-scaled learning rate."""
