"""Restoring a loss-scale state from the layouts of other libraries and earlier runs: a state
saved without loss scaling and flax's ``DynamicScale`` (``carry``), without importing flax.
May import: ``_core``, ``_access`` and ``_util``."""
