"""docs/policies.md: the interface it prints, the signatures of its tables (every argument,
in order, with the default it gives), and the float32 fallback's restart rule."""

import ast
import inspect
import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import optax_dls
from optax_dls import _policies
from optax_dls._policies.base import GradStats

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "policies.md"


def test_the_printed_interface_has_the_real_fields_and_defaults():
  text = PAGE.read_text()
  block = re.search(r"class LossScalePolicy\(NamedTuple\):\n(.*?)\n\n", text, re.DOTALL).group(1)
  fields = re.findall(r"^  (\w+):", block, re.MULTILINE)
  assert tuple(fields) == optax_dls.LossScalePolicy._fields
  defaults = dict(re.findall(r"^  (\w+): [^=\n]+= ([^#\n]+?)\s*(?:#|$)", block, re.MULTILINE))
  assert {k: eval(v) for k, v in defaults.items()} == optax_dls.LossScalePolicy._field_defaults
  block = re.search(r"class GradStats\(NamedTuple\):\n(.*?)```", text, re.DOTALL).group(1)
  assert tuple(re.findall(r"^  (\w+):", block, re.MULTILINE)) == GradStats._fields


def _documented_calls():
  """``(name, [(argument, default or inspect.Parameter.empty)])`` of each call the tables
  of the page print with its arguments, such as ``preset("torch", init_scale=2**16, ...)``
  (named ``preset:torch``)."""
  calls = []
  for name, args in re.findall(r"^\| `(\w+)\(([^`]*=[^`]*)\)` \|", PAGE.read_text(), re.MULTILINE):
    call = ast.parse(f"f({args})", mode="eval").body
    if name == "preset":  # the first argument names the preset
      name = f"preset:{call.args.pop(0).value}"
    params = [(a.id, inspect.Parameter.empty) for a in call.args if isinstance(a, ast.Name)]
    params += [(k.arg, eval(compile(ast.Expression(k.value), "", "eval"))) for k in call.keywords]
    calls.append((name, params))
  return calls


def test_every_signature_the_tables_print_is_the_real_one():
  calls = dict(_documented_calls())
  presets = {f"preset:{n}" for n in ("torch", "keras", "jmp", "flax", "megatron", "deepspeed")}
  assert presets | {"fp32_fallback"} <= set(calls), sorted(calls)
  for name, params in calls.items():
    if name.startswith("preset:"):  # preset(name, **kwargs) passes kwargs on to this
      fn = optax_dls.config._FRAMEWORKS[name.removeprefix("preset:")]
    else:
      fn = getattr(optax_dls, name)
    real = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
    assert real == params, (name, real, params)


def _flags(kinds, after=2, steps=2):
  policy = optax_dls.fp32_fallback(
    optax_dls.dynamic_policy(init_scale=2.0**10), after=after, steps=steps
  )
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  params = {"w": jnp.ones(2)}
  state, update, flags = tx.init(params), jax.jit(tx.update), []
  for g in kinds:
    _, state = update({"w": jnp.full(2, g)}, state, params)
    flags.append(bool(optax_dls.metrics(state)["fp32_fallback"]))
  return flags


@pytest.mark.parametrize(
  "kinds, expected",
  [
    # Clean float32 steps: float16 gets `after` fresh tries before the next fallback.
    ([jnp.inf, jnp.inf, 1.0, 1.0, jnp.inf, jnp.inf], [False, True, True, False, False, True]),
    # Skipped float32 steps (bad data): the next skip starts the fallback again at once.
    ([jnp.inf, jnp.inf, jnp.inf, jnp.inf, jnp.inf], [False, True, True, False, True]),
  ],
  ids=["clean", "bad-data"],
)
def test_the_fallback_starts_again_at_once_only_after_skipped_float32_steps(kinds, expected):
  assert _flags(kinds) == expected


def _halving_policy():
  """A user's policy: halve on overflow, never grow; range [1, 2**4]."""

  def init():
    return jnp.float32(4.0), jnp.zeros([], jnp.int32)

  def update(scale, n, stats):
    return jnp.where(stats.finite, scale, scale / 2).astype(jnp.float32), n + 1

  return optax_dls.LossScalePolicy(init, update, min_scale=1.0, max_scale=2.0**4)


def test_the_policy_wrappers_work_around_a_user_s_policy():
  """custom_policy.md: fp32_fallback, and its count of skips at the minimum scale, work
  around your policy as around the built-in ones; the scale is kept within the policy's
  range."""
  policy = optax_dls.fp32_fallback(_halving_policy(), after=2)
  tx = optax_dls.loss_scaled(optax.sgd(0.1), policy)
  params = {"w": jnp.ones(2)}
  state, update, seen = tx.init(params), jax.jit(tx.update), []
  for _ in range(5):
    _, state = update({"w": jnp.full(2, jnp.inf)}, state, params)
    m = optax_dls.metrics(state)
    seen.append((float(m["loss_scale"]), bool(m["fp32_fallback"]), int(m["skips_at_min_scale"])))
  # 4 -> 2 -> 1, then held at min_scale = 1: skips at the floor counted from the third skip.
  assert seen == [(2.0, False, 0), (1.0, True, 0), (1.0, True, 1), (1.0, True, 2), (1.0, True, 3)]


def test_each_policy_s_state_is_the_one_the_tables_name():
  """The "state" column of the policy and wrapper tables: the state's type and fields."""
  said = re.findall(r"\| `(\w+State)`(?: \(([^)]*)\))? \|$", PAGE.read_text(), re.MULTILINE)
  said = {name: tuple(re.findall(r"`(\w+)`", fields)) for name, fields in said}
  built = [
    optax_dls.dynamic_policy(),
    optax_dls.amax_policy(),
    optax_dls.config.preset("torch"),
    optax_dls.config.preset("deepspeed"),
    _policies.static_policy(4.0),  # static_loss_scale's
    _policies.noop_policy(),  # no_loss_scale's
    optax_dls.fp32_fallback(optax_dls.dynamic_policy()),
  ]
  seen = set()
  for policy in built:
    state = policy.init()[1]
    name = type(state).__name__
    assert name in said, name
    assert said[name] in ((), state._fields), (name, said[name], state._fields)
    seen.add(name)
  assert seen == set(said)


@pytest.mark.parametrize("returned, kept", [(jnp.nan, 4.0), (-3.0, 1.0), (jnp.inf, 16.0)])
def test_whatever_a_policy_returns_the_scale_stays_in_its_range(returned, kept):
  """LossScalePolicy: "Whatever it returns, the scale is kept within [min_scale,
  max_scale]": a NaN restarts at the initial scale, the rest is clipped."""
  policy = optax_dls.LossScalePolicy(
    lambda: (jnp.float32(4.0), ()),
    lambda s, st, g: (jnp.where(g.finite, s, jnp.float32(returned)), st),
    min_scale=1.0,
    max_scale=16.0,
  )
  tx = optax_dls.loss_scaled(optax.sgd(1.0), policy)
  _, state = tx.update({"w": jnp.array([jnp.inf])}, tx.init({"w": jnp.ones(1)}))
  assert float(state.loss_scale) == kept
