"""The core: what one ``tx.update`` runs through.

Holds the transformation (``transform``: ``loss_scaled``'s two closures), the three
constructors (``scalers``), the state (``state``), the exact check and the unscale
(``numerics``), the skip and its two lowerings (``skip``), the record of which leaves
were not finite (``record``) and their names and labels (``labels``), the reductions
across devices (``multi_device``) and the accumulation wrapper the skip must see through
(``accumulation``).

May import: ``_util`` and ``_policies`` (the core applies a policy's rule). Never
``_access``, ``_features``, ``_logs``, ``_integrations`` or a public module.
"""
