"""Reading the logs ``optax-dls inspect`` shows: summary, diagnosis, report, plot and live view.
Imports no JAX, optax or flax: only ``_logs`` and ``_util``'s ``optional`` and ``locate_report``."""
