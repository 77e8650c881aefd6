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
import struct
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

JSONL_NAME = "metrics.jsonl"


_RESERVED = ("step", "run")


def _to_python(name: str, value: Any) -> Any:
  """A host scalar as a JSON-friendly Python value (bool, int, float, str or None).

  Takes Python numbers, NumPy and JAX scalars and 0-d arrays of any real
  dtype: bool, every integer width (``int4`` included) and every float width
  (``float16``, ``bfloat16``, the ``float8`` types, ...).
  """
  if value is None or isinstance(value, (str, bool)):
    return value
  if isinstance(value, int):
    return int(value)  # any size: JSON holds it exactly
  if isinstance(value, float):
    return float(value)  # numpy.float64 included
  if isinstance(value, numbers.Real) and not isinstance(value, (np.generic, np.ndarray, jax.Array)):
    return float(value)  # e.g. fractions.Fraction
  arr = np.asarray(value)
  if arr.ndim:
    raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {arr.shape}.")
  if jnp.issubdtype(arr.dtype, jnp.bool_):
    return bool(arr)
  if jnp.issubdtype(arr.dtype, jnp.integer):
    return int(arr)
  if jnp.issubdtype(arr.dtype, jnp.floating):
    return float(arr)
  raise TypeError(
    f"metric {name!r} must be a real number or bool, got {value!r} of type {type(value).__name__}."
  )


def _tensorboard_value(value: Any) -> float | None:
  """``value`` as the float of a TensorBoard scalar, or None for strings, None, and non-finite
  or out-of-float-range numbers (those stay in the JSON lines only)."""
  if value is None or isinstance(value, str):
    return None
  try:
    value = float(value)
  except OverflowError:  # an int beyond the float range
    return None
  return value if math.isfinite(value) else None


def _check_path(name: str, value: Any) -> str:
  """``value`` as a str path; TypeError naming ``name`` unless it is a ``str`` or ``os.PathLike``."""
  if not isinstance(value, (str, os.PathLike)):
    raise TypeError(
      f"{name} must be a str or os.PathLike, got {value!r} of type {type(value).__name__}."
    )
  return os.fspath(value)


