"""``loss_scaled`` and the transformation it returns: an ordinary optax
``GradientTransformationExtraArgs`` whose ``init`` and ``update`` are a scaler's methods."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

from optax_dls import _policies
from optax_dls._core import accumulation as _accumulation
from optax_dls._core import labels as _labels
from optax_dls._core import lowering as _lowering
from optax_dls._core import multi_device as _multi_device
from optax_dls._core.passthrough import PassthroughScaler
from optax_dls._core.scaler import LossScaler


class LossScaledTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation with loss scaling, and its fused step.

  It is an ``optax.GradientTransformationExtraArgs`` (``init``, ``update``),
  usable wherever optax expects one, and an ordinary Python object: it copies,
  deep-copies, pickles (where its inner transformation's and policy's
  functions do) and rebuilds from its two fields. Its ``update`` is the method
  of a ``LossScaler`` (the private object that holds the definition: inner
  transformation, policy, axis names, lowering), which also gives it

  * ``fused_step(grads, state, params, **extra_args) -> (new_params,
    new_state)``: the update and ``optax.apply_updates`` in one, which
    :func:`apply_step` calls;
  * ``back_off(grads, state, *, loss=None) -> (finite, state)``: the check of
    ``update`` on (scaled) ``grads`` and, when they are not finite, ``state``
    with the policy's move for that overflow (the scale to recompute at),
    which :func:`value_and_grad` calls;
  * ``passthrough``: True when the scale is 1 by construction
    (:func:`no_loss_scale`): nothing is checked, and the loss need not be
    multiplied by the scale.

  They stay with the ``update`` they belong to through ``copy``,
  ``_replace(init=...)`` and any rebuilding; an ``update`` replaced by another
  function has none (None, False).
  """

  @property
  def scaler(self) -> LossScaler | None:
    """The ``LossScaler`` whose ``update`` this is, or None (an ``update`` replaced by
    another function)."""
    owner = getattr(self.update, "__self__", None)
    return owner if isinstance(owner, LossScaler) else None

  @property
  def fused_step(self) -> Callable[..., tuple[Any, Any]] | None:
    """``update`` and ``optax.apply_updates`` in one, or None without a ``LossScaler``.

    ``fused_step(grads, state, params, *, loss=None, **extra_args) -> (new_params,
    new_state)``, as :func:`apply_step` calls it.
    """
    return None if self.scaler is None else self.scaler.fused_step

  @property
  def back_off(self) -> Callable[..., tuple[jax.Array, Any]] | None:
    """The check and the policy's move for an overflow, or None without a ``LossScaler``.

    ``back_off(grads, state, *, loss=None) -> (finite, state)``, ``finite`` a bool
    ``()``, as :func:`value_and_grad` calls it.
    """
    return None if self.scaler is None else self.scaler.back_off

  @property
  def passthrough(self) -> bool:
    """Whether the loss scale is 1 by construction (:func:`no_loss_scale`)."""
    return self.scaler is not None and self.scaler.passthrough


def transformation(scaler: LossScaler) -> LossScaledTransformation:
  """The optax transformation carrying ``scaler``'s functions."""
  return LossScaledTransformation(scaler.init, scaler.update)


