"""The recomputation's counters, written by :func:`optax_dls.value_and_grad`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._util import validation as _validation


class RecomputeState(NamedTuple):
  """State of :func:`recompute_stats`.

  Attributes:
    recomputed_steps: int32 ``()``, steps :func:`optax_dls.value_and_grad` recomputed.
    recompute_tries: int32 ``()``, the extra passes they took, float32 included. Both saturate at
      ``2**31 - 1``.
  """

  recomputed_steps: jax.Array
  recompute_tries: jax.Array

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    """Both counters, for :func:`optax_dls.metrics`."""
    return {"recomputed_steps": self.recomputed_steps, "recompute_tries": self.recompute_tries}


def recompute_stats() -> optax.GradientTransformation:
  """Counts what :func:`value_and_grad` recomputes, for :func:`metrics`.

  An identity transformation to chain inside the loss-scaled one; :func:`metrics` then reports
  ``recomputed_steps`` and ``recompute_tries`` (see ``RecomputeState``), also on skipped steps.

  Returns:
    An ``optax.GradientTransformation`` whose state is a ``RecomputeState``, zero at ``init``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(
    ...   optax.chain(optax_dls.recompute_stats(), optax.sgd(1.0)), init_scale=2.0**16)
    >>> params = {'w': jnp.ones(1)}
    >>> loss = lambda p: jnp.sum(p['w'].astype(jnp.float16) * 4.0)  # overflows at 2**16
    >>> _, state = optax_dls.value_and_grad(loss, tx)(tx.init(params), params)
    >>> m = optax_dls.metrics(state)
    >>> int(m['recomputed_steps']), int(m['recompute_tries'])
    (1, 3)
  """

  init = lambda _: RecomputeState(*[jnp.zeros([], jnp.int32)] * 2)
  return optax.GradientTransformation(init, lambda updates, state, params=None: (updates, state))


def record(inner_state: Any, tries: jax.Array) -> Any:
  """``inner_state`` with its :class:`RecomputeState` (if any) counting ``tries`` passes."""
  is_node = lambda x: isinstance(x, RecomputeState)
  if sum(map(is_node, jax.tree.leaves(inner_state, is_leaf=is_node))) > 1:
    raise ValueError(
      "the inner optimizer holds more than one recompute_stats state: chain "
      "optax_dls.recompute_stats() once inside the loss-scaled transformation."
    )

  steps = (tries > 0).astype(jnp.int32)
  count = lambda n: RecomputeState(_add(n.recomputed_steps, steps), _add(n.recompute_tries, tries))
  return jax.tree.map(lambda n: count(n) if is_node(n) else n, inner_state, is_leaf=is_node)


def _add(count: jax.Array, n: jax.Array) -> jax.Array:
  top = _validation.INT32_MAX
  return jnp.where(count > top - n, top, count + n).astype(jnp.int32)
