"""The policy protocol: ``LossScalePolicy``, the ``GradStats`` it reads, and its check."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_dls._util import validation as _validation
from optax_dls._util.validation import SCALE_MAX, SCALE_MIN

STATS = frozenset({"amax"})


class GradStats(NamedTuple):
  """What a policy learns about one step's gradients (reduced over ``axis_name`` when given).

  Attributes:
    finite: bool ``()``, True when the step was applied: the loss scale was valid, every
      floating entry of the unscaled gradients is finite and so is the loss when given
      (``update(..., loss=)``, :func:`optax_dls.value_and_grad`).
    step: int32 ``()``, the number of updates before this one, skipped included.
    grad_norm: float32 ``()``, global L2 norm of the *unscaled* gradients (inf or NaN when
      they are not finite; finite for a step skipped for its loss alone).
    amax: float32 ``()``, largest absolute value of the *scaled* gradients as they arrived,
      or ``None`` unless the policy lists ``"amax"`` in ``LossScalePolicy.stats``.
  """

  finite: jax.Array
  step: jax.Array
  grad_norm: jax.Array
  amax: jax.Array | None = None


class LossScalePolicy(NamedTuple):
  """A loss-scale update rule as a pair of pure functions.

  Write one the way you write an optax transformation::

      def init() -> tuple[jax.Array, PolicyState]: ...  # (loss_scale, policy_state)
      def update(loss_scale, policy_state, stats) -> tuple[jax.Array, PolicyState]: ...

  ``loss_scale`` is a float32 ``()`` array, ``policy_state`` any pytree of arrays with fixed
  dtypes (kept in the optimizer state), ``stats`` a :class:`GradStats`; ``update`` returns the
  next pair. Both are traced under ``jit``: no Python control flow on array values.

  :func:`optax_dls.loss_scaled` calls ``init()`` once when built: the scale must be a
  float32-castable ``()`` value in ``[min_scale, max_scale]`` (ValueError), the state a pytree of
  arrays (TypeError). At trace time ``update`` must return a pair of a floating ``()`` scale and
  a state of ``init``'s tree structure, shapes and dtypes (TypeError). Whatever it returns, the
  scale is kept within ``[min_scale, max_scale]``.

  Attributes:
    init: builds the initial ``(loss_scale, policy_state)``.
    update: moves the scale after one step, given that step's statistics.
    stats: tuple of strings from ``("amax",)``, the optional GradStats fields used. Default ``()``.
    passthrough: bool (a NumPy bool is accepted). When True the gradients go to the inner
      optimizer unscaled, unchecked and never skipped, so ``init()`` must return a scale of
      exactly 1 (the no-op policy). Default False.
    min_scale: float in ``[2**-126, 2**126]``, the lowest scale. Default ``2**-126``.
    max_scale: float in ``[min_scale, 2**126]``, the highest. Default ``2**126``.
    preset: str or None, the name of the ``optax_dls.config.preset`` that made it. Default None.

  ``repr`` is one line: the preset, a built-in rule's settings (those with a default where they
  differ; else the functions' names), then the other fields that differ from their defaults.

  Example:
    Halve the scale on every overflow, never grow it; no state (an empty tuple):

    >>> import jax.numpy as jnp, optax, optax_dls
    >>> def init():
    ...   return jnp.float32(2.0**10), ()
    >>> def update(scale, state, stats):
    ...   return jnp.where(stats.finite, scale, scale / 2), state
    >>> policy = optax_dls.LossScalePolicy(init, update, min_scale=1.0)
    >>> tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
    >>> state = tx.init({'w': jnp.ones(1)})
    >>> _, state = tx.update({'w': jnp.array([jnp.inf])}, state)
    >>> float(state.loss_scale)
    512.0
  """

  init: Callable[[], tuple[jax.Array, Any]]
  update: Callable[[jax.Array, Any, GradStats], tuple[jax.Array, Any]]
  stats: tuple[str, ...] = ()
  passthrough: bool = False
  min_scale: float = SCALE_MIN
  max_scale: float = SCALE_MAX
  preset: str | None = None

  def __repr__(self) -> str:
    shown = [f"preset={self.preset!r}"] if self.preset is not None else []
    # A built-in rule's update is a partial of its settings, a wrapper's of what it wraps.
    rule: Any = (*getattr(self.update, "args", ()), None)[0]
    if hasattr(rule, "_asdict") and not isinstance(rule, LossScalePolicy):
      defaults = rule._field_defaults
      settings = {k: v for k, v in rule._asdict().items() if defaults.get(k, None) != v}
    else:  # a wrapper's update names what it wraps; a policy of the user's, its functions
      settings = {}
      shown += [] if rule is not None else [f"init={_function(self.init)}"]
      shown += [f"update={_function(self.update)}"]
    for field in ("stats", "passthrough", "min_scale", "max_scale"):
      if field not in settings and getattr(self, field) != self._field_defaults[field]:
        settings[field] = getattr(self, field)
    shown += [f"{k}={_text(v)}" for k, v in settings.items()]
    return f"LossScalePolicy({', '.join(shown)})"


def _function(f: Any) -> str:
  """A function's name, with the arguments a ``functools.partial`` of it binds."""
  name = getattr(getattr(f, "func", f), "__qualname__", None) or repr(f)
  args = getattr(f, "args", None)
  return name if args is None else f"{name}({', '.join(map(_text, args))})"


