"""The core: what one ``tx.update`` (or ``apply_step``) runs through.

Holds the transformation and its scaler (``transform``), the three constructors
(``scalers``), the state (``state``), the all-finite check and the unscale
(``numerics``), the choice between a ``jnp.where`` selection and a conditional
(``lowering``, ``jaxpr_select``), the types that name the lowerings (``types``), the
record of which leaves were not finite (``record``) and their names (``labels``),
the reductions across devices (``multi_device``) and the accumulation wrapper the
skip must see through (``accumulation``).

May import: ``_util`` and ``_policies`` (the core applies a policy's rule). Never
``_access``, ``_features``, ``_logs``, ``_integrations`` or a public module.
"""
