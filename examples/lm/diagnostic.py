"""Gradient-signal diagnostic: how much of the fp32 gradient survives fp16 backprop.

Micikevicius et al. (2018), *Mixed Precision Training*, Sec. 3.2: without
loss scaling, gradient values below the fp16 range (2**-24 ~ 6e-8) flush to
zero in the backward pass through fp16 activations; scaling the loss by S
before differentiation and the gradients by 1/S after lifts them back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from lm.model import loss_fn


def make_grad_fn(model):
  """Jitted ``(params, batch, scale) -> (param grads, logit grads)``, both unscaled, float32.

  The parameter gradient is that of ``loss * scale`` times ``1/scale`` (in
  float32, as the optimizer unscales). The logit gradient is
  ``d(loss * scale)/d logits`` in float32, before the backward pass casts it
  to the model's compute dtype (kept scaled, so that the cast can be checked).
  """

  def grads(params, batch, scale):
    g = jax.grad(lambda p: loss_fn(model, p, batch) * scale)(params)
    logits = model.apply({"params": params}, batch[:, :-1])
    ce = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, batch[:, 1:]).mean() * scale
    return jax.tree.map(lambda x: x * (1.0 / scale), g), jax.grad(ce)(logits)

  return jax.jit(grads)


def compare(grads, reference) -> dict[str, float]:
  """Compares a gradient pytree against the fp32 reference gradient.

  Returns:
    ``zeroed_fraction``: entries that are exactly 0 where the reference's are
    not, over the reference's nonzero entries; ``rel_error``: global L2 norm
    of (grads - reference) over the global L2 norm of the reference;
    ``finite``: every entry finite.
  """
  g = np.asarray(ravel_pytree(grads)[0], np.float64)
  r = np.asarray(ravel_pytree(reference)[0], np.float64)
  nonzero = r != 0
  with np.errstate(invalid="ignore", over="ignore"):
    rel = float(np.linalg.norm(g - r) / np.linalg.norm(r))
  return {
      "zeroed_fraction": float(np.sum((g == 0) & nonzero) / max(int(np.sum(nonzero)), 1)),
      "rel_error": rel,
      "finite": bool(np.all(np.isfinite(g))),
  }


def _flushed(logit_grads, dtype) -> float:
  """Share of nonzero float32 logit-gradient entries that become 0 when cast to ``dtype``."""
  g = np.asarray(logit_grads)
  nonzero = g != 0
  return float(np.sum((g.astype(dtype) == 0) & nonzero) / max(int(np.sum(nonzero)), 1))


def _fp16(grad_fn, params, batch, ref, scale, dtype):
  g, dlogits = grad_fn(params, batch, jnp.float32(scale))
  return {"loss_scale": float(scale), **compare(g, ref), "logit_grad_flushed": _flushed(dlogits, dtype)}


def gradient_signal(grad_fns, params, batch, scale: float, dtype=np.float16) -> dict:
  """One diagnostic point: fp16 without scaling and fp16 at loss scale ``scale`` vs fp32.

  When ``scale`` overflows on this batch (a non-finite gradient: a step the
  loss scaler would skip), ``fp16-dls`` also reports the first halved scale
  that does not, as dynamic loss scaling would back off; ``overflow_backoffs``
  counts the halvings (0 when ``scale`` itself is finite).

  Args:
    grad_fns: ``{"fp32": fn, "fp16": fn}`` from :func:`make_grad_fn`.
    params: float32 parameters (the fp32 run's at this point of training).
    batch: int32 ``[batch, time + 1]``, the same fixed batch at every point.
    scale: loss scale S of the loss-scaled run at this point (>= 1).
    dtype: the compute dtype of the ``fp16`` model (default float16).
  """
  ref = grad_fns["fp32"](params, batch, jnp.float32(1.0))[0]
  point = {"loss_scale": float(scale), "fp16": _fp16(grad_fns["fp16"], params, batch, ref, 1.0, dtype)}
  dls = at_scale = _fp16(grad_fns["fp16"], params, batch, ref, scale, dtype)
  backoffs = 0
  while not dls["finite"] and dls["loss_scale"] > 1:
    backoffs += 1
    dls = _fp16(grad_fns["fp16"], params, batch, ref, scale / 2**backoffs, dtype)
  point["fp16-dls"] = dls | {"overflow_backoffs": backoffs}
  if backoffs:
    point["fp16-dls-at-run-scale"] = at_scale
  return point
