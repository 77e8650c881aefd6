"""docs/guide/locate.md: ``argnums`` and ``has_aux`` as in ``jax.grad``; ``custom_jvp`` and
``custom_vjp`` are entered, a ``while`` is the place; the guide's backward example
overflows at ``2**10`` and not below."""

import jax
import jax.numpy as jnp
import pytest

import optax_dls

F16 = jnp.float16


def test_argnums_picks_the_differentiated_argument_and_has_aux_is_taken():
  def loss(x, w):  # the parameters second
    with jax.named_scope("layer"):
      h = x @ w
    return jnp.sum(h.astype(jnp.float32)), {"aux": h}

  x, w = jnp.ones((2, 4), F16), jnp.full((4, 4), 1.0, F16)
  report = optax_dls.locate(loss, x, w, scale=2.0**15, argnums=1, has_aux=True)
  # The cotangent of w is x^T (S * 1): 2 * 2**15 = 65536 overflows float16 in the backward pass.
  assert (report.first.phase, report.first.scope) == ("backward", "layer")
  assert optax_dls.locate(loss, x, w, scale=2.0**14, argnums=1, has_aux=True).first is None


def _custom_jvp_layer():
  @jax.custom_jvp
  def layer(w, x):
    with jax.named_scope("custom"):
      return x @ w

  layer.defjvp(lambda primals, tangents: (layer(*primals), layer(primals[0], tangents[1])))
  return layer


def _custom_vjp_layer():
  @jax.custom_vjp
  def layer(w, x):
    with jax.named_scope("custom"):
      return x @ w

  def fwd(w, x):
    return layer(w, x), (w, x)

  def bwd(res, g):
    w, x = res
    return (x.T @ g, g @ w.T)

  layer.defvjp(fwd, bwd)
  return layer


def test_custom_jvp_and_custom_vjp_are_entered():
  for layer in (_custom_jvp_layer(), _custom_vjp_layer()):

    def loss(w, x, layer=layer):
      return jnp.sum(layer(w, x).astype(jnp.float32))

    first = optax_dls.locate(loss, jnp.full((4, 4), 2.0e4, F16), jnp.ones((2, 4), F16)).first
    assert (first.phase, first.primitive, first.scope) == ("forward", "dot_general", "custom")


def test_a_while_loop_is_reported_as_the_place_with_a_note():
  def loss(w, x):  # the loop runs on the input, which is not differentiated
    h = jax.lax.fori_loop(0, jnp.int32(4), lambda _, h: h * x, jnp.ones(2, F16))
    return jnp.sum((h * w).astype(jnp.float32))

  first = optax_dls.locate(loss, jnp.ones(2, F16), jnp.full(2, 100.0, F16), scale=1.0).first
  assert first.primitive == "while" and "while" in first.note and first.phase == "forward"


def test_the_guide_s_backward_example_overflows_at_2_to_the_10_and_not_below():
  params = {"embed": jnp.full((8, 8), 0.01, F16), "proj": jnp.full((8, 8), 8.0, F16)}
  x = jnp.full((4, 8), 0.1, F16)

  def sum_loss(params, x):
    with jax.named_scope("embed"):
      h = x @ params["embed"]
    with jax.named_scope("proj"):
      h = h @ params["proj"]
    return jnp.sum(h.astype(jnp.float32))

  assert optax_dls.locate(sum_loss, params, x, scale=2.0**9).first is None
  first = optax_dls.locate(sum_loss, params, x, scale=2.0**10).first
  assert (first.phase, first.scope) == ("backward", "proj")
  rows = optax_dls.locate(sum_loss, params, x, scale=2.0**8).headroom
  assert rows[1].scope == "embed" and round(rows[1].backward_fraction, 2) == 0.10


def test_headroom_gives_the_share_of_a_scope_s_entries_below_the_smallest_normal():
  def loss(w, x):
    with jax.named_scope("tiny"):
      h = x * w  # [2**-10, 2**-10, 2**-16, 2**-16]: two of four below 2**-14
    return jnp.sum(h.astype(jnp.float32))

  w = jnp.full(4, 2.0**-10, F16)
  x = jnp.array([1.0, 1.0, 2.0**-6, 2.0**-6], F16)
  (row,) = [r for r in optax_dls.locate(loss, w, x, scale=1.0).headroom if r.scope == "tiny"]
  # Two subnormal entries (the forward output's) among the scope's eight values, the
  # others (the backward pass's, 1 and 2**-6) normal.
  assert row.underflow_share == 0.25


@pytest.mark.parametrize(
  ("fun", "has_aux", "match"),
  [
    (lambda p: jnp.int32(1), False, "real floating-point loss"),
    (lambda p: jnp.sum(p["w"]) > 0, False, "real floating-point loss"),
    (lambda p: jnp.sum(p["w"]).astype(jnp.complex64), False, "real floating-point loss"),
    (lambda p: jnp.sum(p["w"]), True, r"must return a \(loss, aux\) pair"),
    (lambda p: (jnp.sum(p["w"]), 1, 2), True, r"must return a \(loss, aux\) pair"),
    (lambda p: {"loss": jnp.sum(p["w"])}, False, "scalar loss, got a dict"),
  ],
)
def test_locate_refuses_a_loss_jax_grad_would_refuse(fun, has_aux, match):
  with pytest.raises(TypeError, match=match):
    optax_dls.locate(fun, {"w": jnp.ones(2)}, has_aux=has_aux, scale=1.0)
