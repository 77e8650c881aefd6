"""Reading the logs ``optax-dls inspect`` shows: summary, diagnosis, report, plot and live view.
May import only ``_logs`` and ``_util``'s ``optional``, ``locate_report`` (no JAX, optax, flax)."""
