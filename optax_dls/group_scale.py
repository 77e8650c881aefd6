"""Per-group gradient scaling: a second, fixed scale for a sub-network's gradients (a LoRA
adapter's, left below float16's range by one loss scale), as in Micikevicius et al. (2018)."""

from __future__ import annotations

import functools
import textwrap
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


def _is_bool(leaf: Any) -> bool:
  return isinstance(leaf, (bool, np.bool_)) or (
    isinstance(leaf, (jax.Array, np.ndarray)) and leaf.shape == () and leaf.dtype == np.bool_
  )


def _mask(mask: Any) -> Any:
  """``mask`` if callable or a pytree of bools; TypeError otherwise."""
  if callable(mask):
    return mask
  leaf = lambda p, x: f"the leaf {x!r} of type {type(x).__name__} at mask{jax.tree_util.keystr(p)}"
  bad = [leaf(p, x) for p, x in jax.tree_util.tree_leaves_with_path(mask) if not _is_bool(x)]
  if mask is None or bad:
    got = bad[0] if bad else "None"
    raise TypeError(
      f"mask must be a pytree of bools or a callable params -> such a pytree, got {got}."
    )
  return mask


def _times(ct: Any, factor: float) -> Any:
  if ct is None or not jnp.issubdtype(jnp.result_type(ct), jnp.inexact):  # float0 too
    return ct
  wide = jnp.promote_types(ct.dtype, jnp.float32)
  return (ct.astype(wide) * jnp.asarray(factor, wide)).astype(ct.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_gradient(x: Any, factor: float) -> Any:
  return x


_scale_gradient.defvjp(
  lambda x, factor: (x, None),
  lambda factor, _, ct: (jax.tree.map(lambda c: _times(c, factor), ct),),
)


def group_scaled(fn: Callable[..., Any], factor: float) -> Callable[..., Any]:
  """Wraps a sub-network ``fn(params, *inputs)``: its gradients come out ``factor`` times larger.

  The output's cotangent is multiplied by ``factor`` and the inputs' by ``1 / factor``, so the
  rest of the network gets what it would without the wrapper (up to float16 rounding). Divide
  ``params``' gradients with :func:`group_unscale` inside the loss-scaled optimizer, so that an
  overflow in the group skips the step. Only floating array leaves are touched.

  Args:
    fn: callable ``fn(params, *inputs, **kwargs) -> outputs`` (pytrees).
    factor: float in [2**-126, 2**126], static. A power of two keeps the products exact; other
      values are applied in float32 and rounded once to each cotangent's dtype.

  Returns:
    The wrapped callable, same signature.

  Raises:
    TypeError: ``fn`` is not callable, or ``factor`` is not a static number.
    ValueError: ``factor`` out of range.
  """
  _validation.function("fn", fn)
  factor = _validation.scale("factor", factor)
  inverse = _validation.scale("factor", 1.0 / factor)

  @functools.wraps(fn)
  def wrapped(params: Any, *inputs: Any, **kwargs: Any) -> Any:
    inputs, kwargs = _floats_scaled((inputs, kwargs), inverse)
    return _floats_scaled(fn(params, *inputs, **kwargs), factor)

  return wrapped


def _floats_scaled(tree: Any, factor: float) -> Any:
  """``tree`` with its floating arrays' cotangents multiplied by ``factor``."""
  arrays, rebuild = _calls.split_arrays(tree)
  return rebuild(_scale_gradient(arrays, factor))  # other dtypes' cotangents pass as they are


def group_unscale(factor: float, mask: Any) -> optax.GradientTransformation:
  """Divides the gradients selected by ``mask`` by ``factor`` (the inverse of :func:`group_scaled`).

  Use it first inside the loss-scaled optimizer, so a non-finite group gradient skips the step:
  ``dynamic_loss_scale(optax.chain(group_unscale(2.0**12, is_adapter), optax.adam(1e-3)))``. The
  product is formed in float32 (or wider) and cast back; non-floating leaves pass. Stateless.

  Args:
    factor: float in [2**-126, 2**126], the factor given to :func:`group_scaled`.
    mask: a pytree of bools with the structure of the gradients (or a prefix of it), or a callable
      ``params -> such a pytree``; True marks the group. As in ``optax.masked``.

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    TypeError: ``factor`` is not a static number, or ``mask`` is neither callable nor a pytree of
      bools (Python or NumPy bools, or 0-d bool arrays).
    ValueError: ``factor`` out of range; at ``init`` (or at the first update's trace), a mask
      whose tree is not a prefix of the parameters' (the gradients'), naming both structures.
  """
  # NumPy, not JAX: built inside a trace, a JAX value would be a tracer kept by update_fn.
  inverse = np.float32(1.0 / _validation.scale("factor", factor))
  mask = _mask(mask)

  update = lambda updates, state, params=None: (_numerics.unscale(updates, inverse), state)
  masked = optax.masked(optax.GradientTransformation(lambda _: optax.EmptyState(), update), mask)

  def init(params: Any) -> Any:
    _check_mask(mask, params, "parameters")
    return masked.init(params)

  def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
    _check_mask(mask, updates, "gradients")  # at trace time, before optax.masked reads it
    return masked.update(updates, state, params)

  return optax.GradientTransformation(init, update_fn)


def _check_mask(mask: Any, tree: Any, what: str) -> None:
  """ValueError unless ``mask`` (or what it returns for ``tree``) is a prefix of ``tree``."""
  got = mask(tree) if callable(mask) else mask
  try:
    jax.tree.structure(got).flatten_up_to(tree)  # type: ignore[attr-defined]
  except (ValueError, TypeError):
    short = lambda t: textwrap.shorten(str(jax.tree.structure(t)), 120, placeholder=" ...")
    raise ValueError(
      f"group_unscale: mask must have the tree structure of the {what} (or a prefix of it), "
      f"got mask {short(got)} and {what} {short(tree)}: build the mask from the parameters, "
      "e.g. jax.tree.map(lambda p: ..., params), or pass a callable params -> mask."
    ) from None
