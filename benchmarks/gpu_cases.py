"""The optimizer steps ``gpu_program.py`` compiles for a GPU: bare optimizers, optax_dls in
each lowering, path and feature, and the usual hand-written loss-scaling patterns.

A case builds ``(fn, structs, donate_argnums)`` from a tree of ``jax.ShapeDtypeStruct``s
(nothing is allocated). ``fn(grads, params, state)`` returns ``(params, state)``, so that
the donated parameters and state reuse their buffers in place. Each case names the bare
optimizer step it is measured against (its ``baseline``).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import optax_dls

DONATE = (1, 2)  # params and state; no output has the gradients' place


def lognormal_tree(params: float = 1e9, leaves: int = 256, seed: int = 0) -> dict:
  """``leaves`` float32 vectors holding about ``params`` entries in all, of lognormal sizes
  (``numpy.random.default_rng(seed).lognormal(0, 1.5, leaves)``, scaled, at least 1
  entry each)."""
  raw = np.random.default_rng(seed).lognormal(0.0, 1.5, leaves)
  sizes = np.maximum(1, (raw / raw.sum() * params).astype(np.int64))
  return {f"p{i:03d}": jax.ShapeDtypeStruct((int(n),), jnp.float32) for i, n in enumerate(sizes)}


def gpt2_small():
  """The main example's model (``examples/lm``) at GPT-2 small's size, fp16 compute over
  float32 parameters: width 768, 12 layers of 12 heads, 1,024 positions (a byte
  vocabulary), and the ``jax.ShapeDtypeStruct``s of its parameters."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
  from lm.model import Transformer
  from lm.precision import FP16

  model = Transformer(768, 12, 12, 1024, FP16)
  tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
  return model, jax.eval_shape(lambda t: model.init(jax.random.key(0), t)["params"], tokens)


def gpt2_small_tree(params: float = 0, leaves: int = 0) -> Any:
  """The float32 parameters of :func:`gpt2_small`'s model."""
  del params, leaves
  return gpt2_small()[1]


TREES = {"1b": lognormal_tree, "gpt2": gpt2_small_tree}


class Case(NamedTuple):
  build: Callable[[Any], tuple[Callable[..., Any], tuple, tuple[int, ...]]]
  baseline: str


def _bare(opt: Callable[[], optax.GradientTransformation]):
  def build(tree):
    tx = opt()

    def step(g, p, s):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    return step, (tree, tree, jax.eval_shape(tx.init, tree)), DONATE

  return build


def _wrapped(make: Callable[[], optax.GradientTransformation], loss: bool = False):
  """``make()`` (an optax_dls transformation) through ``tx.update`` + ``apply_updates``;
  ``loss``: the loss handed over as ``loss=``."""

  def build(tree):
    tx = make()
    extra = {"loss": jnp.float32(1.0)} if loss else {}

    def step(g, p, s):
      u, s = tx.update(g, s, p, **extra)
      return optax.apply_updates(p, u), s

    return step, (tree, tree, jax.eval_shape(tx.init, tree)), DONATE

  return build


def _unscaled(g, scale):
  inv = 1.0 / scale
  return jax.tree.map(lambda x: x * inv, g)


def _all_finite(tree):
  finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return functools.reduce(jnp.logical_and, finite)


def _select_at_end(tree):
  """jmp's and flax ``DynamicScale``'s pattern: unscale, ``all(isfinite)`` per leaf, Adam,
  ``jnp.where(finite, new, old)`` over the parameters and every state leaf."""
  adam = optax.adam(1e-3)

  def step(g, p, s):
    inner, scale = s
    u = _unscaled(g, scale)
    ok = _all_finite(u)
    updates, new_inner = adam.update(u, inner, p)
    keep = lambda new, old: jnp.where(ok, new, old)
    p = jax.tree.map(keep, optax.apply_updates(p, updates), p)
    inner = jax.tree.map(keep, new_inner, inner)
    return p, (inner, jnp.where(ok, scale, scale / 2))

  state = (jax.eval_shape(adam.init, tree), jax.ShapeDtypeStruct((), jnp.float32))
  return step, (tree, tree, state), DONATE


def _apply_if_finite(tree):
  """``optax.apply_if_finite(adam)`` on gradients unscaled by hand."""
  tx = optax.apply_if_finite(optax.adam(1e-3), max_consecutive_errors=5)

  def step(g, p, s):
    inner, scale = s
    u, inner = tx.update(_unscaled(g, scale), inner, p)
    return optax.apply_updates(p, u), (inner, scale)

  state = (jax.eval_shape(tx.init, tree), jax.ShapeDtypeStruct((), jnp.float32))
  return step, (tree, tree, state), DONATE


