"""``locate``: the operation that made an inf or NaN, and every scope's headroom.

``S * fun(*args)`` and its gradient are traced to two jaxprs, the forward (from
``jax.vjp``: the loss and the residuals) and the backward (the pullback applied to
the cotangent 1), and evaluated equation by equation on the CPU
(``eqn.primitive.bind``), so the phase of every operation is known by
construction and the training step is untouched. Each jaxpr is evaluated under
one ``jax.jit`` that returns every operation's inputs and outputs (one compile,
not one per operation), or, when it holds a ``cond``, eagerly, one operation at a
time. Nested ``jit``, ``remat`` /
``checkpoint``, ``custom_jvp`` / ``custom_vjp`` calls and the taken branch of a
``cond`` are entered; a ``scan`` or ``while`` is evaluated whole and, if it makes
the inf or NaN, reported as the place with a note.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from optax_dls._features import jax_source as _jax_source
from optax_dls._util import calls as _calls
from optax_dls._util import locate_report as _headroom
from optax_dls._util import model as _model
from optax_dls._util import validation as _validation

# Call-like primitives whose body is a jaxpr with the equation's inputs and outputs.
_ENTERED = {
  "pjit",
  "jit",
  "closed_call",
  "core_call",
  "remat",
  "checkpoint",
  "custom_jvp_call",
  "custom_vjp_call",
  "custom_vjp_call_jaxpr",
  "custom_lin",
}
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def locate(
  fun: Callable[..., Any],
  *args: Any,
  scale: float = 2.0**15,
  argnums: int = 0,
  has_aux: bool = False,
) -> _headroom.LocateReport:
  """Finds the first operation of ``S * fun(*args)`` or its gradient that is not finite.

  Runs outside the training step, on the CPU, recording every operation's inputs and
  outputs (a few seconds for a small model; every intermediate value is held in host
  memory): call it once, on a micro-batch of a skipped step.

  Args:
    fun: the loss function, as given to ``jax.grad``, not yet multiplied by the
      scale; returns a scalar (and an auxiliary value with ``has_aux=True``).
    *args: its arguments, e.g. ``params, batch``; float16 leaves stay float16.
    scale: the loss scale ``S``, multiplied in ``promote_types(loss.dtype, float32)``
      as :func:`optax_dls.scale_loss` does (e.g. ``float(optax_dls.loss_scale(state))``);
      in ``[2**-126, 2**126]``. Default ``2.0**15``.
    argnums: which argument the gradient is taken with respect to. Default 0.
    has_aux: ``fun`` returns ``(loss, aux)``. Default False.

  Returns:
    A :class:`~optax_dls.LocateReport`: ``first`` (phase, primitive, source,
    scope, kind, dtype, input_max, note) or None when every value is finite, and
    ``headroom``, one row per scope, closest to overflow first. ``print(report)`` shows
    a table; ``report.to_dict()`` is JSON-ready.

  Raises:
    TypeError: ``fun`` is not callable; ``scale``, ``argnums`` or ``has_aux`` is not
      a number, an int, a bool; the loss ``fun`` returns is not a real floating
      scalar (a tuple without ``has_aux=True``, an integer or complex loss), or,
      with ``has_aux=True``, ``fun`` returns no ``(loss, aux)`` pair.
    ValueError: ``scale`` is outside ``[2**-126, 2**126]``, or ``argnums`` is not the
      index of one of ``args``.

  Example:
    >>> import jax, jax.numpy as jnp, optax_dls
    >>> def loss(w, x):
    ...   with jax.named_scope("proj"):
    ...     h = x @ w
    ...   return jnp.mean(h.astype(jnp.float32) ** 2)
    >>> w = jnp.full((4, 4), 300.0, jnp.float16)
    >>> report = optax_dls.locate(loss, w, jnp.full((2, 4), 100.0, jnp.float16), scale=1.0)
    >>> report.first.phase, report.first.scope, report.first.kind
    ('forward', 'proj', 'inf')
  """
  _validation.function("fun", fun)
  scale = _validation.scale("scale", scale)
  argnums = _validation.integer("argnums", argnums)
  _validation.check(0 <= argnums < len(args), "argnums", argnums, f"0 <= argnums < {len(args)}")
  has_aux = _validation.boolean("has_aux", has_aux)
  cpu = jax.devices("cpu")[0]
  arrays, rebuild = _calls.split_arrays(args)  # strings, functions and flags stay as they are
  args = rebuild(jax.device_put(arrays, cpu))
  # Of a differentiated argument holding leaves that are not floating arrays (an Equinox
  # model's functions), only the floating arrays are differentiated, as value_and_grad does.
  split = _model.has_non_arrays(args[argnums])
  wrt, others = _model.partition(args[argnums]) if split else (args[argnums], None)
  acc = _headroom.Accumulator()

  def scaled(x: Any) -> tuple[Any, Any]:
    x = _model.combine(x, others) if split else x
    out = fun(*args[:argnums], x, *args[argnums + 1 :])
    if not has_aux and isinstance(out, (tuple, list)):
      raise TypeError(
        f"locate: fun returned a {type(out).__name__} of {len(out)}; it must return the "
        "unscaled scalar loss, or (loss, aux) with has_aux=True"
      )
    loss, aux = _calls.loss_and_aux(fun, has_aux, out)
    if not (hasattr(loss, "dtype") or isinstance(loss, (int, float, complex))):
      raise TypeError(f"locate: fun must return a scalar loss, got a {type(loss).__name__}")
    loss = jnp.asarray(loss)
    if loss.shape != ():
      raise TypeError(f"locate: fun must return a scalar loss, got shape {loss.shape}")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
      raise TypeError(
        f"locate: fun must return a real floating-point loss (as jax.grad needs), got dtype "
        f"{loss.dtype}"
      )
    dtype = jnp.promote_types(loss.dtype, jnp.float32)  # as optax_dls.scale_loss does
    return loss.astype(dtype) * jnp.asarray(scale, dtype), aux

  tree: list[Any] = []

  def forward(x: Any) -> list[Any]:
    loss, pullback, _ = jax.vjp(scaled, x, has_aux=True)
    leaves, treedef = jax.tree.flatten((loss, pullback))
    tree.append(treedef)
    return leaves

  with jax.default_device(cpu):
    closed = jax.make_jaxpr(forward)(wrt)
    leaves = _run(closed, jax.tree.leaves(wrt), "forward", acc)

    def backward(leaves: list[Any]) -> Any:
      loss, pullback = jax.tree.unflatten(tree[0], leaves)
      return pullback(jnp.ones_like(loss))

    closed = jax.make_jaxpr(backward)(leaves)
    _run(closed, leaves, "backward", acc)
  return acc.report(float(scale))


def _floats(values: list[Any]) -> list[np.ndarray]:
  out = []
  for v in values:
    if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.inexact):
      out.append(np.asarray(v))
  return out


def _largest_finite(arrays: list[np.ndarray]) -> float:
  largest = 0.0
  for a in arrays:
    values = np.abs(a.astype(np.float64))
    finite = values[np.isfinite(values)]
    if finite.size:
      largest = max(largest, float(finite.max()))
  return largest


def _body(eqn: Any) -> tuple[Any, list[Any]] | None:
  """The jaxpr an entered call-like equation runs, with its constants; None otherwise."""
  if eqn.primitive.name not in _ENTERED:
    return None
  for name in _BODY_PARAMS:
    body = eqn.params.get(name)
    if isinstance(body, jax_core.ClosedJaxpr):
      body, consts = body.jaxpr, list(body.consts)
    elif isinstance(body, jax_core.Jaxpr):
      consts = []
    else:
      continue
    if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
      return body, consts
  return None


Record = Callable[[Any, list[Any], list[Any]], None]


def _run(closed: Any, args: list[Any], phase: str, acc: Any) -> list[Any]:
  """Evaluates ``closed`` and records every operation in order. Compiled once, returning
  every intermediate value, unless it holds a ``cond`` (whose taken branch needs the
  concrete index): then one operation at a time, eagerly."""

  def now(eqn: Any, invals: list[Any], outvals: list[Any]) -> None:
    _record(eqn, invals, outvals, phase, acc)

  if _has_cond(closed.jaxpr):
    return _eval(closed.jaxpr, closed.consts, args, now)
  eqns: list[Any] = []

  def traced(consts: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
    eqns.clear()
    kept: list[Any] = []

    def keep(eqn: Any, invals: list[Any], outvals: list[Any]) -> None:
      eqns.append(eqn)
      kept.append((_inexact(invals), _inexact(outvals)))

    return _eval(closed.jaxpr, consts, args, keep), kept

  outs, kept = jax.jit(traced)(list(closed.consts), list(args))
  for eqn, (invals, outvals) in zip(eqns, kept):
    now(eqn, invals, outvals)
  return outs


def _inexact(values: list[Any]) -> list[Any]:
  return [
    jnp.asarray(v) for v in values if hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.inexact)
  ]


def _has_cond(jaxpr: Any) -> bool:
  for eqn in jaxpr.eqns:
    body = _body(eqn)
    if eqn.primitive.name == "cond" or (body is not None and _has_cond(body[0])):
      return True
  return False


def _eval(jaxpr: Any, consts: list[Any], args: list[Any], record: Record) -> list[Any]:
  env: dict[Any, Any] = {}

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    body = _body(eqn)
    if body is not None:
      outvals = _eval(body[0], body[1], invals, record)
    elif eqn.primitive.name == "cond":
      branch = eqn.params["branches"][int(np.asarray(invals[0]))]
      outvals = _eval(branch.jaxpr, list(branch.consts), invals[1:], record)
    else:
      outvals = _bind(eqn, invals)
      record(eqn, invals, outvals)
    for v, val in zip(eqn.outvars, outvals):
      env[v] = val
  return [read(v) for v in jaxpr.outvars]


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = params if isinstance(params, tuple) else ((), params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _record(eqn: Any, invals: list[Any], outvals: list[Any], phase: str, acc: Any) -> None:
  outputs = _floats(outvals)
  if not outputs:
    return
  inputs = _floats(invals)
  inputs_finite = all(bool(np.isfinite(a).all()) for a in inputs)
  source, function = _jax_source.source_of(eqn)
  scope = _jax_source.scope_of(eqn) or (function if function != "?" else "")
  if not acc.add(phase, scope, outputs, inputs_finite):
    return
  if acc.first is not None or (not inputs_finite and acc.first_propagated is not None):
    return
  bad = next(o for o in outputs if not np.isfinite(o).all())
  note = ""
  if eqn.primitive.name in ("scan", "while"):
    note = f"a {eqn.primitive.name} evaluated whole: the operation is inside its body"
  if not inputs_finite:
    note = (note + "; " if note else "") + "its inputs were already not finite"
  op = _headroom.Operation(
    phase=phase,
    primitive=eqn.primitive.name,
    source=source,
    scope=scope,
    kind="nan" if bool(np.isnan(bad).any()) else "inf",
    dtype=str(bad.dtype),
    input_max=_largest_finite(inputs),
    note=note,
  )
  if inputs_finite:
    acc.first = op
  else:
    acc.first_propagated = op
