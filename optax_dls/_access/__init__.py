"""Reading and changing a loss-scale state from outside the update: finding it (``find``), the
scaled loss (``loss``), logging scalars (``metrics``), non-finite leaf names (``names``) and
setting the scale (``reset``). May import ``_core`` and ``_util``."""
