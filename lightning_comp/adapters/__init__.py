"""Adapters: the one place each for private Lightning and private torch attributes the package touches."""
