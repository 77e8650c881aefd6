"""What ties the state to other libraries' machinery.

flax's serialization registry for ``LossScaleState`` (``flax_serialization``) and the
port of flax's ``DynamicScale`` (``dynamic_scale``).

May import: ``_core``, ``_access`` and ``_util``.
"""
