"""Writing loss-scale metrics to JSONL and TensorBoard every ``k`` steps.

``MetricsWriter.log(step, metrics)`` decides on a Python ``int`` whether to
write; only then does it move the (device) values to the host, so steps that
are not logged cost no device-to-host transfer. The files are what
``optax-dls inspect`` reads.

Example::

    with optax_dls.writers.MetricsWriter("runs/exp1", every=10, run_name="exp1") as w:
      for step in range(num_steps):
        params, opt_state, loss = train_step(params, opt_state, batch)
        w.log(step, optax_dls.metrics(opt_state), loss=loss)
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

JSONL_NAME = "metrics.jsonl"


_RESERVED = ("step", "run")


def _to_python(name: str, value: Any) -> Any:
  """A host scalar as a JSON-friendly Python value (bool, int, float, str)."""
  if isinstance(value, (str, bool)) or value is None:
    return value
  arr = np.asarray(value)
  if arr.ndim:
    raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {arr.shape}.")
  if not (np.issubdtype(arr.dtype, np.bool_) or np.issubdtype(arr.dtype, np.integer)
          or np.issubdtype(arr.dtype, np.floating)):
    raise TypeError(f"metric {name!r} must be a real number or bool, got {value!r} of type "
                    f"{type(value).__name__}.")
  item = arr.item()
  if isinstance(item, (bool, np.bool_)):
    return bool(item)
  return item


class MetricsWriter:
  """Writes scalar metrics every ``every`` steps as JSON lines and TensorBoard events.

  One JSON object per logged step goes to ``<logdir>/metrics.jsonl``: ``{"step":
  int, "run": run_name (if given), <metric>: value, ...}``, with bools as
  ``true``/``false`` and non-finite floats as ``NaN`` / ``Infinity``. With
  ``tensorboard=True`` every finite numeric value is also written as a
  TensorBoard scalar (tag = the metric key, e.g. ``loss_scale``,
  ``underflow/zero_frac``) with a ``tensorboardX.SummaryWriter`` on
  ``logdir``; non-finite values (``grad_norm`` on a skipped step) are kept in
  the JSON lines only.

  Args:
    logdir: folder to write into (created if missing).
    every: int >= 1, log the steps with ``step % every == 0``. Default 1.
    tensorboard: bool, also write TensorBoard events (needs ``tensorboardX``).
      Default True.
    jsonl: bool, write ``metrics.jsonl``. Default True.
    run_name: optional str stored in every JSON line under ``"run"``.

  Raises:
    ValueError: ``every`` < 1, or both outputs off.
    TypeError: ``every`` not an int, ``tensorboard`` / ``jsonl`` not a bool,
      ``run_name`` neither a str nor None.
    ImportError: ``tensorboard=True`` without ``tensorboardX`` installed.
  """

  def __init__(self, logdir: str | os.PathLike, *, every: int = 1, tensorboard: bool = True,
               jsonl: bool = True, run_name: str | None = None):
    if isinstance(every, bool) or not isinstance(every, numbers.Integral):
      raise TypeError(f"every must be an int, got {every!r}.")
    if every < 1:
      raise ValueError(f"every must be >= 1, got every={every!r}.")
    for name, flag in (("tensorboard", tensorboard), ("jsonl", jsonl)):
      if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {flag!r} of type {type(flag).__name__}.")
    if run_name is not None and not isinstance(run_name, str):
      raise TypeError(f"run_name must be a str or None, got {run_name!r} of type {type(run_name).__name__}.")
    if not (tensorboard or jsonl):
      raise ValueError("MetricsWriter needs tensorboard=True or jsonl=True, got both False.")
    self.logdir = os.fspath(logdir)
    self.every = int(every)
    self.run_name = run_name
    os.makedirs(self.logdir, exist_ok=True)
    self._tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError as e:
        raise ImportError("MetricsWriter(tensorboard=True) needs tensorboardX: "
                          "pip install tensorboardX, or pass tensorboard=False.") from e
      self._tb = SummaryWriter(self.logdir)
    self._jsonl = open(os.path.join(self.logdir, JSONL_NAME), "a") if jsonl else None

  def log(self, step: int, metrics: Mapping[str, Any], **extra: Any) -> bool:
    """Writes ``metrics`` and ``extra`` for ``step`` if ``step % every == 0``.

    Args:
      step: a Python int (or NumPy integer), the training step. A JAX array
        is refused: reading it would be a device-to-host transfer on every
        step.
      metrics: a mapping of scalar values (JAX or NumPy arrays, numbers,
        bools), e.g. :func:`optax_dls.metrics` of the optimizer state.
      **extra: more scalars to write, e.g. ``loss=loss``.

    Returns:
      True when the step was written.

    Raises:
      TypeError: ``step`` is not a Python / NumPy integer, ``metrics`` is not a
        mapping, a metric name is not a str, or a value is not a real number,
        bool or str.
      ValueError: a value is not a scalar, or a metric is named ``"step"`` or
        ``"run"`` (reserved columns of every row).
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
      raise TypeError(f"step must be a Python int, got {step!r} of type {type(step).__name__}.")
    step = int(step)
    if step % self.every:
      return False
    if not isinstance(metrics, Mapping):
      raise TypeError(f"metrics must be a mapping of metric names to scalars, got {metrics!r} "
                      f"of type {type(metrics).__name__}.")
    values = {**metrics, **extra}
    for key in values:
      if not isinstance(key, str):
        raise TypeError(f"metric names must be strings, got {key!r} of type {type(key).__name__}.")
      if key in _RESERVED:
        raise ValueError(f"metric name {key!r} is reserved ({_RESERVED} are columns of every "
                         "logged row); rename the metric.")
    values = jax.device_get(values)
    row = {"step": step}
    if self.run_name is not None:
      row["run"] = self.run_name
    row.update({k: _to_python(k, v) for k, v in values.items()})
    if self._jsonl is not None:
      self._jsonl.write(json.dumps(row) + "\n")
      self._jsonl.flush()
    if self._tb is not None:
      for key, value in row.items():
        # Non-finite values (grad_norm on a skipped step) stay in the JSONL only.
        if key != "step" and isinstance(value, (bool, int, float)) and math.isfinite(value):
          self._tb.add_scalar(key, float(value), step)
    return True

  def flush(self) -> None:
    """Flushes both outputs."""
    if self._jsonl is not None:
      self._jsonl.flush()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes both outputs; further ``log`` calls raise ``ValueError``."""
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  """The rows of a ``metrics.jsonl`` file (blank and malformed lines skipped)."""
  rows = []
  with open(path, encoding="utf-8", errors="replace") as f:  # undecodable bytes: a malformed line
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict) and "step" in row:
        rows.append(row)
  return rows


def read_tensorboard(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Scalars of one TensorBoard event file as rows ``{"step": s, tag: value, ...}``.

  Reads the TFRecord framing directly and parses each record with the
  ``Event`` protobuf that ``tensorboardX`` ships (no TensorFlow or
  TensorBoard needed). Scalars written as ``simple_value`` or as a
  one-element float tensor are read; other summaries are ignored.

  Raises:
    ImportError: ``tensorboardX`` is not installed.
  """
  from tensorboardX.proto import event_pb2

  by_step: dict[int, dict[str, Any]] = {}
  with open(path, "rb") as f:
    data = f.read()
  pos = 0
  while pos + 12 <= len(data):
    (length,) = np.frombuffer(data[pos:pos + 8], "<u8")
    start = pos + 12
    end = start + int(length)
    if end + 4 > len(data):
      break  # a record still being written
    event = event_pb2.Event.FromString(data[start:end])
    pos = end + 4
    for v in event.summary.value:
      if v.HasField("simple_value"):
        value = float(v.simple_value)
      elif v.HasField("tensor") and len(v.tensor.float_val) == 1:
        value = float(v.tensor.float_val[0])
      else:
        continue
      by_step.setdefault(int(event.step), {"step": int(event.step)})[v.tag] = value
  return [by_step[s] for s in sorted(by_step)]


