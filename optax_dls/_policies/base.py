"""The policy protocol: ``LossScalePolicy``, the ``GradStats`` it reads, and the check of a
user's policy."""

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
  """What a policy learns about one step's gradients.

  Attributes:
    finite: bool ``()``. True when the loss scale was valid, every floating
      entry of the unscaled gradients is finite and, when the loss is given
      (``update(..., loss=)``, :func:`optax_dls.value_and_grad`), the loss is finite
      too (reduced over ``axis_name`` when one is given): the step was applied.
    step: int32 ``()``. Number of updates before this one, skipped included.
    grad_norm: float32 ``()``, global L2 norm of the *unscaled* gradients
      (inf or NaN when they are not finite; a step skipped for its loss
      alone has a finite norm). With ``axis_name`` it is reduced
      over those axes, the same on every device.
    amax: float32 ``()``, largest absolute value of the *scaled* gradients as
      they arrived (maximised over ``axis_name`` when one is given), or
      ``None`` unless the policy lists ``"amax"`` in ``LossScalePolicy.stats``.
  """

  finite: jax.Array
  step: jax.Array
  grad_norm: jax.Array
  amax: jax.Array | None = None


class LossScalePolicy(NamedTuple):
  """A loss-scale update rule as a pair of pure functions.

  Write one the way you write an optax transformation::

      def init() -> tuple[jax.Array, PolicyState]:  # (loss_scale, policy_state)
        ...

      def update(
        loss_scale: jax.Array, policy_state: PolicyState, stats: GradStats
      ) -> tuple[jax.Array, PolicyState]:  # the next (loss_scale, policy_state)
        ...

  ``loss_scale`` is a float32 ``()`` array; ``policy_state`` is any pytree of
  arrays with fixed dtypes (it lives in the optimizer state); ``stats`` is a
  :class:`GradStats`. Both functions are traced under ``jit``: no Python
  control flow on array values.

  :func:`optax_dls.loss_scaled` checks a policy when it is built: it calls
  ``init()`` once (tiny arrays, nothing compiled) and requires a
  float32-castable ``()`` loss scale in ``[min_scale, max_scale]``
  (ValueError) and a state that is a pytree of arrays (TypeError); at trace
  time ``update`` must return a ``(loss_scale, policy_state)`` pair with a
  floating ``()`` scale and a state of ``init``'s tree structure, shapes and
  dtypes (TypeError). Whatever ``update`` returns, the loss-scaled
  transformation keeps the scale within ``[min_scale, max_scale]``.

  Attributes:
    init: builds the initial ``(loss_scale, policy_state)``.
    update: moves the scale after one step, given that step's statistics.
    stats: optional statistics the policy needs beyond ``finite`` and
      ``grad_norm``: a tuple of strings drawn from ``("amax",)``. Default ``()``.
    passthrough: bool (a NumPy bool is accepted). When True the wrapper
      neither unscales nor checks nor skips: gradients go to the inner
      optimizer unchanged. Only sound when the scale is always 1 (the no-op
      policy), so ``init()`` must return a scale of exactly 1. Default False.
    min_scale: float in ``[2**-126, 2**126]``, the lowest scale the policy
      may take. Default ``2**-126``.
    max_scale: float in ``[min_scale, 2**126]``, the highest. Default ``2**126``.
    preset: str or None, the name of the preset the policy was made by
      (``optax_dls.config.preset``), shown by ``repr``. Default None.

  ``repr`` is one line: the preset's name, a built-in rule's settings that differ from their
  defaults (else the functions' names), then the other fields that differ from theirs.

  Example:
    A policy that halves the scale on every overflow and never grows it, with
    no state of its own (an empty tuple):

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
    # A built-in rule's update is a partial of its settings; a wrapper's, of what it wraps.
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


def _name(policy: LossScalePolicy) -> str:
  return getattr(policy.update, "__qualname__", None) or repr(policy.update)


def _leaf_spec(x: Any) -> tuple[tuple[int, ...], Any]:
  return tuple(np.shape(x)), jnp.result_type(x)


def _check_init(policy: LossScalePolicy) -> tuple[Any, list[tuple[tuple[int, ...], Any]]]:
  """Runs ``policy.init()`` once (tiny arrays, no compilation) and checks what it returns.

  Returns the tree structure and the (shape, dtype) of each leaf of the policy state.
  """
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
  if (
    dtype is None
    or isinstance(scale, bool)
    or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer))
  ):
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
        f"{_validation.scale_text(policy.max_scale)}] in "
        f"float32, got {scale!r}."
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


def _checked_update(policy: LossScalePolicy, treedef: Any, specs: list) -> Callable:
  """``policy.update`` with trace-time checks of its output (pure Python, no runtime cost)."""
  return functools.partial(_checked, policy, treedef, specs)


def _checked(
  policy: LossScalePolicy, treedef: Any, specs: list, scale: Any, state: Any, stats: GradStats
) -> tuple[Any, Any]:
  out = policy.update(scale, state, stats)
  name = _name(policy)
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(
      f"policy.update ({name}) must return a (loss_scale, policy_state) pair, got {out!r}."
    )
  new_scale, new_state = out
  if np.shape(new_scale) != () or not jnp.issubdtype(jnp.result_type(new_scale), jnp.floating):
    raise TypeError(
      f"policy.update ({name}) must return a floating loss scale of shape (), got "
      f"shape {np.shape(new_scale)} and dtype {jnp.result_type(new_scale)}."
    )
  leaves, new_def = jax.tree.flatten(new_state)
  if new_def != treedef:
    raise TypeError(
      f"policy.update ({name}) must return a policy state with the tree structure of "
      f"policy.init()'s, {treedef}, got {new_def}."
    )
  got = [_leaf_spec(x) for x in leaves]
  if got != specs:
    raise TypeError(
      f"policy.update ({name}) must return policy-state leaves with the shapes and dtypes of "
      f"policy.init()'s, {specs}, got {got}."
    )
  return new_scale, new_state


def check_policy(policy: Any) -> LossScalePolicy:
  """Returns ``policy`` checked, its ``update`` wrapped with trace-time output checks.

  Runs ``policy.init()`` once, eagerly (tiny arrays; nothing is compiled).

  Raises:
    TypeError: ``policy`` is not a :class:`LossScalePolicy`; ``init`` / ``update`` not
      callable; ``stats`` not a tuple of strings; ``passthrough`` not a bool;
      ``min_scale`` / ``max_scale`` not numbers; ``init()`` not a
      ``(loss_scale, policy_state)`` pair or a state leaf that is not an array.
      At trace time: ``update`` returns something other than a
      ``(loss_scale, policy_state)`` pair with a floating ``()`` scale and a state
      of ``init``'s tree structure, shapes and dtypes.
    ValueError: unknown ``stats``; ``min_scale`` / ``max_scale`` outside
      ``[2**-126, 2**126]`` or in the wrong order; ``init``'s loss scale not a
      float32 ``()`` value in ``[min_scale, max_scale]``; ``passthrough=True``
      with an initial scale other than 1.
  """
  if not isinstance(policy, LossScalePolicy):
    raise TypeError(
      f"policy must be a LossScalePolicy, got {policy!r} of type {type(policy).__name__}."
    )
  if not (callable(policy.init) and callable(policy.update)):
    raise TypeError(f"policy.init and policy.update must be callable, got {policy!r}.")
  if not isinstance(policy.stats, (tuple, list)) or not all(
    isinstance(x, str) for x in policy.stats
  ):
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
  # A function made by exec has no module (None): a policy of the user's.
  module = getattr(getattr(policy.update, "func", policy.update), "__module__", None) or ""
  if module.startswith("optax_dls._policies."):
    return policy  # a built-in rule: its output is held by its tests, not checked per trace
  return policy._replace(update=_checked_update(policy, treedef, specs))