def _ends_without_newline(path: str) -> bool:
  """Whether the file at ``path`` exists, is not empty and its last byte is not a newline."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      if f.tell() == 0:
        return False
      f.seek(-1, os.SEEK_END)
      return f.read(1) != b"\n"
  except FileNotFoundError:
    return False


def _write_all(f: Any, data: bytes) -> None:
  """Writes ``data`` to the unbuffered binary file ``f`` (a raw write may be partial)."""
  view = memoryview(data)
  while view:
    view = view[f.write(view) :]


class MetricsWriter:
  """Writes scalar metrics every ``every`` steps as JSON lines and TensorBoard events.

  One JSON object per logged step goes to ``<logdir>/metrics.jsonl``: ``{"step":
  int, "run": run_name (if given), <metric>: value, ...}``, with bools as
  ``true``/``false`` and non-finite floats as ``NaN`` / ``Infinity``. The file
  is opened for appending, so a resumed run continues it; if its last line was
  cut short (a crash in the middle of a write), a newline is written first so
  that the new rows start on lines of their own. Each row is written with one
  unbuffered append, so several writers may share a folder.

  With ``tensorboard=True`` every finite numeric value is also written as a
  TensorBoard scalar (tag = the metric key, e.g. ``loss_scale``,
  ``underflow/zero_frac``) with a ``tensorboardX.SummaryWriter`` on
  ``logdir``, into an event file of this writer's own (its name ends in the
  process id and a random suffix); non-finite values (``grad_norm`` on a
  skipped step) are kept in the JSON lines only.

  Args:
    logdir: folder to write into (created if missing).
    every: int >= 1, log the steps with ``step % every == 0``. Default 1.
    tensorboard: bool, also write TensorBoard events (needs ``tensorboardX``).
      Default True.
    jsonl: bool, write ``metrics.jsonl``. Default True.
    run_name: optional str stored in every JSON line under ``"run"``.

  Raises:
    ValueError: ``every`` < 1, or both outputs off.
    TypeError: ``logdir`` not a str or ``os.PathLike``, ``every`` not an int,
      ``tensorboard`` / ``jsonl`` not a bool, ``run_name`` neither a str nor
      None.
    ImportError: ``tensorboard=True`` without ``tensorboardX`` installed.
  """

  def __init__(
    self,
    logdir: str | os.PathLike,
    *,
    every: int = 1,
    tensorboard: bool = True,
    jsonl: bool = True,
    run_name: str | None = None,
  ) -> None:
    logdir = _check_path("logdir", logdir)
    if isinstance(every, bool) or not isinstance(every, numbers.Integral):
      raise TypeError(f"every must be an int, got {every!r}.")
    if every < 1:
      raise ValueError(f"every must be >= 1, got every={every!r}.")
    for name, flag in (("tensorboard", tensorboard), ("jsonl", jsonl)):
      if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {flag!r} of type {type(flag).__name__}.")
    if run_name is not None and not isinstance(run_name, str):
      raise TypeError(
        f"run_name must be a str or None, got {run_name!r} of type {type(run_name).__name__}."
      )
    if not (tensorboard or jsonl):
      raise ValueError("MetricsWriter needs tensorboard=True or jsonl=True, got both False.")
    self.logdir = logdir
    self.every = int(every)
    self.run_name = run_name
    self._closed = False
    os.makedirs(self.logdir, exist_ok=True)
    self._tb = None
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError as e:
        raise ImportError(
          "MetricsWriter(tensorboard=True) needs tensorboardX: "
          "pip install tensorboardX, or pass tensorboard=False."
        ) from e
      self._tb = SummaryWriter(
        self.logdir, filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:12]}"
      )
    self._jsonl = self._open_jsonl() if jsonl else None

  def _open_jsonl(self) -> Any:
    """Opens ``metrics.jsonl`` for unbuffered appends, first ending a line that was cut short."""
    path = os.path.join(self.logdir, JSONL_NAME)
    cut = _ends_without_newline(path)
    f = open(path, "ab", buffering=0)  # noqa: SIM115 (open until close())
    if cut:
      _write_all(f, b"\n")
    return f

  def _check_open(self) -> None:
    if self._closed:
      raise ValueError(
        f"this MetricsWriter on {self.logdir!r} is closed: open a new one to log more."
      )

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
      ValueError: the writer is closed, a value is not a scalar, or a metric is
        named ``"step"`` or ``"run"`` (reserved columns of every row).
    """
    self._check_open()
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
      raise TypeError(f"step must be a Python int, got {step!r} of type {type(step).__name__}.")
    step = int(step)
    if step % self.every:
      return False
    if not isinstance(metrics, Mapping):
      raise TypeError(
        f"metrics must be a mapping of metric names to scalars, got {metrics!r} "
        f"of type {type(metrics).__name__}."
      )
    values = {**metrics, **extra}
    for key in values:
      if not isinstance(key, str):
        raise TypeError(f"metric names must be strings, got {key!r} of type {type(key).__name__}.")
      if key in _RESERVED:
        raise ValueError(
          f"metric name {key!r} is reserved ({_RESERVED} are columns of every "
          "logged row); rename the metric."
        )
    values = jax.device_get(values)
    row = {"step": step}
    if self.run_name is not None:
      row["run"] = self.run_name
    row.update({k: _to_python(k, v) for k, v in values.items()})
    if self._jsonl is not None:
      _write_all(self._jsonl, (json.dumps(row) + "\n").encode("utf-8"))
    if self._tb is not None:
      for key, value in row.items():
        # Non-finite values (grad_norm on a skipped step) stay in the JSONL only.
        scalar = _tensorboard_value(value) if key != "step" else None
        if scalar is not None:
          self._tb.add_scalar(key, scalar, step)
    return True

  def flush(self) -> None:
    """Flushes the TensorBoard events (the JSON lines are written unbuffered).

    Raises:
      ValueError: the writer is closed.
    """
    self._check_open()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes both outputs; then ``log`` and ``flush`` raise ``ValueError``.

    Closing a closed writer does nothing.
    """
    if self._closed:
      return
    self._closed = True
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def read_jsonl(
  path: str | os.PathLike, on_bad_line: Callable[[int, str], Any] | None = None
) -> list[dict[str, Any]]:
  """The rows of a ``metrics.jsonl`` file: the JSON objects with a ``"step"`` key, in file order.

  Blank lines are ignored. Any other line that is not such an object (not
  JSON, cut short, undecodable bytes, a number too long to parse, ...) is
  skipped on its own: it costs that line only.

  Args:
    path: the file to read.
    on_bad_line: optional callable ``on_bad_line(line_number, reason)``
      called for each skipped line (line numbers start at 1). Default None:
      skip silently.

  Raises:
    OSError: the file cannot be read.
    TypeError: ``path`` is not a str or ``os.PathLike``, or ``on_bad_line``
      is neither callable nor None.
  """
  path = _check_path("path", path)
  report = _reporter("on_bad_line", on_bad_line)
  rows = []
  with open(path, encoding="utf-8", errors="replace") as f:  # undecodable bytes: a malformed line
    for number, line in enumerate(f, start=1):
      line = line.strip()
      if not line:
        continue
      try:
        row = json.loads(line)
      except (ValueError, RecursionError) as e:  # JSONDecodeError, an over-long int, deep nesting
        report(number, f"not JSON ({type(e).__name__})")
        continue
      if not (isinstance(row, dict) and "step" in row):
        report(number, "not a JSON object with a 'step' key")
        continue
      rows.append(row)
  return rows


def _reporter(name: str, callback: Any) -> Callable[[int, str], Any]:
  if callback is None:
    return lambda where, why: None
  if not callable(callback):
    raise TypeError(
      f"{name} must be callable or None, got {callback!r} of type {type(callback).__name__}."
    )
  return callback


_HEADER = struct.Struct("<QI")  # TFRecord: uint64 length, uint32 masked CRC-32C of the length
_FOOTER = struct.Struct("<I")  # uint32 masked CRC-32C of the data


def _records(data: bytes, report: Callable[[int, str], Any]) -> Any:
  """``(offset, payload)`` of each intact TFRecord in ``data``.

  Both CRCs of every record are checked. A record whose data is corrupt is
  skipped; after a corrupt length the reader moves on to the next offset
  where a record header checks out. Either way only the corrupt bytes are
  lost.
  """
  from tensorboardX.record_writer import masked_crc32c

  pos = 0
  while pos + _HEADER.size <= len(data):
    length, length_crc = _HEADER.unpack_from(data, pos)
    if masked_crc32c(data[pos : pos + 8]) != length_crc:
      report(pos, "corrupt record header")
      pos = _next_header(data, pos + 1, masked_crc32c)
      continue
    start = pos + _HEADER.size
    end = start + length
    if end + _FOOTER.size > len(data):
      report(pos, "record cut short (the file ends inside it)")
      return
    if masked_crc32c(data[start:end]) != _FOOTER.unpack_from(data, end)[0]:
      report(pos, "corrupt record data (CRC mismatch)")
    else:
      yield pos, data[start:end]
    pos = end + _FOOTER.size


def _next_header(data: bytes, pos: int, masked_crc32c: Callable[[bytes], int]) -> int:
  """The first offset >= ``pos`` holding a TFRecord header whose CRC checks, else ``len(data)``."""
  for p in range(pos, len(data) - _HEADER.size + 1):
    if masked_crc32c(data[p : p + 8]) == _HEADER.unpack_from(data, p)[1]:
      return p
  return len(data)


def read_tensorboard(
  path: str | os.PathLike, on_bad_record: Callable[[int, str], Any] | None = None
) -> list[dict[str, Any]]:
  """Scalars of one TensorBoard event file as rows ``{"step": s, tag: value, ...}``, sorted by step.

  Reads the TFRecord framing directly, checks both CRC-32C sums of every
  record, and parses each record with the ``Event`` protobuf that
  ``tensorboardX`` ships (no TensorFlow or TensorBoard needed). Scalars
  written as ``simple_value`` or as a one-element float tensor are read;
  other summaries are ignored. A corrupt or undecodable record is skipped on
  its own: it costs that record only.

  Args:
    path: the event file.
    on_bad_record: optional callable ``on_bad_record(byte_offset, reason)``
      called for each skipped record. Default None: skip silently.

  Raises:
    OSError: the file cannot be read.
    TypeError: ``path`` is not a str or ``os.PathLike``, or ``on_bad_record``
      is neither callable nor None.
    ImportError: ``tensorboardX`` is not installed.
  """
  path = _check_path("path", path)
  from google.protobuf.message import DecodeError
  from tensorboardX.proto import event_pb2

  report = _reporter("on_bad_record", on_bad_record)
  with open(path, "rb") as f:
    data = f.read()
  by_step: dict[int, dict[str, Any]] = {}
  for offset, payload in _records(data, report):
    try:
      event = event_pb2.Event.FromString(payload)
    except DecodeError:
      report(offset, "not an Event protobuf")
      continue
    for v in event.summary.value:
      if v.HasField("simple_value"):
        value = float(v.simple_value)
      elif v.HasField("tensor") and len(v.tensor.float_val) == 1:
        value = float(v.tensor.float_val[0])
      else:
        continue
      by_step.setdefault(int(event.step), {"step": int(event.step)})[v.tag] = value
  return [by_step[s] for s in sorted(by_step)]
