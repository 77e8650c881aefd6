"""Shared helpers: argument checks (``validation``), pytree paths (``tree_paths``), calling a
user's function (``calls``), optional extras (``optional``), supported versions (``versions``),
Equinox models (``model``), the locate report (``locate_report``), warning frames (``frames``).
May import nothing else from the package; ``optional`` and ``locate_report`` import no JAX.
"""