def _text(value: Any) -> str:
  """A float as a scale reads (``2**16``), anything else as its repr."""
  return _validation.scale_text(value) if isinstance(value, float) else repr(value)


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], Any]:
  return tuple(np.shape(x)), jnp.result_type(x)


def _check_init(policy: LossScalePolicy) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
  """Checks ``policy.init()``'s output; returns the state's treedef and leaf (shape, dtype)s."""
  with jax.ensure_compile_time_eval():  # also where the transformation is built in a trace
    out = policy.init()
  if not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(f"policy.init() must return a (loss_scale, policy_state) pair, got {out!r}.")
  scale, state = out
  what = f"the loss scale returned by policy.init() ({policy.init!r})"
  try:
    dtype = jnp.result_type(scale)
  except (TypeError, ValueError):
    dtype = None
  real = dtype is not None and any(jnp.issubdtype(dtype, t) for t in (jnp.floating, jnp.integer))
  if not real or isinstance(scale, bool):
    raise ValueError(f"{what} must be a real number castable to float32, got {scale!r}.")
  if np.shape(scale) != ():
    raise ValueError(f"{what} must have shape (), got shape {np.shape(scale)} ({scale!r}).")
  if not isinstance(scale, jax.core.Tracer):
    with np.errstate(over="ignore"):
      value = float(np.float32(np.asarray(scale)))
    if not np.float32(policy.min_scale) <= value <= np.float32(policy.max_scale):
      raise ValueError(
        f"{what} must be finite and > 0, within the policy's [min_scale, max_scale] = "
        f"[{_validation.scale_text(policy.min_scale)}, "
        f"{_validation.scale_text(policy.max_scale)}] in float32, got {scale!r}."
      )
    if policy.passthrough and value != 1.0:
      raise ValueError(
        f"a policy with passthrough=True must start at loss scale 1 (gradients are not "
        f"unscaled), got {what} = {scale!r}."
      )
  leaves, treedef = jax.tree.flatten(state)
  for leaf in leaves:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
        f"the policy state returned by policy.init() ({policy.init!r}) must be a pytree of "
        f"arrays, got a leaf {leaf!r} of type {type(leaf).__name__}."
      )
  return treedef, [_leaf_spec(x) for x in leaves]


def _checked(
  policy: LossScalePolicy, treedef: Any, specs: list, scale: Any, state: Any, stats: GradStats
) -> tuple[Any, Any]:
  """``policy.update`` with trace-time checks of its output (no runtime cost)."""
  out = policy.update(scale, state, stats)
  name = getattr(policy.update, "__qualname__", None) or repr(policy.update)
  must = f"policy.update ({name}) must return"
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(f"{must} a (loss_scale, policy_state) pair, got {out!r}.")
  new_scale, new_state = out
  if np.shape(new_scale) != () or not jnp.issubdtype(jnp.result_type(new_scale), jnp.floating):
    raise TypeError(
      f"{must} a floating loss scale of shape (), got "
      f"shape {np.shape(new_scale)} and dtype {jnp.result_type(new_scale)}."
    )
  leaves, new_def = jax.tree.flatten(new_state)
  if new_def != treedef:
    raise TypeError(
      f"{must} a policy state with the tree structure of policy.init()'s, {treedef}, got {new_def}."
    )
  got = [_leaf_spec(x) for x in leaves]
  if got != specs:
    raise TypeError(
      f"{must} policy-state leaves with the shapes and dtypes of policy.init()'s, {specs}, "
      f"got {got}."
    )
  return new_scale, new_state


def check_policy(policy: Any) -> LossScalePolicy:
  """``policy`` checked, a user's ``update`` wrapped with trace-time output checks."""
  if not isinstance(policy, LossScalePolicy):
    raise TypeError(
      f"policy must be a LossScalePolicy, got {policy!r} of type {type(policy).__name__}."
    )
  if not (callable(policy.init) and callable(policy.update)):
    raise TypeError(f"policy.init and policy.update must be callable, got {policy!r}.")
  stats = policy.stats
  if not (isinstance(stats, (tuple, list)) and all(isinstance(x, str) for x in stats)):
    raise TypeError(
      f"policy.stats must be a tuple of strings drawn from {sorted(STATS)}, "
      f"got {policy.stats!r} of type {type(policy.stats).__name__}."
    )
  if set(policy.stats) - STATS:
    raise ValueError(
      f"policy.stats must be a tuple drawn from {sorted(STATS)}, got {policy.stats!r}."
    )
  lo = _validation.scale("policy.min_scale", policy.min_scale)
  hi = _validation.scale("policy.max_scale", policy.max_scale)
  _validation.check(
    lo <= hi, "policy.max_scale", hi, f"policy.max_scale >= policy.min_scale={lo!r}"
  )
  policy = policy._replace(
    stats=tuple(policy.stats),
    min_scale=lo,
    max_scale=hi,
    passthrough=_validation.boolean("policy.passthrough", policy.passthrough),
  )
  treedef, specs = _check_init(policy)
  # A built-in rule's output is held by its tests; a user's (module None from exec) is checked.
  module = getattr(getattr(policy.update, "func", policy.update), "__module__", None) or ""
  if module.startswith("optax_dls._policies."):
    return policy
  return policy._replace(update=functools.partial(_checked, policy, treedef, specs))