def loss_scaled(
  inner: optax.GradientTransformation,
  policy: _policies.LossScalePolicy,
  *,
  axis_name: str | tuple[str, ...] | None = None,
  skip_lowering: str = "auto",
  labels: _labels.Labels = None,
) -> LossScaledTransformation:
  """Wraps ``inner`` with loss scaling driven by ``policy``.

  One ``update(grads, state, params=None, *, loss=None, **extra_args)`` does, with S the
  loss scale the loss was multiplied by (Micikevicius et al. 2018, *Mixed
  Precision Training*):

  1. unscale: ``u = grads * (1/S)`` in float32 (float64 for float64 leaves),
     cast to each leaf's dtype, or to its parameter's where ``params`` are given
     and the parameter is a wider real float (a float16 or bfloat16 gradient of a
     float32 parameter is unscaled into float32, so the updates have the
     parameter's dtype and nothing the scale saved is flushed again); a gradient
     as narrow as its parameter, or with ``params=None``, keeps its own dtype;
     integer, bool and ``None`` leaves pass through untouched;
  2. check: ``finite`` when S is a valid scale (finite, > 0), every
     floating entry of ``u`` is finite (exact) and, when ``loss`` is given,
     the loss is finite too, reduced over ``axis_name``; a non-finite step
     records which gradient leaves held an inf or a NaN and whether the loss
     was not finite (:func:`nonfinite_leaves`, :func:`metrics`);
  3. skip or apply: if finite, ``inner.update(u, inner_state, params,
     **extra_args)``; otherwise the updates are negative zeros of exactly the
     type the applied step returns (structure, dtype, sharding), so that
     ``optax.apply_updates`` leaves every parameter bit for bit (``-0.0``
     included; integer leaves get plain zeros), and ``inner_state`` is
     returned unchanged (bit for bit, or widened where the inner optimizer
     widens its own state), so its step count and learning-rate schedule do
     not advance, and the inner optimizer never sees a non-finite value;
  4. ``policy.update`` moves S for the next loss, kept within the policy's
     ``[min_scale, max_scale]``. A loss scale that is not valid (NaN, inf,
     0, negative: a corrupted checkpoint, a misbehaving policy) skips the
     step and comes back as the policy's initial scale.

  No host synchronisation. The state's types are a fixed point from ``init``
  on (no retrace after the first step): ``init`` gives each inner state leaf
  the dtype the inner updates settle on and their weak or strong type (traced
  with ``jax.eval_shape``, an update that needs the loss given a float32
  ``value=``). The one exception is an inner update that cannot be traced
  without its other extra arguments (``value_fn=`` of ``optax.lbfgs``'s line
  search, say): the state is made strongly typed, and a state such an
  optimizer widens on its first update retraces once.

  Args:
    inner: any optax ``GradientTransformation``; ``**extra_args`` of
      ``update`` are forwarded to it. An ``optax.MultiSteps`` (gradient
      accumulation) is accepted as is: a non-finite micro-batch is then
      dropped before it reaches the accumulator.
    policy: a :class:`LossScalePolicy`, e.g. :func:`dynamic_policy`.
    axis_name: ``None`` (default), a mapped axis name or a tuple of names.
      Needed under ``pmap`` / ``shard_map``: the finite flag is reduced over
      every named axis so that all devices skip together, and ``grad_norm``
      becomes the same on every device. Name every axis the gradients are
      sharded or computed over. Not needed under ``jit`` with
      ``NamedSharding``. Under ``vmap`` with an axis name every member shares
      one decision; without one each member keeps its own scale.
    skip_lowering: ``"auto"`` (default), ``"cond"`` or ``"where"``: how the
      skip is compiled (a ``lax.cond``, or a ``jnp.where`` selection at the
      end, which XLA's GPU backend fuses into the optimizer's kernels). Both
      make the same skip decisions and scales; applied values agree to
      float32 rounding (some entries may differ in the last bit); ``"auto"``
      takes ``"where"`` on GPUs, TPUs and every other platform, and on the CPU
      ``"cond"``'s one-read check with a ``jnp.where`` skip that selects each
      new state value where the inner update computes it (a selection at the
      end makes XLA's CPU backend copy the state; see ``docs/design.md``).
    labels: ``None`` (default), or parameter-group labels as in
      :func:`underflow_stats` (a pytree of strings matching the parameters, or
      a prefix of them, or a callable ``params -> such a pytree``; non-empty,
      without ``/``): the state then counts, per label, the non-finite steps in
      which some leaf of that group was not finite (:func:`metrics` reports
      them as ``overflows/<label>``), e.g. LoRA adapters against base weights.

  Returns:
    A :class:`LossScaledTransformation` whose state is a :class:`LossScaleState`.

  Raises:
    TypeError: ``inner`` is not an optax transformation, ``policy`` is not a
      usable :class:`LossScalePolicy`, ``axis_name`` is not a string or tuple
      of strings, ``skip_lowering`` is not a string, or a label is not a string.
    ValueError: ``skip_lowering`` is not one of the three, the policy's
      scales are out of range, or the labels are empty or malformed (at
      ``init``: they do not match the parameters). At trace time, under ``shard_map`` (with
      ``check_vma=True``), when the gradients vary over a mesh axis that
      ``axis_name`` leaves out, or ``axis_name`` names an axis that is not
      mapped where ``update`` runs; or when the state's policy state is not of
      this transformation's policy (a state built or restored under another).

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.loss_scaled(optax.sgd(1.0), optax_dls.static_policy(4.0))
    >>> state = tx.init({'w': jnp.zeros(2)})
    >>> updates, state = tx.update({'w': jnp.array([4.0, jnp.inf])}, state)
    >>> updates['w'], bool(state.last_step_finite)
    (Array([-0., -0.], dtype=float32), False)
  """
  return transformation(build_scaler(inner, policy, axis_name, skip_lowering, labels))


def _without_extra_args(
  update: Callable[..., Any], updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> Any:
  del extra_args
  return update(updates, state, params)


def _with_extra_args(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """``inner`` taking ``**extra_args`` (dropped where it takes none), as
  ``optax.with_extra_args_support`` does, and as picklable as ``inner`` is."""
  if isinstance(inner, optax.GradientTransformationExtraArgs):
    return inner
  return optax.GradientTransformationExtraArgs(
    inner.init, functools.partial(_without_extra_args, inner.update)
  )


def build_scaler(
  inner: Any, policy: Any, axis_name: Any, skip_lowering: Any, labels: Any, **options: Any
) -> LossScaler:
  """The :class:`LossScaler` of checked arguments (a :class:`PassthroughScaler` for a
  passthrough policy, which takes ``options``)."""
  inner = _with_extra_args(_accumulation.check_inner(inner))
  policy = _policies.check_policy(policy)
  axis_name = _multi_device.check_axis_name(axis_name)
  lowering = _lowering.lowering(skip_lowering)
  labels = _labels.check_labels(labels, "loss_scaled")
  kind = PassthroughScaler if policy.passthrough else LossScaler
  return kind(inner, policy, axis_name, lowering, labels, **options)
