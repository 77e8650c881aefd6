"""The scalars of a loss-scale state for logging, with what each feature's state reports."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_dls._access.find import find_state
from optax_dls._core import record as _record
from optax_dls._util import validation as _validation


def metrics(opt_state: Any, *, scalars_only: bool = False) -> dict[str, jax.Array]:
  """What the loss scaler did, as a dict of device arrays (no host transfer).

  Every value is a 0-d array except the two bit sets. The keys:

  - ``loss_scale`` (float32): the scale for the next loss.
  - ``skipped`` (bool): whether the last step was skipped.
  - ``skip_count`` (int32): skipped steps so far.
  - ``consecutive_skips`` (int32): skipped steps since the last applied one.
  - ``num_steps`` (int32): updates so far, skipped included.
  - ``update_ratio`` (float32): applied steps over all steps, in [0, 1] (1 before any).
  - ``grad_norm`` (float32): global L2 norm of the last step's unscaled gradients (NaN before the
    first step, and with :func:`no_loss_scale` unless it tracks the norm).
  - ``nonfinite_step`` (int32): ``num_steps`` after the last non-finite step; 0 before any.
  - ``nonfinite_loss`` (bool): whether that step's loss was itself not finite (known when
    the loss is handed to ``update(..., loss=)`` or to :func:`value_and_grad`).
  - ``nonfinite_leaves``, ``nonfinite_nan`` (uint32 ``[W]``, ``W = max(1, ceil(leaves / 32))``): a
    bit per floating gradient leaf not finite on that step / holding a NaN (:func:`nonfinite_leaves`
    names them).
  - ``overflows/<label>`` (int32): with ``labels=``, the non-finite steps of that group.

  Features add: ``fp32_fallback`` (bool) and ``skips_at_min_scale`` (int32) with
  :func:`fp32_fallback`; ``underflow/zero_frac``, ``underflow/subnormal_frac``,
  ``underflow/<label>/...`` (float32) with :func:`underflow_stats`; ``recomputed_steps``,
  ``recompute_tries`` (int32) with :func:`recompute_stats`.

  Args:
    opt_state: any pytree holding exactly one :class:`LossScaleState` (as for :func:`find_state`).
    scalars_only: bool, default False: leave out ``nonfinite_leaves`` and ``nonfinite_nan``, and
      give the bool flags as int32 0 or 1 (for a trainer's metrics, summed over steps).

  Returns:
    A new ``dict`` from key to ``jax.Array``, as above.

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.
    TypeError: ``scalars_only`` is not a bool.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.array([1.0, jnp.inf])}, state, params)
    >>> m = optax_dls.metrics(state)
    >>> float(m['loss_scale']), bool(m['skipped']), int(m['skip_count'])
    (512.0, True, 1)
  """
  scalars_only = _validation.boolean("scalars_only", scalars_only)
  s = find_state(opt_state)
  steps = s.num_steps.astype(jnp.float32)
  applied = steps - s.num_skipped.astype(jnp.float32)
  record = s.nonfinite
  codes = record[..., :-2]
  out = {
    "loss_scale": s.loss_scale,
    "skipped": s.consecutive_skips > 0,
    "skip_count": s.num_skipped,
    "consecutive_skips": s.consecutive_skips,
    "num_steps": s.num_steps,
    "update_ratio": jnp.where(steps > 0, applied / jnp.maximum(steps, 1.0), 1.0),
    "grad_norm": s.grad_norm,
    "nonfinite_step": record[..., -1],
    "nonfinite_loss": record[..., -2] > 0,
    "nonfinite_leaves": _pack(codes > 0),
    "nonfinite_nan": _pack(codes == 2),
    **{f"overflows/{label}": count for label, count in s.overflows.items()},
  }
  out = {**out, **_feature_metrics((s.policy_state, s.inner_state))}
  if scalars_only:
    out = {k: v.astype(jnp.int32) if v.dtype == jnp.bool_ else v for k, v in out.items()}
    out = {k: v for k, v in out.items() if k not in ("nonfinite_leaves", "nonfinite_nan")}
  return out


def _pack(flags: jax.Array) -> jax.Array:
  """uint32 ``[..., W]``: the bool ``[..., n]`` flags packed, 32 to a word."""
  if not flags.shape[-1]:  # no floating leaf: one word, clear
    return jnp.zeros((*flags.shape[:-1], 1), jnp.uint32)
  flat = flags.reshape(-1, flags.shape[-1])
  return jax.vmap(_record.pack)(flat).reshape(*flags.shape[:-1], -1)


def _feature_metrics(tree: Any) -> dict[str, jax.Array]:
  """The keys each feature's state reports, nested ones included."""
  reports = lambda x: hasattr(x, "loss_scale_metrics")
  out = {}
  for node in jax.tree.leaves(tree, is_leaf=reports):
    if reports(node):
      out.update(_feature_metrics(tuple(node)))
      out.update(node.loss_scale_metrics())
  return out
