"""The optional features that compose around the core.

Recomputing a skipped step's gradients (``recompute``, ``recompute_stats``), the underflow
statistics (``underflow``), skip alerts (``alerts``), the casting policy (``casting``) and finding
the operation that overflowed (``locate``, reading source lines with ``jax_source``).

May import: ``_core``, ``_access``, ``_policies`` and ``_util``. The core never imports a feature.
"""
