"""Opt-in monitoring inside the update: gradient-underflow statistics and alerts.

Both cost nothing when off: no reduction and no callback is traced.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback

from optax_dls import _numerics
from optax_dls import _validation as v

logger = logging.getLogger("optax_dls")

# Smallest positive normal float16 number: below it fp16 values are subnormal.
F16_MIN_NORMAL = 2.0**-14
_RESERVED = ("zero_frac", "subnormal_frac")


# --- Gradient-underflow statistics ----------------------------------------------


def check_underflow_option(option: Any) -> Any:
  """Validates ``underflow_stats``: None/False (off), True, a callable or a label pytree."""
  if option is None or option is False:
    return None
  if option is True or callable(option):
    return option
  leaves = jax.tree.leaves(option)
  if not leaves:
    raise ValueError(f"underflow_stats must be None, True, a callable or a pytree of labels, got {option!r}.")
  for label in leaves:
    _check_label(label)
  return option


def _check_label(label: Any) -> str:
  if not isinstance(label, str):
    raise TypeError(f"underflow_stats labels must be strings, got label {label!r} of type "
                    f"{type(label).__name__}.")
  if not label or "/" in label or label in _RESERVED:
    raise ValueError(
        f"underflow_stats labels must be non-empty strings without '/' and other than "
        f"{_RESERVED}, got label {label!r}.")
  return label


def _groups(option: Any, tree: Any) -> dict[str, list[jax.Array]]:
  """Floating leaves of ``tree`` grouped by label (trace-time Python)."""
  labels = option(tree) if callable(option) else option
  label_leaves, treedef = jax.tree.flatten(labels)
  try:
    subtrees = treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"underflow_stats labels do not match the gradient tree structure: {e}") from None
  groups: dict[str, list[jax.Array]] = {}
  for label, sub in zip(label_leaves, subtrees):
    groups.setdefault(_check_label(label), []).extend(_numerics._float_leaves(sub))
  return groups


def _fractions(leaves: list[jax.Array], axis_name: Any) -> dict[str, jax.Array]:
  counts = jnp.zeros([3], jnp.float32).at[2].set(sum(int(x.size) for x in leaves))
  for x in leaves:
    a = jnp.abs(x.astype(_numerics._compute_dtype(x.dtype)))
    counts = counts + jnp.stack([jnp.sum(a == 0, dtype=jnp.float32),
                                 jnp.sum((a > 0) & (a < F16_MIN_NORMAL), dtype=jnp.float32),
                                 jnp.zeros([], jnp.float32)])
  names = _numerics._axis_names(axis_name)
  if names:
    counts = lax.psum(counts, names)
  denom = jnp.maximum(counts[2], 1.0)
  return {"zero_frac": counts[0] / denom, "subnormal_frac": counts[1] / denom}


def underflow_fractions(option: Any, tree: Any, axis_name: Any = None) -> dict[str, Any]:
  """Fractions of zero and of fp16-subnormal (0 < |x| < 2**-14) floating entries.

  Returns ``{'zero_frac', 'subnormal_frac'}`` over every floating leaf, plus
  ``{label: {'zero_frac', 'subnormal_frac'}}`` per label when ``option`` is a
  label pytree or a ``params -> labels`` callable (as in
  ``optax.multi_transform``). All values float32 ``()``; a group with no
  floating entries reads 0. With ``axis_name`` the counts are summed over
  the named axes, so every device holds the same fractions.
  """
  out = _fractions(_numerics._float_leaves(tree), axis_name)
  if option is not True:
    for label, leaves in sorted(_groups(option, tree).items()):
      out[label] = _fractions(leaves, axis_name)
  return out


def underflow_init(option: Any, params: Any) -> dict[str, Any]:
  """The ``underflow`` state field before the first step: NaN fractions ({} when off)."""
  if option is None:
    return {}
  shapes = jax.eval_shape(lambda p: underflow_fractions(option, p), params)
  return jax.tree.map(lambda s: jnp.full([], jnp.nan, jnp.float32), shapes)


def flatten_underflow(tree: dict[str, Any]) -> dict[str, jax.Array]:
  """``{'underflow/zero_frac': ..., 'underflow/<label>/zero_frac': ...}``."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      for k, x in value.items():
        out[f"underflow/{key}/{k}"] = x
    else:
      out[f"underflow/{key}"] = value
  return out


# --- Alerts ------------------------------------------------------------------


def _warn(step, scale, skips, fire_skips, fire_min):
  if jax.process_index() != 0:
    return
  step, scale, skips = int(step), float(scale), int(skips)
  if bool(fire_skips):
    logger.warning(
        "optax_dls: %d consecutive skipped steps (non-finite gradients) at step %d; "
        "loss scale now %g. See docs/observability.md for what to check.",
        skips, step, scale)
  if bool(fire_min):
    logger.warning(
        "optax_dls: loss scale stuck at its minimum %g: step %d was non-finite even at the "
        "minimum scale (%d consecutive skips). The overflow is not caused by the loss scale: "
        "check the data, the learning rate, the forward pass, or use the float32 fallback.",
        scale, step, skips)


def check_alert_after(alert_after: Any) -> int:
  """``alert_after`` as an int in [1, 2**31 - 1]; TypeError / ValueError otherwise."""
  alert_after = v.integer("alert_after", alert_after)
  v.check(1 <= alert_after <= v.INT32_MAX, "alert_after", alert_after, "1 <= value <= 2**31 - 1")
  return alert_after


def emit_alerts(*, step: jax.Array, scale: jax.Array, consecutive: jax.Array,
                at_min: jax.Array | None, alert_after: int, axis_name: Any) -> None:
  """Traces one conditional, ordered ``io_callback`` that logs a warning.

  It fires on the step where ``consecutive`` becomes ``alert_after`` (once per
  episode of skips) and on the first skip taken at the minimum scale
  (``at_min == 1``); under ``pmap`` / ``shard_map`` only on the device with
  index 0 on every named axis, and in the callback only on process 0. Under
  ``vmap`` (where a callback inside a conditional is not supported) nothing
  is traced and the alerts are off.
  """
  fire_skips = consecutive == alert_after
  fire_min = jnp.zeros([], jnp.bool_) if at_min is None else at_min == 1
  fire = fire_skips | fire_min
  for name in _numerics._axis_names(axis_name):
    fire = fire & (lax.axis_index(name) == 0)

  def call():
    io_callback(_warn, None, step, scale, consecutive, fire_skips, fire_min, ordered=True)

  try:
    lax.cond(fire, call, lambda: None)
  except NotImplementedError:
    logger.info("optax_dls: loss-scale alerts are off under vmap (a callback inside a "
                "conditional cannot be batched); pass alerts=False to silence this.")

