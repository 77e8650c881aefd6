"""Small helpers that several concerns share, each named for what it does.

Argument checks (``validation``), paths and leaves of pytrees (``tree_paths``), calling a user's
function with its own convention (``calls``), optional extras (``optional``), supported versions
(``versions``), splitting an Equinox model into arrays and the rest (``model``), the locate report's
types (``locate_report``) and the user's frame a warning points at (``frames``).

May import: nothing else from the package (and the helpers ``optional`` and ``locate_report`` import
no JAX, for ``_logs``).
"""
