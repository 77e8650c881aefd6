"""Restoring a loss-scale state from the layouts of other libraries and earlier runs.

A state saved without loss scaling carried into a loss-scaled target (``carry``, behind
:func:`optax_dls.checkpoint.into_loss_scaled`) and the port of flax's ``DynamicScale``
(``dynamic_scale``). None of them imports flax.

May import: ``_core``, ``_access`` and ``_util``.
"""
