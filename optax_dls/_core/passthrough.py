"""The transformation of a ``passthrough`` policy (:func:`optax_dls.no_loss_scale`): the bare
optimizer in the loss-scaled state's layout."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_dls._core import numerics as _numerics
from optax_dls._core.scaler import LossScaler, _Output, check_state
from optax_dls._core.state import LossScaleState, passed, settled_scale
from optax_dls._util import model as _model


class PassthroughScaler(LossScaler):
  """The transformation of a ``passthrough`` policy (S = 1 by construction): gradients go
  to ``inner`` unchanged, nothing is checked or skipped, and the inner state is exactly
  what ``inner`` makes it (so the result is the bare ``inner``'s, to rounding:
  :func:`restored_inverse`); the state keeps the loss-scaled layout, its scale 1 after
  every update (a state restored from another transformation is settled to 1 by
  ``checkpoint.restore``, or by its first update, which divides the gradients by the
  restored scale the loss was multiplied by). ``grad_norm`` is measured only when asked
  for."""

  passthrough = True

  def __init__(self, *args: Any, track_grad_norm: bool = False) -> None:
    super().__init__(*args)
    self.track_grad_norm = track_grad_norm

  def _inner_init(self, params: Any) -> Any:
    return self.inner.init(_model.trained(params))

  def back_off(
    self, grads: Any, state: Any, *, loss: Any = None
  ) -> tuple[jax.Array, LossScaleState]:
    check_state(state)
    # Nothing is checked: no overflow to back off from. The scale is 1, as after any update.
    return jnp.ones([], jnp.bool_), settled_scale(state)

  def _step(
    self, grads: Any, state: Any, params: Any, loss: Any, extra_args: dict, output: _Output
  ) -> tuple[Any, LossScaleState]:
    check_state(state)
    norm = state.grad_norm
    inv = restored_inverse(state)
    if self.track_grad_norm:  # of the unscaled gradients: 1/inv is 1, or a restored scale
      norm = self.lowering.check(grads, 1.0 / inv, self.axis_name).grad_norm
    # As in LossScaler._step: the inner optimizer sees None where the gradient is None (an
    # Equinox model's functions), as eqx.filter(model, eqx.is_array) hands them to optax,
    # and at integer arrays.
    _, inner_params, _ = _model.held_apart(grads, params)
    updates, inner_state = _model.inner_update(
      self.inner.update,
      _numerics.unscale(grads, inv),
      inner_params,
      state.inner_state,
      **extra_args,
    )
    return output.out(params, updates), passed(state, inv, norm, inner_state)


def restored_inverse(state: LossScaleState) -> jax.Array:
  """1/S for the scale S that ``state`` holds (1 where S is not valid): the factor that
  unscales the gradients (``_numerics.unscale``: in float32, or wider, cast back to each
  leaf's dtype). The gradients of a loss multiplied by a restored scale (a dynamic
  checkpoint restored into ``no_loss_scale`` by Orbax or flax directly) are brought back
  to the bare optimizer's on the first step, and the same values at the scale 1 this
  transformation keeps. The product fuses into the optimizer's own read of the gradients
  (a division would not, on XLA's CPU, which keeps the quotient in a buffer of the
  gradients' size)."""
  scale = state.loss_scale
  return 1.0 / jnp.where(_numerics.valid_scale(scale), scale, jnp.ones_like(scale))