def _lax_cond(tree):
  """The check of ``_select_at_end`` and a ``lax.cond`` that runs unscale, Adam and
  ``apply_updates`` only when it passes."""
  adam = optax.adam(1e-3)

  def step(g, p, s):
    inner, scale = s
    ok = _all_finite(_unscaled(g, scale))

    def apply(g, inner, p):
      updates, inner = adam.update(_unscaled(g, scale), inner, p)
      return optax.apply_updates(p, updates), inner

    p, inner = lax.cond(ok, apply, lambda g, inner, p: (p, inner), g, inner, p)
    return p, (inner, jnp.where(ok, scale, scale / 2))

  state = (jax.eval_shape(adam.init, tree), jax.ShapeDtypeStruct((), jnp.float32))
  return step, (tree, tree, state), DONATE


adam = lambda: optax.adam(1e-3)
sgdm = lambda: optax.sgd(1e-2, momentum=0.9)
dls = optax_dls.dynamic_loss_scale
CASES = {
  "bare_adam": Case(_bare(adam), "bare_adam"),
  "bare_sgdm": Case(_bare(sgdm), "bare_sgdm"),
}
for _low in ("auto", "where", "cond"):
  _make = functools.partial(lambda low: dls(adam(), skip_lowering=low), _low)
  CASES[f"dls_{_low}_update"] = Case(_wrapped(_make), "bare_adam")
CASES["dls_sgdm_update"] = Case(_wrapped(lambda: dls(sgdm())), "bare_sgdm")
# Each feature that reads the gradients, on (off is dls_auto_update), and the other scalers.
FEATURES = {
  "static": lambda: optax_dls.static_loss_scale(adam(), 2.0**15),
  "no_loss_scale": lambda: optax_dls.no_loss_scale(adam()),
  "no_loss_scale_norm": lambda: optax_dls.no_loss_scale(adam(), track_grad_norm=True),
  "amax_policy": lambda: optax_dls.loss_scaled(adam(), optax_dls.amax_policy()),
  "underflow_stats": lambda: dls(optax.chain(optax_dls.underflow_stats(), adam())),
  "labels": lambda: dls(adam(), labels=lambda p: jax.tree.map(lambda _: "all", p)),
  "clip_by_global_norm": lambda: dls(optax.chain(optax.clip_by_global_norm(1.0), adam())),
}
for _name, _make in FEATURES.items():
  CASES[f"feature_{_name}"] = Case(_wrapped(_make), "bare_adam")
CASES["feature_loss"] = Case(_wrapped(lambda: dls(adam()), loss=True), "bare_adam")
CASES["bare_clip_adam"] = Case(
  _bare(lambda: optax.chain(optax.clip_by_global_norm(1.0), adam())), "bare_clip_adam"
)
CASES["feature_clip_by_global_norm"] = CASES["feature_clip_by_global_norm"]._replace(
  baseline="bare_clip_adam"
)
CASES["peer_select_at_end"] = Case(_select_at_end, "bare_adam")
CASES["peer_apply_if_finite"] = Case(_apply_if_finite, "bare_adam")
CASES["peer_lax_cond"] = Case(_lax_cond, "bare_adam")


def _train_step(make: Callable[[], optax.GradientTransformation], batch: int = 8):
  """The main example's whole train step at GPT-2 small's size (:func:`gpt2_small`; the
  tree is not used): forward and backward in fp16 of a ``[batch, 1024]`` token window, the
  gradients of ``scale_loss(loss)``, ``tx.update`` and ``optax.apply_updates``, the
  parameters and optimizer state donated. ``tx = make()`` wraps clipping and AdamW."""

  def build(tree):
    del tree
    model, params = gpt2_small()
    tx = make()
    tokens = jax.ShapeDtypeStruct((batch, 1025), jnp.int32)
    return train_step(model, tx), (params, jax.eval_shape(tx.init, params), tokens), (0, 1)

  return build


def train_step(model, tx: optax.GradientTransformation):
  """``step(params, opt_state, tokens) -> (params, opt_state, loss)``: the gradients of
  ``scale_loss(loss_fn(...))`` for ``model`` (of ``examples/lm``), ``tx.update`` and
  ``optax.apply_updates``."""
  from lm.model import loss_fn

  def step(params, opt_state, tokens):
    def scaled_loss(p):
      loss = loss_fn(model, p, tokens)
      return optax_dls.scale_loss(loss, opt_state), loss

    grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def clip_adamw() -> optax.GradientTransformation:
  """The main example's optimizer: clipping at norm 1, then AdamW."""
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))


CASES["train_no_loss_scale"] = Case(
  _train_step(lambda: optax_dls.no_loss_scale(clip_adamw())), "train_no_loss_scale"
)
CASES["train_dynamic_loss_scale"] = Case(
  _train_step(lambda: dls(clip_adamw())), "train_no_loss_scale"
)

GROUPS = {
  "all": [n for n in CASES if not n.startswith("train_")],
  "train_step": ["train_no_loss_scale", "train_dynamic_loss_scale"],
  "targets": [
    "bare_adam",
    "bare_sgdm",
    "dls_auto_update",
    "dls_cond_update",
    "dls_sgdm_update",
    "peer_select_at_end",
    "peer_lax_cond",
  ],
  "default": [
    "bare_adam",
    "bare_sgdm",
    "dls_auto_update",
    "dls_sgdm_update",
  ],
}
