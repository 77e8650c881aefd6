"""Setting the loss scale from outside the update."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_dls._access.find import find_state, replace_state
from optax_dls._util import validation as _validation


def reset_scale(opt_state: Any, value: Any) -> Any:
  """Returns ``opt_state`` with the loss scale set to ``value``.

  Each policy-state node with ``after_scale_reset()`` restarts its growth count; all else is kept.
  The next update brings the scale into the transformation's range (that step uses ``value``). A
  traced ``value`` that is not a valid scale is stored as NaN: the next step skips and restarts
  from the initial scale. A state stacked by ``jax.vmap(tx.init)`` takes one ``value`` or one each.

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.
    value: the new loss scale: a real number, or a float array (traced or not) of shape ``()`` or of
      the state's ``loss_scale`` shape, in ``[2**-126, 2**126]``.

  Raises:
    ValueError: a static ``value`` that is NaN, not finite, not > 0, outside ``[2**-126, 2**126]``;
      a ``value`` of another shape; none or more than one loss-scale state in ``opt_state``.
    TypeError: ``value`` not a real number.

  Returns:
    A new ``opt_state`` of the same structure, dtypes and wrappers; ``opt_state`` is unchanged.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> state = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init({'w': jnp.ones(2)})
    >>> optax_dls.find_state(optax_dls.reset_scale(state, 2.0**12)).loss_scale
    Array(4096., dtype=float32)
  """
  state = find_state(opt_state)
  low, high = _validation.SCALE_MIN, _validation.SCALE_MAX
  shape = jnp.shape(state.loss_scale)
  if np.ndim(value) and not isinstance(value, jax.core.Tracer):
    values = np.asarray(value)
    if values.shape != shape:
      raise ValueError(
        f"value must be a number or an array of the loss scale's shape {shape}, got shape "
        f"{values.shape}."
      )
    for v in values.reshape(-1):
      _validation.scale("value", v, low, high)
  elif isinstance(value, jax.core.Tracer):
    if value.shape not in ((), shape):
      raise ValueError(
        f"value must be a scalar or of the loss scale's shape {shape}, got a traced value "
        f"{value!r} of shape {value.shape}."
      )
  else:
    value = _validation.scale("value", value, low, high)
  scale = jnp.asarray(value, jnp.float32)
  ok = (scale >= np.float32(low)) & (scale <= np.float32(high))
  scale = jnp.where(ok, scale, jnp.float32(jnp.nan))
  scale = jnp.broadcast_to(scale, shape)
  restarts = lambda n: hasattr(n, "after_scale_reset")
  policy_state = jax.tree.map(
    lambda n: n.after_scale_reset() if restarts(n) else n, state.policy_state, is_leaf=restarts
  )
  return replace_state(opt_state, state._replace(loss_scale=scale, policy_state=policy_state))
