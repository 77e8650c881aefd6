"""The optional features around the core: recomputing overflowing steps (``recompute``,
``recompute_stats``), underflow statistics, skip alerts, casting policies and ``locate``.
May import ``_core``, ``_access``, ``_policies`` and ``_util``; the core never imports a feature."""
