"""Restoring a loss-scale state from the layouts of other libraries and earlier runs: a state
saved without loss scaling (``carry``) and flax's ``DynamicScale`` (``dynamic_scale``), none
importing flax. May import: ``_core``, ``_access`` and ``_util``."""
