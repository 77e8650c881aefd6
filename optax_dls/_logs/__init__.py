"""Reading and reporting the logs that ``optax-dls inspect`` shows.

Loading runs from JSON lines and TensorBoard event files (``load``, ``tail``), the
columns they hold (``columns``), the summary (``summary``), the diagnosis
(``diagnosis``), the printed report (``report``), the plot (``plot``), the live view
(``live``) and a saved locate report (``locate_view``).

No module here imports JAX, optax or flax: ``inspect`` reads logs on a machine
without an accelerator. May import only ``_logs`` itself and the JAX-free helpers of
``_util`` (``optional``, ``locate_report``).
"""
