"""Reading and reporting the logs that ``optax-dls inspect`` shows.

Reading runs from JSON lines and TensorBoard event files, once or as they grow (``read``),
the columns they hold (``columns``), the summary (``summary``), the diagnosis
(``diagnosis``), the printed report with the saved locate reports (``report``), the plot
(``plot``) and the live view (``live``).

No module here imports JAX, optax or flax: ``inspect`` reads logs on a machine without an
accelerator. May import only ``_logs`` itself and the JAX-free helpers of ``_util``
(``optional``, ``locate_report``).
"""
