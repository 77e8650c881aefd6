"""Reading and reporting the logs that ``optax-dls inspect`` shows: reading, columns,
summary, diagnosis, the printed report, the plot and the live view. No module here imports
JAX, optax or flax; may import only ``_logs`` itself and the JAX-free helpers of ``_util``
(``optional``, ``locate_report``)."""
