"""The program a GPU or TPU would run, checked without one.

A jitted step of each call path under the default lowering (``"auto"``) is exported with
``jax.export`` for CUDA, ROCm and TPU: the module holds no host callback or transfer.
``"auto"`` chooses per platform with ``lax.platform_dependent``, a ``cond`` whose branch
the lowering platform picks (XLA folds the other away); taking the branch each platform
gets, the program holds no data-dependent conditional or loop there, while on the CPU it
holds the check's ``cond`` (so the walk below does find one where there is one).
"""

import collections
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from _compat import apply_step
from jax import export

import optax_dls

PARAMS = {"w": jnp.ones((64, 32), jnp.float32), "b": jnp.ones((32,), jnp.float16)}
HOST = ("callback", "stablehlo.send", "stablehlo.recv", "infeed", "outfeed")
WAITS = ("cond", "while")  # a conditional or loop whose predicate the device must compute
CALLBACKS = ("pure_callback", "io_callback", "debug_callback", "callback")


def _step(tx, path):
  def update_path(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def apply_step_path(params, state, grads):
    return apply_step(tx, grads, state, params)

  return {"update": update_path, "apply_step": apply_step_path}[path]


def _subjaxprs(eqn):
  for v in eqn.params.values():
    for x in v if isinstance(v, (tuple, list)) else (v,):
      if isinstance(x, jax.extend.core.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jax.extend.core.Jaxpr):
        yield x


def _taken(jaxpr, platform):
  """The primitives the program runs when lowered for ``platform``: a ``cond`` on the
  index of ``lax.platform_dependent`` (a ``platform_index`` equation) contributes only the
  branch of that platform."""
  names, chosen = [], {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "platform_index":
      platforms = eqn.params["platforms"]
      chosen[eqn.outvars[0]] = next(
        (i for i, p in enumerate(platforms) if p is not None and platform in p),
        platforms.index(None),
      )
      continue
    index = eqn.invars[0] if eqn.invars else None
    if eqn.primitive.name == "cond" and not hasattr(index, "val") and index in chosen:
      names += _taken(eqn.params["branches"][chosen[index]].jaxpr, platform)
      continue
    names.append(eqn.primitive.name)
    for sub in _subjaxprs(eqn):
      names += _taken(sub, platform)
  return names


def _program(tx, path):
  return jax.make_jaxpr(_step(tx, path))(PARAMS, tx.init(PARAMS), PARAMS).jaxpr


@pytest.mark.parametrize("platform", ["cuda", "rocm", "tpu"])
@pytest.mark.parametrize("path", ["update", "apply_step"])
def test_auto_takes_the_selection_with_no_conditional_and_no_host_transfer(path, platform):
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  taken = _taken(_program(tx, path), platform)
  assert [n for n in taken if n in WAITS or n in CALLBACKS] == []
  assert "select_n" in taken  # the skip selects
  # What it takes there is the "where" lowering's program.
  where = optax_dls.dynamic_loss_scale(optax.adam(1e-3), skip_lowering="where")
  same = lambda names: sorted(set(names) - {"platform_index"})
  assert same(taken) == same(_taken(_program(where, path), platform))
  step = jax.jit(_step(tx, path), donate_argnums=(0, 1))
  module = export.export(step, platforms=(platform,))(PARAMS, tx.init(PARAMS), PARAMS)
  text = module.mlir_module()
  assert [n for n in HOST if re.search(rf"\b{re.escape(n)}\b", text)] == []


@pytest.mark.parametrize("path", ["update", "apply_step"])
def test_on_the_cpu_auto_takes_the_conditional_check(path):
  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-3))
  assert "cond" in _taken(_program(tx, path), "cpu")
  forced = optax_dls.dynamic_loss_scale(optax.adam(1e-3), skip_lowering="cond")
  assert "cond" in _taken(_program(forced, path), "cuda")  # forced: there too


def test_no_loss_scale_runs_the_bare_step_everywhere():
  tx = optax_dls.no_loss_scale(optax.adam(1e-3))
  bare = optax.adam(1e-3)

  def bare_step(params, state, grads):
    updates, state = bare.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  want = _taken(jax.make_jaxpr(bare_step)(PARAMS, bare.init(PARAMS), PARAMS).jaxpr, "cuda")
  got = _taken(_program(tx, "update"), "cuda")
  assert [n for n in got if n in WAITS or n in CALLBACKS] == []
  # Beyond the bare step: the counters' scalar bookkeeping and the product of each gradient
  # by 1/S (fused into the optimizer's read of it), no reduction of a gradient.
  extra = collections.Counter(got) - collections.Counter(want)
  assert not [n for n in extra if n.startswith("reduce") or n == "sqrt"], extra
  assert extra["mul"] <= len(jax.tree.leaves(PARAMS)) and extra["div"] <= 2, extra  # 1/S: scalars
