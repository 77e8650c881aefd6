"""Reading a whole log file at once, as the tests check what was written."""

from optax_dls._logs.read import LogFile


def _read(path, kind, on_bad):
  rows, bad, _ = LogFile(str(path), kind).read(final=True)
  for where, why in bad:
    if on_bad is not None:
      on_bad(where, why)
  return rows


def read_jsonl(path, on_bad=None):
  """The JSON objects with a ``step`` of a JSON-lines file, in file order; each other line
  (blank ones aside) handed to ``on_bad(line number, why)``."""
  return _read(path, "jsonl", on_bad)


def read_tensorboard(path, on_bad=None):
  """The scalars and leaf records of an event file, a row per step, sorted by step; each bad
  record, and the bytes after a corrupt one, handed to ``on_bad(offset, why)``."""
  return _read(path, "events", on_bad)
