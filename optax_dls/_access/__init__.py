"""Reading and changing a loss-scale state from outside the update.

Finding the state inside any optimizer state (``find``), the loss times the scale (``loss``), the
scalars for logging (``metrics``), the names of the leaves that were not finite (``names``) and
setting the scale (``reset``).

May import: ``_core`` and ``_util``.
"""
