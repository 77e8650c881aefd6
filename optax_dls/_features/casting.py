"""Casting policies in jmp's classes and string forms, and :func:`full_precision`, which runs one
function in float32 inside a half-precision model."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# jmp's names, in jmp's order: the first is the one ``str(policy)`` writes.
_NAMES: dict[Any, tuple[str, ...]] = {
  jnp.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
  jnp.dtype(jnp.float16): ("f16", "float16"),
  jnp.dtype(jnp.float32): ("full", "f32", "float32"),
  jnp.dtype(jnp.float64): ("f64", "float64"),
}
_DTYPES = {name: dtype for dtype, names in _NAMES.items() for name in names}
_KEYS = {"p": "param", "params": "param", "c": "compute", "compute": "compute"}
_KEYS |= {"o": "output", "output": "output"}
_FORMS = (
  "a dtype name for all three (e.g. 'f16', 'half'), or comma-separated key=dtype pairs "
  "with keys params/p, compute/c, output/o (e.g. 'params=float32,compute=float16,"
  "output=float32' or 'p=f32,c=f16'); dtype names: " + ", ".join(sorted([*_DTYPES, "half"]))
)


def half_dtype() -> Any:
  """The default backend's half dtype, as jmp's: ``bfloat16`` on TPU, else ``float16``."""
  return jnp.dtype(jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16)


def _is_floating_array(x: Any) -> bool:
  return isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating)


def cast_floating(tree: Any, dtype: Any) -> Any:
  """``tree`` with its floating JAX and NumPy arrays cast to ``dtype``, as jmp casts."""
  cast = lambda x: x.astype(dtype) if _is_floating_array(x) else x
  return jax.tree_util.tree_map(cast, tree)


def _floating_dtype(name: str, value: Any) -> Any:
  """``value``, a dtype or jmp name (NumPy reads 'f16' as float128), as a floating dtype."""
  if isinstance(value, str) and (value in _DTYPES or value == "half"):
    return half_dtype() if value == "half" else _DTYPES[value]
  if value is None:
    raise TypeError(f"{name} must be a dtype or one of jmp's dtype names, got None.")
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{name} must be a dtype, got {value!r}.") from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{name} must be a floating dtype, got {name}={dtype.name}.")
  if dtype.itemsize > 8:  # NumPy's float128: no JAX array holds it
    raise ValueError(
      f"{name} must be a floating dtype JAX computes in (float16, bfloat16, float32, float64, "
      f"the float8 types), got {name}={dtype.name}."
    )
  return dtype


@dataclasses.dataclass(frozen=True, init=False)
class CastPolicy:
  """The parameter, compute and output dtypes of a mixed-precision model.

  What :func:`~optax_dls.cast_policy` returns, with jmp's ``Policy`` methods and ``str`` form.
  Each cast changes only a pytree's floating JAX and NumPy arrays. Frozen and hashable (a static
  argument of ``jax.jit``).

  Args:
    param_dtype: the dtype the parameters (master weights) are kept in. Default float32.
    compute_dtype: the dtype the forward and backward passes run in. Default ``param_dtype``.
    output_dtype: the dtype of the model's outputs. Default ``compute_dtype``.

  Raises:
    TypeError: a dtype argument is not a dtype.
    ValueError: a dtype argument is not floating (e.g. int32).

  Example:
    >>> import jax.numpy as jnp, optax_dls
    >>> policy = optax_dls.cast_policy("p=f32,c=f16,o=f32")
    >>> tree = {'w': jnp.ones(2), 'step': jnp.array(3), 'act': jnp.tanh}
    >>> out = policy.cast_to_compute(tree)
    >>> out['w'].dtype, out['step'].dtype, out['act'] is jnp.tanh
    (dtype('float16'), dtype('int32'), True)
    >>> str(policy)
    'p=full,c=f16,o=full'
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __init__(
    self, param_dtype: Any = jnp.float32, compute_dtype: Any = None, output_dtype: Any = None
  ) -> None:
    param = _floating_dtype("param_dtype", param_dtype)
    compute = param if compute_dtype is None else _floating_dtype("compute_dtype", compute_dtype)
    output = compute if output_dtype is None else _floating_dtype("output_dtype", output_dtype)
    object.__setattr__(self, "param_dtype", param)
    object.__setattr__(self, "compute_dtype", compute)
    object.__setattr__(self, "output_dtype", output)

  def cast_to_param(self, tree: Any) -> Any:
    """``tree`` with its floating arrays cast to ``param_dtype`` (e.g. the gradients)."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    """``tree`` with its floating arrays cast to ``compute_dtype`` (parameters, inputs)."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    """``tree`` with its floating arrays cast to ``output_dtype`` (the model's outputs)."""
    return cast_floating(tree, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> CastPolicy:
    """The same policy with ``output_dtype`` replaced."""
    return CastPolicy(self.param_dtype, self.compute_dtype, output_dtype)

  def __str__(self) -> str:
    name = lambda dtype: _NAMES[dtype][0] if dtype in _NAMES else dtype.name
    return f"p={name(self.param_dtype)},c={name(self.compute_dtype)},o={name(self.output_dtype)}"


def _parse_dtype(policy_name: str, value: str) -> Any:
  if value != "half" and value not in _DTYPES:
    raise ValueError(f"Unknown dtype {value!r} in cast policy {policy_name!r}; expected {_FORMS}.")
  return _floating_dtype("", value)


def cast_policy(policy_name: str) -> CastPolicy:
  """A :class:`~optax_dls._features.casting.CastPolicy` from jmp's string form.

  Args:
    policy_name: one dtype name for all three, or comma-separated ``key=dtype`` pairs (keys
      ``params``/``p``, ``compute``/``c``, ``output``/``o``; a repeated key takes its last value),
      e.g. ``"p=f32,c=f16,o=f32"``. As in jmp, params default to float32, compute to params,
      output to compute. Dtype names: ``bf16``, ``f16``, ``full``/``f32``, ``f64``, the long
      names, and ``half`` (bfloat16 on TPU, float16 elsewhere).

  Returns:
    The policy; ``str`` of it gives jmp's form back.

  Raises:
    TypeError: ``policy_name`` is not a string.
    ValueError: an unknown key or dtype name, or a part that is not ``key=dtype``; the message names
      the string and the accepted forms.

  Example:
    >>> import optax_dls
    >>> policy = optax_dls.cast_policy("params=float32,compute=float16,output=float32")
    >>> policy.param_dtype, policy.compute_dtype, policy.output_dtype
    (dtype('float32'), dtype('float16'), dtype('float32'))
    >>> str(optax_dls.cast_policy("c=bf16"))
    'p=full,c=bf16,o=bf16'
  """
  if not isinstance(policy_name, str):
    raise TypeError(f"policy_name must be a string, got {policy_name!r}; expected {_FORMS}.")
  if "=" not in policy_name:
    return CastPolicy(*[_parse_dtype(policy_name, policy_name)] * 3)
  dtypes: dict[str, Any] = {"param": jnp.float32, "compute": None, "output": None}
  for part in policy_name.split(","):
    key, sep, value = part.partition("=")
    if not sep or "=" in value:
      raise ValueError(
        f"Part {part!r} of cast policy {policy_name!r} is not key=dtype; expected {_FORMS}."
      )
    if key not in _KEYS:
      raise ValueError(f"Unknown key {key!r} in cast policy {policy_name!r}; expected {_FORMS}.")
    dtypes[_KEYS[key]] = _parse_dtype(policy_name, value)
  return CastPolicy(dtypes["param"], dtypes["compute"], dtypes["output"])


def full_precision(fn: Callable[..., Any] | None = None, *, output_dtype: Any = None) -> Any:
  """Runs ``fn`` in float32 inside a half-precision model: softmax, normalisation, the loss.

  Casts the floating array arguments to float32 and the output's back; ``jax.grad`` goes through.
  Use it as ``@full_precision``, ``@full_precision(output_dtype=...)`` or ``full_precision(fn)``.

  Args:
    fn: the function; any pytrees in and out. Omitted, a decorator is returned.
    output_dtype: the dtype of the output's floating arrays. Default ``None``: the arguments'
      promoted floating dtype, or float32 if they have none. Around the loss pass ``jnp.float32``
      (a float16 loss makes :func:`scale_loss` warn).

  Returns:
    The wrapped function (``functools.wraps`` of ``fn``), or a decorator.

  Raises:
    TypeError: ``fn`` is not callable, or ``output_dtype`` is not a dtype.
    ValueError: ``output_dtype`` is not floating.

  Example:
    >>> import jax, jax.numpy as jnp, optax_dls
    >>> x = jnp.full(4, 300.0, jnp.float16)
    >>> jnp.mean(x * x)  # 90000 overflows float16
    Array(inf, dtype=float16)
    >>> optax_dls.full_precision(lambda x: jnp.sqrt(jnp.mean(x * x)))(x)
    Array(300., dtype=float16)
  """
  if output_dtype is not None:
    output_dtype = _floating_dtype("output_dtype", output_dtype)
  if fn is None:
    return functools.partial(full_precision, output_dtype=output_dtype)
  if not callable(fn):
    raise TypeError(f"fn must be callable, got {fn!r} of type {type(fn).__name__}.")

  @functools.wraps(fn)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    floating = [x.dtype for x in jax.tree.leaves((args, kwargs)) if _is_floating_array(x)]
    target = output_dtype
    if target is None and floating:
      target = jnp.result_type(*floating)
    out = fn(*cast_floating(args, jnp.float32), **cast_floating(kwargs, jnp.float32))
    return out if target is None else cast_floating(out, target)

  return wrapped
