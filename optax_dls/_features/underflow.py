"""Gradient-underflow statistics: the fractions of zero and float16-subnormal gradient entries."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_dls._core import labels as _labels
from optax_dls._core import multi_device as _multi_device
from optax_dls._core import numerics as _numerics

F16_MIN_NORMAL = 2.0**-14
_RESERVED = ("zero_frac", "subnormal_frac")


class UnderflowState(NamedTuple):
  """State of :func:`underflow_stats`.

  Attributes:
    fractions: dict of float32 ``()``: ``{'zero_frac', 'subnormal_frac'}`` over every floating
      entry, plus one such dict per label. NaN before the first applied step.
  """

  fractions: dict[str, Any]

  def loss_scale_metrics(self) -> dict[str, jax.Array]:
    flat = jax.tree_util.tree_flatten_with_path(self.fractions)[0]
    return {"underflow/" + "/".join(k.key for k in path): x for path, x in flat}


def _fractions(leaves: list[jax.Array], axis_name: Any) -> dict[str, jax.Array]:
  counts = jnp.zeros([3], jnp.float32).at[2].set(sum(int(x.size) for x in leaves))
  for x in leaves:
    a = jnp.abs(x.astype(_numerics.compute_dtype(x.dtype)))
    zero, sub = jnp.sum(a == 0), jnp.sum((a > 0) & (a < F16_MIN_NORMAL))
    counts = counts + jnp.stack([zero, sub, 0]).astype(jnp.float32)
  counts = _multi_device.psum(counts, axis_name)
  denom = jnp.maximum(counts[2], 1.0)
  return {"zero_frac": counts[0] / denom, "subnormal_frac": counts[1] / denom}


def _all_fractions(labels: Any, tree: Any, axis_name: Any) -> dict[str, Any]:
  leaves = _numerics.float_leaves(tree)
  out: dict[str, Any] = dict(_fractions(leaves, axis_name))
  if labels is not None:
    groups: dict[str, list[jax.Array]] = {}
    names = _labels.leaf_labels(labels, tree, "underflow_stats", _RESERVED)
    for label, leaf in zip(names, leaves, strict=True):
      groups.setdefault(label, []).append(leaf)
    for label, group in sorted(groups.items()):
      out[label] = _fractions(group, axis_name)
  return out


def underflow_stats(
  labels: Any = None, *, axis_name: str | tuple[str, ...] | None = None
) -> optax.GradientTransformation:
  """Records the fractions of zero and of float16-subnormal gradient entries.

  An identity transformation: chained first inside the loss-scaled one (skipped steps leave it as
  it was), :func:`metrics` reports ``underflow/zero_frac``, ``underflow/subnormal_frac``
  (``0 < |x| < 2**-14``) and ``underflow/<label>/...``. It costs one more read of the gradients.

  Args:
    labels: None (default: overall fractions only), a pytree of string labels matching the gradients
      (or a prefix of them), or a callable ``params -> labels``, as in ``optax.multi_transform``.
      Labels are non-empty, without ``/``, and not ``zero_frac`` / ``subnormal_frac``.
    axis_name: as in :func:`loss_scaled`: the axes the counts are summed over. Default None.

  Returns:
    An ``optax.GradientTransformation`` whose state is an ``UnderflowState``.

  Raises:
    TypeError: a label that is not a string, or a bad ``axis_name``.
    ValueError: an empty label tree, a reserved or malformed label, or (at ``init``) labels that do
      not match the parameters' structure.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> inner = optax.chain(optax_dls.underflow_stats(), optax.sgd(0.1))
    >>> tx = optax_dls.no_loss_scale(inner)
    >>> state = tx.init({'w': jnp.ones(4)})
    >>> _, state = tx.update({'w': jnp.array([0.0, 1e-6, 1.0, 2.0])}, state)
    >>> float(optax_dls.metrics(state)['underflow/subnormal_frac'])
    0.25
  """
  labels = _labels.check_labels(labels, "underflow_stats", _RESERVED)
  axis_name = _multi_device.check_axis_name(axis_name)

  def init(params: Any) -> UnderflowState:
    shapes = jax.eval_shape(lambda p: _all_fractions(labels, p, None), params)
    return UnderflowState(jax.tree.map(lambda s: jnp.full([], jnp.nan, jnp.float32), shapes))

  def update(updates: Any, state: UnderflowState, params: Any = None) -> tuple[Any, Any]:
    return updates, UnderflowState(_all_fractions(labels, updates, axis_name))

  return optax.GradientTransformation(init, update)
