"""Byte-level data: the Python reference manual shipped with CPython, or any UTF-8 file."""

from __future__ import annotations

import numpy as np


class DataError(ValueError):
  """The text cannot be used for training (missing, empty, too short, not UTF-8)."""


def default_text() -> str:
  """The Python reference manual, ``pydoc_data.topics`` (about 465 KB of English prose on
  Python 3.11; its size follows the Python version)."""
  from pydoc_data import topics

  return "\n".join(topics.topics.values())


def read_text(path: str) -> str:
  """Reads a UTF-8 text file; raises :class:`DataError` with a clear message."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except FileNotFoundError:
    raise DataError(f"--text: no such file: {path!r}") from None
  except OSError as e:
    raise DataError(f"--text: cannot read {path!r}: {e.strerror}") from None
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"--text: {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def split_bytes(text: str, window: int, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
  """UTF-8 bytes of ``text`` as uint8 arrays (train, validation): the last 10% held out.

  Args:
    text: the corpus.
    window: bytes per training example (sequence length + 1); each split
      must hold at least one window.
    val_fraction: share of bytes, from the end, held out for validation.

  Raises:
    DataError: the text is empty or too short for one window in each split.
  """
  data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
  if data.size == 0:
    raise DataError("--text: the file is empty")
  n_val = int(data.size * val_fraction)
  train, val = data[: data.size - n_val], data[data.size - n_val :]
  if min(train.size, val.size) < window:
    need = int(np.ceil(window / val_fraction))
    raise DataError(
      f"the text has {data.size} bytes; with --seq-len {window - 1} it needs at least "
      f"{need} bytes, so that the last {val_fraction:.0%} (validation) holds one window"
    )
  return train, val


def batch_starts(n: int, window: int, steps: int, batch_size: int, seed: int) -> np.ndarray:
  """Random window starts ``[steps, batch_size]``: the data order, the same for every run."""
  return np.random.default_rng(seed).integers(0, n - window + 1, size=(steps, batch_size))


def eval_starts(n: int, window: int, num_batches: int, batch_size: int) -> np.ndarray:
  """Evenly spaced, fixed window starts ``[num_batches, batch_size]`` over a split."""
  count = num_batches * batch_size
  return np.linspace(0, n - window, count).astype(np.int64).reshape(num_batches, batch_size)


def gather(data: np.ndarray, starts: np.ndarray, window: int) -> np.ndarray:
  """int32 windows ``[*starts.shape, window]`` of ``data`` beginning at ``starts``."""
  return data[starts[..., None] + np.arange(window)].astype(np.int32)
