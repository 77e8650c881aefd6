"""``locate``: the operation that made an inf or NaN, and every scope's headroom, from the forward
and backward jaxprs of ``S * fun(*args)`` evaluated equation by equation on the CPU."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

from optax_dls._features import jax_source as _jax_source
from optax_dls._features import locate_instances as _instances
from optax_dls._util import calls as _calls
from optax_dls._util import locate_report as _headroom
from optax_dls._util import model as _model
from optax_dls._util import validation as _validation

# Call-like primitives whose body is a jaxpr with the equation's inputs and outputs.
_ENTERED = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_lin"}
_ENTERED |= {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
_BODY_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def locate(
  fun: Callable[..., Any],
  *args: Any,
  scale: float = 2.0**15,
  argnums: int = 0,
  has_aux: bool = False,
) -> _headroom.LocateReport:
  """Finds the first operation of ``S * fun(*args)`` or its gradient that is not finite.

  Runs on the CPU, holding every intermediate value in host memory: call it on a micro-batch of a
  skipped step. An operation is named by its scope (a linen module path, a ``jax.named_scope``, a
  block instance's path such as ``"blocks/2"``), else by the user's function. An explicit
  ``-jnp.inf`` (a mask) is reported only where nothing else is. See ``docs/guide/locate.md``.

  Args:
    fun: the unscaled loss function, as given to ``jax.grad``.
    *args: its arguments, e.g. ``params, batch``; float16 leaves stay float16.
    scale: the loss scale ``S`` in ``[2**-126, 2**126]``, multiplied in ``promote_types(loss.dtype,
      float32)`` as :func:`optax_dls.scale_loss` does. Default ``2.0**15``.
    argnums: which argument the gradient is taken with respect to. Default 0.
    has_aux: ``fun`` returns ``(loss, aux)``. Default False.

  Returns:
    A :class:`~optax_dls._util.locate_report.LocateReport`: ``first`` (phase, primitive, source,
    scope, kind, dtype, input_max, note) or None when every value is finite, and ``headroom``, one
    row per scope (per block instance), closest to overflow first.

  Raises:
    TypeError: ``fun`` is not callable; ``scale``, ``argnums`` or ``has_aux`` is not a number, an
      int, a bool; the loss is not a real floating scalar (or a tuple without ``has_aux=True``),
      or, with ``has_aux=True``, ``fun`` returns no ``(loss, aux)`` pair.
    ValueError: ``scale`` is outside ``[2**-126, 2**126]``, or ``argnums`` is not the index of one
      of ``args``.

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
  arrays = jax.device_put(arrays, cpu)
  target = rebuild(arrays)[argnums]
  # Only the floating arrays are differentiated, as value_and_grad does.
  split = _model.has_non_arrays(target)
  wrt = _model.partition(target)[0] if split else target
  acc = _headroom.Accumulator()

  def scaled(x: Any, arrays: list[Any]) -> tuple[Any, Any]:
    # The arguments are inputs, so the jaxpr's constants are those the loss made.
    full = rebuild(arrays)
    x = _model.combine(x, _model.partition(full[argnums])[1]) if split else x
    out = fun(*full[:argnums], x, *full[argnums + 1 :])
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

  def forward(x: Any, arrays: list[Any]) -> list[Any]:
    loss, pullback, _ = jax.vjp(lambda x: scaled(x, arrays), x, has_aux=True)
    leaves, treedef = jax.tree.flatten((loss, pullback))
    tree.append(treedef)
    return leaves

  def backward(leaves: list[Any]) -> Any:
    loss, pullback = jax.tree.unflatten(tree[0], leaves)
    return pullback(jnp.ones_like(loss))

  with jax.default_device(cpu):
    with _jax_source.watching(_instances.given_paths) as watch:
      closed = jax.make_jaxpr(forward)(wrt, arrays)
    inputs = [*jax.tree.leaves(wrt), *arrays]
    paths: list[Any] = _instances.leaf_paths(wrt)
    paths += [None] * (len(inputs) - len(paths))
    watch.instances = _instances.names(closed, paths, watch.calls, watch.given, _body)
    leaves = _run(closed, inputs, "forward", acc, watch)
    with _jax_source.watching() as backward_watch:
      closed = jax.make_jaxpr(backward)(leaves)
    watch.overflows += backward_watch.overflows
    _run(closed, leaves, "backward", acc, watch)
  return acc.report(float(scale))


def _largest_finite(arrays: list[np.ndarray]) -> float:
  finite = [np.abs(a[np.isfinite(a)].astype(np.float64)) for a in arrays]
  return max((float(f.max()) for f in finite if f.size), default=0.0)


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


def _run(closed: Any, args: list[Any], phase: str, acc: Any, seen: _jax_source.Watch) -> list[Any]:
  """Evaluates ``closed``, recording every operation: compiled once, or eagerly with a ``cond``."""

  now = functools.partial(_record, phase=phase, acc=acc, seen=seen)
  if _has_cond(closed.jaxpr):
    return _eval(closed.jaxpr, closed.consts, args, None, now)[0]
  eqns: list[Any] = []

  def traced(consts: list[Any], args: list[Any]) -> tuple[list[Any], list[Any]]:
    eqns.clear()
    kept: list[Any] = []

    def keep(
      eqn: Any, invals: list[Any], outvals: list[Any], constant: list[bool], outer: Any
    ) -> None:
      eqns.append((eqn, [c for v, c in zip(invals, constant) if _is_inexact(v)], outer))
      kept.append((_inexact(invals), _inexact(outvals)))

    return _eval(closed.jaxpr, consts, args, None, keep)[0], kept

  outs, kept = jax.jit(traced)(list(closed.consts), list(args))
  for (eqn, constant, outer), (invals, outvals) in zip(eqns, kept):
    now(eqn, invals, outvals, constant, outer)
  return outs


def _is_inexact(v: Any) -> bool:
  return hasattr(v, "dtype") and jnp.issubdtype(v.dtype, jnp.inexact)


def _inexact(values: list[Any]) -> list[Any]:
  return [jnp.asarray(v) for v in values if _is_inexact(v)]


def _has_cond(jaxpr: Any) -> bool:
  for eqn in jaxpr.eqns:
    body = _body(eqn)
    if eqn.primitive.name == "cond" or (body is not None and _has_cond(body[0])):
      return True
  return False


def _entered(
  eqn: Any, invals: list[Any], flags: list[bool]
) -> tuple[Any, list[Any], list[Any], list[bool]] | None:
  """``(jaxpr, consts, args, constant flags)`` of the body ``eqn`` enters, or None."""
  body = _body(eqn)
  if body is not None:
    return body[0], body[1], invals, flags
  if eqn.primitive.name == "cond":
    branch = eqn.params["branches"][int(np.asarray(invals[0]))]
    return branch.jaxpr, list(branch.consts), invals[1:], flags[1:]
  return None


def _eval(
  jaxpr: Any,
  consts: list[Any],
  args: list[Any],
  constant_args: list[bool] | None,
  record: Callable[..., None],
  outer: tuple[str, ...] = (),
) -> tuple[list[Any], list[bool]]:
  """The outputs of ``jaxpr`` and whether each is a constant; ``record`` sees every operation."""
  env: dict[Any, Any] = {}
  constant: set[Any] = set(jaxpr.constvars)

  def read(v: Any) -> Any:
    return v.val if isinstance(v, jax_core.Literal) else env[v]

  def is_constant(v: Any) -> bool:
    return isinstance(v, jax_core.Literal) or v in constant

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a, c in zip(jaxpr.invars, args, constant_args or [False] * len(args)):
    env[v] = a
    if c:
      constant.add(v)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    flags = [is_constant(v) for v in eqn.invars]
    entered = _entered(eqn, invals, flags)
    if entered is not None:
      outvals, out_flags = _eval(*entered, record, tuple(_jax_source.scopes(eqn, outer)))
    else:
      outvals = _bind(eqn, invals)
      out_flags = [all(flags)] * len(outvals)
      record(eqn, invals, outvals, flags, outer)
    for v, val, c in zip(eqn.outvars, outvals, out_flags):
      env[v] = val
      if c:
        constant.add(v)
  return [read(v) for v in jaxpr.outvars], [is_constant(v) for v in jaxpr.outvars]


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns, params = params if isinstance(params, tuple) else ((), params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _finite(a: np.ndarray) -> bool:
  return bool(np.isfinite(a).all())


def _range_note(a: np.ndarray) -> str:
  dtype = str(a.dtype)
  return f"beyond {dtype}'s range (largest finite {float(np.finfo(a.dtype).max):g})"


def _notes(
  eqn: Any,
  bad: np.ndarray,
  pairs: list[tuple[np.ndarray, bool]],
  made_constants: list[np.ndarray],
  overflowed: list[np.ndarray],
  carried: bool,
) -> list[str]:
  """Why the place is approximate, or where the value came from."""
  notes = []
  if eqn.primitive.name in ("scan", "while"):
    notes.append(f"a {eqn.primitive.name} evaluated whole: the operation is inside its body")
  constants = [a for a, c in pairs if c and not _finite(a)]
  if made_constants:
    c = made_constants[0]
    notes.append(f"reads a constant that is inf in {c.dtype}: a literal {_range_note(c)}")
  elif overflowed:
    c = overflowed[0]
    notes.append(
      f"reads a constant that is already inf in {c.dtype} (an explicit inf, such as a "
      f"mask's, or a literal {_range_note(c)} made before locate traced the function)"
    )
  elif constants:
    notes.append(f"reads a constant that is nan in {constants[0].dtype}")
  elif not carried and pairs and all(c for _, c in pairs):
    notes.append(f"its inputs are all constants: a constant {_range_note(bad)}")
  if carried:
    notes.append("its inputs were already not finite")
  return notes


def _record(
  eqn: Any,
  invals: list[Any],
  outvals: list[Any],
  constant: list[bool],
  outer: tuple[str, ...],
  phase: str,
  acc: Any,
  seen: _jax_source.Watch,
) -> None:
  outputs = [np.asarray(v) for v in outvals if _is_inexact(v)]
  if not outputs:
    return
  pairs = [(np.asarray(v), c) for v, c in zip(invals, constant) if _is_inexact(v)]
  inputs = [a for a, _ in pairs]
  carried = any(not c and not _finite(a) for a, c in pairs)  # made by an earlier operation
  constants = [a for a, c in pairs if c and not _finite(a)]  # inf already in the jaxpr
  nonfinite = not all(_finite(o) for o in outputs)
  # An inf constant seen made beyond the range (a literal 1e5 cast to float16) is made here;
  # one not seen made is taken as meant (an explicit -inf mask), as is a NaN.
  overflowed = [a for a in constants if bool(np.isinf(a).any())]
  from_made_constant = bool(overflowed) and seen.made_here(eqn)
  made = nonfinite and not carried and (not constants or from_made_constant)
  source, function = _jax_source.source_of(eqn)
  scope = _jax_source.scope_of(eqn, outer, seen.instances) or (function if function != "?" else "")
  acc.add(phase, scope, outputs, ranged=not carried, made=made)
  if not nonfinite or acc.first is not None:
    return
  if not made and acc.first_propagated is not None:
    return
  bad = next(o for o in outputs if not _finite(o))
  notes = _notes(eqn, bad, pairs, overflowed if from_made_constant else [], overflowed, carried)
  kind = "nan" if bool(np.isnan(bad).any()) else "inf"
  where = (phase, eqn.primitive.name, source, scope, kind, str(bad.dtype))
  op = _headroom.Operation(*where, _largest_finite(inputs), "; ".join(notes))
  if made:
    acc.first = op
  else:
    acc.first_propagated = op
