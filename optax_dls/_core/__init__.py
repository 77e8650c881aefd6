"""The core, what one ``tx.update`` runs through: the transformation (``transform``), its
constructors (``scalers``), the state, the exact check and unscale (``numerics``), the skip,
the record of non-finite leaves and their labels, the reductions across devices and the
accumulation wrapper. May import ``_util``, ``_policies``; never a feature or public module.
"""
