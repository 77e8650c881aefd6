"""Per-group gradient scaling: a second, fixed scale for one sub-network's gradients.

One global loss scale S is limited by the largest gradients in the network
(they must stay below the float16 maximum), which can leave the gradients of a
small sub-network, a LoRA adapter for instance, below the float16 underflow
threshold (2**-24). Multiplying the cotangent that flows into that sub-network
by a factor k at its output, and by 1/k at its input, scales only that
sub-network's gradients; :func:`group_unscale` divides them by k again before
the optimizer. It is loss scaling (Micikevicius et al. 2018, *Mixed Precision
Training*) applied to part of the backward pass. A public submodule:
``optax_dls.group_scale``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_dls._core import numerics as _numerics
from optax_dls._util import calls as _calls
from optax_dls._util import validation as _validation

__all__ = ["group_scaled", "group_unscale"]


def _factor(value: Any) -> float:
  return _validation.scale("factor", value)


def _is_bool(leaf: Any) -> bool:
  return isinstance(leaf, (bool, np.bool_)) or (
    isinstance(leaf, (jax.Array, np.ndarray)) and leaf.shape == () and leaf.dtype == np.bool_
  )


def _mask(mask: Any) -> Any:
  """``mask`` if it is callable or a pytree of bools; TypeError naming it otherwise."""
  if callable(mask):
    return mask
  if mask is None:
    raise TypeError(
      "mask must be a pytree of bools or a callable params -> such a pytree, got None."
    )
  for path, leaf in jax.tree_util.tree_leaves_with_path(mask):
    if not _is_bool(leaf):
      raise TypeError(
        f"mask must be a pytree of bools or a callable params -> such a pytree, got the "
        f"leaf {leaf!r} of type {type(leaf).__name__} at mask{jax.tree_util.keystr(path)}."
      )
  return mask


def _times(ct: Any, factor: float) -> Any:
  if ct is None or jnp.result_type(ct) == jax.dtypes.float0:
    return ct
  if not jnp.issubdtype(jnp.result_type(ct), jnp.inexact):
    return ct
  wide = jnp.promote_types(ct.dtype, jnp.float32)
  return (ct.astype(wide) * jnp.asarray(factor, wide)).astype(ct.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_gradient(x: Any, factor: float) -> Any:
  return x


def _fwd(x: Any, factor: Any) -> tuple[Any, None]:
  return x, None


def _bwd(factor: Any, _: Any, ct: Any) -> tuple[Any]:
  return (jax.tree.map(lambda c: _times(c, factor), ct),)


_scale_gradient.defvjp(_fwd, _bwd)


def group_scaled(fn: Callable[..., Any], factor: float) -> Callable[..., Any]:
  """Wraps a sub-network ``fn(params, *inputs)``: its gradients come out ``factor`` times larger.

  The cotangent of the output is multiplied by ``factor`` (so every cotangent
  and parameter gradient inside the sub-network is scaled), and the
  cotangents of ``inputs`` by ``1 / factor`` on the way out, so the rest of the
  network receives exactly what it would without the wrapper (up to float16
  rounding of the scaled values). The gradients of ``params`` stay scaled:
  divide them by ``factor`` with :func:`group_unscale` inside the loss-scaled
  optimizer, so that an overflow inside the group is caught by the same
  all-finite check and the step is skipped.

  Only the floating-point array leaves of ``inputs`` (positional and keyword)
  and of the outputs are touched; every other leaf (a Python flag or string,
  an integer array, ``None``, an object) passes through as it is, so the
  wrapped callable accepts and returns whatever ``fn`` does, under ``jit``
  with static arguments too.

  For a single cotangent, ``optax.scale_gradient(x, factor)`` multiplies it alone
  (in the cotangent's own dtype; the same product as here for a power of two).

  Args:
    fn: callable ``fn(params, *inputs, **kwargs) -> outputs`` (pytrees).
    factor: float in [2**-126, 2**126], static. A power of two keeps the
      products exact; other values are applied in float32 and rounded once to
      each cotangent's dtype.

  Returns:
    The wrapped callable, same signature.

  Raises:
    TypeError: ``fn`` is not callable, or ``factor`` is not a static number.
    ValueError: ``factor`` out of range.
  """
  _validation.function("fn", fn)
  factor = _factor(factor)
  inverse = _factor(1.0 / factor)

  @functools.wraps(fn)
  def wrapped(params: Any, *inputs: Any, **kwargs: Any) -> Any:
    inputs, kwargs = _floats_scaled((inputs, kwargs), inverse)
    return _floats_scaled(fn(params, *inputs, **kwargs), factor)

  return wrapped


def _floats_scaled(tree: Any, factor: float) -> Any:
  """``tree`` with its floating-point array leaves' cotangents multiplied by ``factor``; the others
  (Python numbers, strings, integer arrays, objects) as they are."""
  arrays, rebuild = _calls.split_arrays(tree)
  floats = [i for i, x in enumerate(arrays) if jnp.issubdtype(x.dtype, jnp.inexact)]
  scaled = _scale_gradient([arrays[i] for i in floats], factor)
  for i, x in zip(floats, scaled, strict=True):
    arrays[i] = x
  return rebuild(arrays)


def group_unscale(factor: float, mask: Any) -> optax.GradientTransformation:
  """Divides the gradients selected by ``mask`` by ``factor`` (the inverse of :func:`group_scaled`).

  Use it first inside the loss-scaled optimizer, e.g.
  ``dynamic_loss_scale(optax.chain(group_unscale(2.0**12, is_adapter), optax.adam(1e-3)))``,
  so the loss-scale unscale (by S) and the group unscale (by k) both run
  before the inner optimizer, and a non-finite group gradient skips the step.
  The product is formed in float32 (or wider) and cast back to each leaf's
  dtype; non-floating leaves pass through. Stateless.

  Args:
    factor: float in [2**-126, 2**126], the factor given to :func:`group_scaled`.
    mask: a pytree of bools with the structure of the gradients (or a prefix
      of it), or a callable ``params -> such a pytree``; True marks the
      group. As in ``optax.masked``.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    TypeError: ``factor`` is not a static number, or ``mask`` is neither
      callable nor a pytree of bools (Python or NumPy bools, or 0-d bool
      arrays).
    ValueError: ``factor`` out of range.
  """
  # A NumPy value, not a JAX one: built inside a trace (a jitted init), a JAX value would
  # be a tracer of that trace, kept by update_fn (see LossScaler.__init__).
  inverse = np.float32(1.0 / _factor(factor))
  mask = _mask(mask)

  def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    del params
    return _numerics.unscale(updates, inverse), state

  return optax.masked(
    optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn), mask
  )
