"""Names are never silently wrong: the params tree is checked against the state, names are
unique for every tree, and a stacked (vmapped) state is named one member at a time."""

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_dls
from optax_dls._access.names import leaf_names

INF = jnp.inf


def _overflowed(params, bad):
  """The state after one step whose gradient leaves named in ``bad`` hold an inf."""
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  grads = {k: jnp.full_like(v, INF) if k in bad else jnp.ones_like(v) for k, v in params.items()}
  _, state = tx.update(grads, tx.init(params), params)
  return tx, state


def test_a_params_tree_of_another_leaf_count_is_refused_not_misnamed():
  params = {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(2)}
  _, state = _overflowed(params, {"c"})
  assert optax_dls.nonfinite_leaves(state, params) == {"c": "inf"}
  for other in (
    {"a": jnp.ones(2), "b": jnp.ones(2)},  # a leaf fewer
    {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(2), "d": jnp.ones(2)},  # one more
  ):
    with pytest.raises(ValueError, match="params is not the tree the state was built for"):
      optax_dls.nonfinite_leaves(state, other)
  with pytest.raises(ValueError, match="not the tree the state was built for"):
    optax_dls.nonfinite_leaves(state, ["a", "b"])
  assert optax_dls.nonfinite_leaves(state, leaf_names(params)) == {"c": "inf"}


def test_a_slash_inside_a_key_does_not_merge_two_leaves():
  params = {"a/b": jnp.ones(2), "a": {"b": jnp.ones(3)}}
  names = leaf_names(params)
  assert len(set(names)) == 2 and "a/b" in names and "a\\/b" in names
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  grads = {"a/b": jnp.full(2, INF), "a": {"b": jnp.full(3, jnp.nan)}}
  _, state = tx.update(grads, tx.init(params), params)
  assert optax_dls.nonfinite_leaves(state, params) == {"a/b": "nan", "a\\/b": "inf"}


def test_names_that_would_repeat_are_made_unique():
  from optax_dls._core import record as _localisation

  assert _localisation.unique(["x", "y", "x", "x"]) == ["x", "y", "x#2", "x#3"]


def test_a_stacked_state_is_named_one_member_at_a_time():
  tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
  members = {"w": jnp.ones((3, 2)), "v": jnp.ones((3, 2))}
  state = jax.vmap(tx.init)(members)
  grads = {"w": jnp.ones((3, 2)).at[1].set(INF), "v": jnp.ones((3, 2))}
  _, state = jax.vmap(tx.update)(grads, state, members)
  with pytest.raises(ValueError, match=r"opt_state is stacked.*x\[i\].*member i of 3"):
    optax_dls.nonfinite_leaves(state, members)
  one = {"w": jnp.ones(2), "v": jnp.ones(2)}
  member = lambda i: jax.tree.map(lambda x: x[i], state)
  named = [optax_dls.nonfinite_leaves(member(i), one) for i in range(3)]
  assert named == [{}, {"w": "inf"}, {}]
  with pytest.raises(ValueError, match="opt_state is stacked"):
    optax_dls.nonfinite_leaves(optax_dls.metrics(state), one)


def test_metrics_and_the_writer_refuse_another_tree_too(tmp_path):
  from optax_dls import writers

  params = {"enc": jnp.ones(2), "dec": jnp.ones(2)}
  _, state = _overflowed(params, {"enc"})
  # A logged row is checked as far as its bits allow: leaf 1 (enc) is recorded.
  other = {"alpha": jnp.ones(2)}
  m = optax_dls.metrics(state)
  assert optax_dls.nonfinite_leaves(m, params) == {"enc": "inf"}
  with pytest.raises(ValueError, match="do not fit the record"):
    optax_dls.nonfinite_leaves(m, other)
  with writers.MetricsWriter(tmp_path / "ok", params=params, tensorboard=False) as w:
    w.log(0, m)
  row = (tmp_path / "ok" / writers.JSONL_NAME).read_text()
  assert '"nonfinite_leaves": {"enc": "inf"}' in row and "nonfinite_names_digest" not in row
  bad = writers.MetricsWriter(tmp_path / "bad", params=other, tensorboard=False)
  with bad, pytest.raises(ValueError, match="not the tree the state was built for|do not fit"):
    bad.log(0, m)


def test_flax_linen_boxed_parameters_are_named_as_their_unboxed_arrays():
  """``nn.with_logical_partitioning`` boxes (as sharded linen trainers init their state):
  no ``/value`` in the names, so the state built on the boxed tree names the leaves of the
  unboxed one the step trains."""
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
      return nn.Dense(2, kernel_init=init)(x)

  boxed = Model().init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  params = nn.unbox(boxed)
  assert (
    leaf_names(boxed)
    == leaf_names(params)
    == [
      "Dense_0/bias",
      "Dense_0/kernel",
    ]
  )
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  state = nn.unbox(tx.init(boxed))
  grads = {"Dense_0": {"bias": jnp.zeros(2), "kernel": jnp.full((3, 2), jnp.inf)}}
  _, state = tx.update(grads, state, params)
  assert optax_dls.nonfinite_leaves(state, params) == {"Dense_0/kernel": "inf"}


@pytest.mark.parametrize("lowering", ["auto", "where", "cond"])
def test_a_frozen_parameter_with_a_none_gradient_keeps_the_names_and_labels_in_place(lowering):
  params = {"backbone": jnp.ones(2), "head": jnp.ones(2), "lora": jnp.ones(2)}
  part = {"backbone": "frozen", "head": "train", "lora": "train"}
  inner = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, part)
  labels = {"backbone": "bb", "head": "head", "lora": "lora"}
  grads = {"backbone": None, "head": jnp.ones(2), "lora": jnp.array([1.0, jnp.inf])}
  for tx in (
    optax_dls.dynamic_loss_scale(inner, skip_lowering=lowering),
    optax_dls.dynamic_loss_scale(inner, skip_lowering=lowering, labels=labels),
  ):
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert optax_dls.nonfinite_leaves(state, params) == {"lora": "inf"}
  m = optax_dls.metrics(state)
  assert (int(m["overflows/bb"]), int(m["overflows/head"]), int(m["overflows/lora"])) == (0, 0, 1)
