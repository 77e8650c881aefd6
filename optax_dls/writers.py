"""Writing loss-scale metrics to JSONL and TensorBoard every ``k`` steps, for ``optax-dls inspect``.

Example::

    with optax_dls.writers.MetricsWriter("runs/exp1", every=10, run_name="exp1") as w:
      for step in range(num_steps):
        params, opt_state, loss = train_step(params, opt_state, batch)
        w.log(step, optax_dls.metrics(opt_state), loss=loss)
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import uuid
from collections.abc import Mapping
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np

from optax_dls._access import names as _names
from optax_dls._core import record as _localisation
from optax_dls._logs import read as _read
from optax_dls._util import optional as _optional
from optax_dls._util import validation as _validation

__all__ = ["MetricsWriter"]

JSONL_NAME = "metrics.jsonl"
LOCATE_NAME = _read.LOCATE_NAME
_RESERVED = ("step", "run")
_LEAVES, _NAN = "nonfinite_leaves", "nonfinite_nan"  # packed records, never written
_DIGEST = "nonfinite_names_digest"  # the checksum of the state's leaf names, never written


def _to_python(name: str, value: Any) -> Any:
  """A host scalar (Python, NumPy or JAX, any real dtype) as a bool, int, float, str or None."""
  if value is None or isinstance(value, (str, bool)):
    return value
  if isinstance(value, int):
    return int(value)  # any size: JSON holds it exactly
  if isinstance(value, float) or (
    isinstance(value, numbers.Real) and not isinstance(value, (np.generic, np.ndarray, jax.Array))
  ):
    return float(value)  # numpy.float64, fractions.Fraction
  arr = np.asarray(value)
  if arr.ndim:
    raise ValueError(f"metric {name!r} must be a scalar, got an array of shape {arr.shape}.")
  for kind, cast in ((jnp.bool_, bool), (jnp.integer, int), (jnp.floating, float)):
    if jnp.issubdtype(arr.dtype, kind):
      return cast(arr)
  raise TypeError(
    f"metric {name!r} must be a real number or bool, got {value!r} of type {type(value).__name__}."
  )


def _write_all(f: Any, data: bytes) -> None:
  """Writes ``data`` to the unbuffered binary file ``f`` (a raw write may be partial)."""
  view = memoryview(data)
  while view:
    view = view[f.write(view) :]


def _param_names(params: Any) -> list[str] | None:
  """The leaf names ``params`` gives (see :class:`MetricsWriter`), or None without it."""
  if params is None:
    return None
  if isinstance(params, (list, tuple)) and params and all(isinstance(n, str) for n in params):
    return list(params)
  try:
    leaves = jax.tree.leaves(params)
    array_like = lambda x: hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex))
    if leaves and not any(map(array_like, leaves)):  # an Equinox model has some
      raise TypeError("no leaf is an array or a number")
    names = _names.leaf_names(params)
    if not names:  # the record names floating leaves only
      raise TypeError("no leaf is a floating array")
    return names
  except (TypeError, ValueError) as e:
    raise TypeError(
      "params must be a pytree of arrays or jax.ShapeDtypeStruct (the parameters), or a list "
      f"of leaf names, got {params!r} of type {type(params).__name__}: {e}"
    ) from None


def _words(name: str, value: Any) -> np.ndarray:
  """A packed bit record as a 1-D uint32 array; ValueError naming ``name`` unless integers."""
  arr = np.asarray(value)
  if not np.issubdtype(arr.dtype, np.integer) or arr.ndim > 1:
    raise ValueError(
      f"metric {name!r} must be the uint32 array optax_dls.metrics returns under that name (one "
      f"bit per leaf), got an array of dtype {arr.dtype} and shape {arr.shape}."
    )
  return arr.astype(np.uint32).reshape(-1)


class MetricsWriter:
  """Writes scalar metrics every ``every`` steps as JSON lines and TensorBoard events.

  Each logged step is one unbuffered append to ``<logdir>/metrics.jsonl``: ``{"step": int, "run":
  run_name (if given), <metric>: value, ...}``, non-finite floats as ``NaN`` / ``Infinity`` (a
  resumed run continues the file, a cut-short last line is ended first; writers may share a
  folder). With ``tensorboard=True`` each finite number is also a scalar tagged by its key, in an
  event file of this writer's own; non-finite values, str and None go to the JSON lines only.

  The packed records ``nonfinite_leaves`` / ``nonfinite_nan`` of :func:`optax_dls.metrics` are
  written as ``"nonfinite_leaves": {name: "inf" | "nan"}`` on the first row and whenever
  ``nonfinite_step`` (> 0) changed since the last row; TensorBoard also gets
  ``nonfinite_leaf_count`` and the names as text tagged ``nonfinite_leaves``.

  Args:
    logdir: folder to write into (created if missing).
    every: int >= 1 (Python, NumPy or 0-d array), log the steps with ``step % every == 0``.
      Default 1.
    tensorboard: bool, also write TensorBoard events (needs ``tensorboardX``). Default True.
    jsonl: bool, write ``metrics.jsonl``. Default True.
    run_name: optional str stored in every JSON line under ``"run"``.
    params: optional, names the non-finite record's leaves: the parameters (a pytree of arrays or
      ``jax.ShapeDtypeStruct``, named by key path: ``"dense/kernel"``) or the list of leaf names.
      Default None: ``"leaf 0"``, ``"leaf 1"``, ...

  Raises:
    ValueError: ``every`` < 1, or both outputs off.
    TypeError: ``logdir`` not a str or ``os.PathLike``, ``every`` not an int, ``tensorboard`` /
      ``jsonl`` not a bool, ``run_name`` neither a str nor None, ``params`` neither a pytree of
      arrays nor a list of names.
    ImportError: ``tensorboard=True`` without ``tensorboardX`` (a ``MissingExtraError``).
  """

  def __init__(
    self,
    logdir: str | os.PathLike,
    *,
    every: int = 1,
    tensorboard: bool = True,
    jsonl: bool = True,
    run_name: str | None = None,
    params: Any = None,
  ) -> None:
    path = _read.check_path("logdir", logdir)
    every = _validation.integer("every", every)
    _validation.check(every >= 1, "every", every, "value >= 1")
    tensorboard = _validation.boolean("tensorboard", tensorboard)
    jsonl = _validation.boolean("jsonl", jsonl)
    if run_name is not None and not isinstance(run_name, str):
      raise TypeError(
        f"run_name must be a str or None, got {run_name!r} of type {type(run_name).__name__}."
      )
    if not (tensorboard or jsonl):
      raise ValueError("MetricsWriter needs tensorboard=True or jsonl=True, got both False.")
    self.logdir: str = path
    self.every = every
    self.run_name = run_name
    self._names: list[str] | None = _param_names(params)
    self._last_nonfinite: int | None = None  # nonfinite_step of the last row written
    self._closed: bool = False
    os.makedirs(self.logdir, exist_ok=True)
    self._tb: Any = None
    if tensorboard:
      tensorboardx = _optional.require(
        "tensorboardX", "MetricsWriter(tensorboard=True)", "pass tensorboard=False"
      )
      self._tb = tensorboardx.SummaryWriter(
        self.logdir, filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:12]}"
      )
    self._jsonl: Any = None
    if jsonl:  # unbuffered appends, a line that was cut short ended first
      f = open(os.path.join(self.logdir, JSONL_NAME), "a+b", buffering=0)  # noqa: SIM115
      if f.seek(0, os.SEEK_END) and (f.seek(-1, os.SEEK_END), f.read(1))[1] != b"\n":
        _write_all(f, b"\n")  # appends: a+ writes at the end whatever the position
      self._jsonl = f

  def write_locate(self, report: Any, step: int | None = None) -> str:
    """Saves a :func:`optax_dls.locate` report as ``<logdir>/locate.json``, for ``inspect``.

    Args:
      report: what :func:`optax_dls.locate` returned.
      step: optional int, the step whose batch it replayed (stored as ``"step"``).

    Returns:
      The file's path.

    Raises:
      TypeError: ``report`` has no ``to_dict`` method, or ``step`` is not an int.
    """
    if not callable(getattr(report, "to_dict", None)):
      raise TypeError(f"report must be what optax_dls.locate returns, got {type(report).__name__}.")
    data = report.to_dict()
    if step is not None:
      data = {"step": _validation.integer("step", step), **data}
    path = os.path.join(self.logdir, LOCATE_NAME)
    with open(path, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=1)
    return path

  def _check_open(self) -> None:
    if self._closed:
      raise ValueError(
        f"this MetricsWriter on {self.logdir!r} is closed: open a new one to log more."
      )

  def log(self, step: int, metrics: Mapping[str, Any], **extra: Any) -> bool:
    """Writes ``metrics`` and ``extra`` for ``step`` if ``step % every == 0`` (only then to host).

    Args:
      step: a Python int (or NumPy integer) >= 0, the training step; not a JAX array.
      metrics: a mapping of scalars (arrays, numbers, bools, str, None): :func:`optax_dls.metrics`.
      **extra: more scalars to write, e.g. ``loss=loss``.

    Returns:
      True when the step was written.

    Raises:
      TypeError: ``step`` is not a Python / NumPy integer, ``metrics`` is not a mapping, a name
        is not a str, a value not a real number, bool, str or None, or ``step`` or a value is
        traced (``log`` called inside ``jax.jit``).
      ValueError: the writer is closed, ``step`` < 0, a value (but the packed records) is not a
        scalar, a metric is named ``"step"`` or ``"run"``, ``nonfinite_leaves`` comes without
        ``nonfinite_nan`` or ``nonfinite_step``, or its bits do not fit ``params``.
    """
    self._check_open()
    _refuse_traced({**(metrics if isinstance(metrics, Mapping) else {}), **extra, "step": step})
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
      raise TypeError(f"step must be a Python int, got {step!r} of type {type(step).__name__}.")
    step = int(step)
    _validation.check(step >= 0, "step", step, "step >= 0")
    if step % self.every:
      return False
    values = jax.device_get(_checked_values(metrics, extra))
    record = self._nonfinite(values)  # takes the packed records out of values
    run = {} if self.run_name is None else {"run": self.run_name}
    row: dict[str, Any] = {"step": step, **run, **{k: _to_python(k, v) for k, v in values.items()}}
    tb_only = {}
    if record is not None:
      nonfinite_step, leaves = record
      if nonfinite_step > 0 and nonfinite_step != self._last_nonfinite:
        row[_LEAVES] = leaves
      tb_only["nonfinite_leaf_count"] = len(leaves)
    if "nonfinite_step" in row:
      self._last_nonfinite = row["nonfinite_step"]
    self._write(step, row, tb_only)
    return True

  def _nonfinite(self, values: dict[str, Any]) -> tuple[int, dict[str, str]] | None:
    """``(nonfinite_step, {leaf name: "inf" | "nan"})`` of the records popped from ``values``."""
    digest = values.pop(_DIGEST, None)  # checks the names of params, never written
    if _LEAVES not in values and _NAN not in values:
      return None
    missing = [k for k in (_LEAVES, _NAN, "nonfinite_step") if k not in values]
    if missing:
      raise ValueError(
        f"metrics has {_LEAVES!r} or {_NAN!r} without {missing}: pass the three together, as "
        "optax_dls.metrics gives them."
      )
    leaves, nan = _words(_LEAVES, values.pop(_LEAVES)), _words(_NAN, values.pop(_NAN))
    if leaves.shape != nan.shape:
      raise ValueError(f"{_LEAVES!r} and {_NAN!r} differ in shape: {leaves.shape}, {nan.shape}.")
    names = self._names
    if names is None:
      names = [f"leaf {k}" for k in range(leaves.size * _localisation.WORD_BITS)]
    record = {_LEAVES: leaves, _NAN: nan}
    if digest is not None and self._names is not None:
      record[_DIGEST] = digest
    step = int(_to_python("nonfinite_step", values["nonfinite_step"]))
    return step, _names.nonfinite_leaves(record, names)

  def _write(self, step: int, row: dict[str, Any], tb_only: dict[str, Any]) -> None:
    if self._jsonl is not None:
      _write_all(self._jsonl, (json.dumps(row) + "\n").encode("utf-8"))
    if self._tb is not None:
      for key, value in {**row, **tb_only}.items():
        if key in ("step", _LEAVES) or value is None or isinstance(value, str):
          continue
        with contextlib.suppress(OverflowError):  # an int beyond the float range
          if math.isfinite(scalar := float(value)):
            self._tb.add_scalar(key, scalar, step)
      if _LEAVES in row:  # the names, as a text summary that inspect reads back
        self._tb.add_text(_read.LEAVES_TAG, json.dumps(row[_LEAVES]), step)

  def flush(self) -> None:
    """Flushes the TensorBoard events (the JSON lines are unbuffered); ValueError if closed."""
    self._check_open()
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Closes both outputs (again: nothing); then ``log`` and ``flush`` raise ``ValueError``."""
    if self._closed:
      return
    self._closed = True
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def _refuse_traced(values: dict[str, Any]) -> None:
  """TypeError naming the first traced value: ``log`` was called inside ``jax.jit``."""
  for name, value in values.items():
    if isinstance(value, jax.core.Tracer):
      what = "step" if name == "step" else f"metric {name!r}"
      raise TypeError(
        f"{what} is a traced value ({value!r}): MetricsWriter.log cannot run inside jax.jit. "
        "Call it outside jit with the step's metrics (e.g. after jax.device_get)."
      )


def _checked_values(metrics: Any, extra: dict[str, Any]) -> dict[str, Any]:
  """``{**metrics, **extra}``, the mapping and names checked."""
  if not isinstance(metrics, Mapping):
    raise TypeError(
      f"metrics must be a mapping of metric names to scalars, got {metrics!r} "
      f"of type {type(metrics).__name__}."
    )
  for key in (values := {**metrics, **extra}):
    if not isinstance(key, str):
      raise TypeError(f"metric names must be strings, got {key!r} of type {type(key).__name__}.")
    if key in _RESERVED:
      raise ValueError(
        f"metric name {key!r} is reserved ({_RESERVED} are columns of every "
        "logged row); rename the metric."
      )
  return values
