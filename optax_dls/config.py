"""Presets and configuration: loss scaling from a dict or a YAML file.

A configuration is a mapping, its ``loss_scale`` section, or a YAML file holding one::

    loss_scale:
      preset: text_llm        # optional: start from a preset
      init_scale: 4096        # any dynamic_loss_scale argument overrides it
      growth_interval: 100
      warmup_steps: 50
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import optax

from optax_dls import _policies
from optax_dls._core import accumulation as _accumulation
from optax_dls._core import transform as _transform
from optax_dls._features import underflow as _underflow
from optax_dls._policies import presets as _presets
from optax_dls._util import optional as _optional

__all__ = ["from_config", "preset"]

_POLICY_KEYS = frozenset(inspect.signature(_policies.dynamic_policy).parameters)
_TX_KEYS = frozenset({"axis_name", "skip_lowering", "underflow_stats"})
_FALLBACK_KEYS = frozenset({"fallback_after", "fallback_steps", "fallback_scale"})
_WRAPPER_KEYS = _TX_KEYS | _FALLBACK_KEYS
_HOST_KEYS = frozenset({"alerts", "alert_after"})
_KINDS = ("dynamic", "static", "none")
_NOT_NUMBERS = _TX_KEYS | {"consecutive_hysteresis"}
_NUMBER_KEYS = (_POLICY_KEYS | _WRAPPER_KEYS | {"scale"}) - _NOT_NUMBERS
_ALL_KEYS = _POLICY_KEYS | _WRAPPER_KEYS | {"kind", "preset", "scale"}
_WHOLE_KEYS = frozenset(
  {"growth_interval", "hysteresis", "warmup_steps", "fallback_after", "fallback_steps"}
)

# The presets for a kind of training (why each value: docs/observability.md).
_PRESETS: dict[str, dict[str, Any]] = {
  "text_llm": dict(init_scale=2.0**16, growth_interval=1000, hysteresis=2),
  "multimodal": dict(init_scale=2.0**13, growth_interval=1000, warmup_steps=1000, hysteresis=2),
  "preference": dict(init_scale=2.0**15, max_scale=2.0**16, growth_interval=1000, hysteresis=2),
  "qlora": dict(init_scale=2.0**16, growth_interval=1000, max_scale=2.0**24),
}
_ALIASES = {"dpo": "preference", "alignment": "preference", "llm": "text_llm", "lora": "qlora"}
_FRAMEWORKS = _presets.FRAMEWORKS


def _known(name: Any) -> str:
  """``name`` with its alias resolved; ValueError listing the known names otherwise."""
  if isinstance(name, str) and name in _FRAMEWORKS:
    return name
  if not isinstance(name, str) or _ALIASES.get(name, name) not in _PRESETS:
    raise ValueError(
      f"unknown loss-scale preset {name!r}; known presets: {sorted(_FRAMEWORKS)} (other "
      f"frameworks' trajectories), {sorted(_PRESETS)} (kinds of training; aliases "
      f"{sorted(_ALIASES)})."
    )
  return _ALIASES.get(name, name)


def _arguments(name: str) -> frozenset[str]:
  """The keyword arguments the preset ``name`` (already resolved) takes."""
  if name in _FRAMEWORKS:
    return frozenset(inspect.signature(_FRAMEWORKS[name]).parameters)
  return _POLICY_KEYS


def preset(name: str, **kwargs: Any) -> _policies.LossScalePolicy:
  """The loss-scale policy of a named preset, ``kwargs`` overriding its settings.

  **Another framework's scale trajectory**, bit for bit for the same finite / non-finite steps
  while the reference stays in ``[2**-126, 2**126]``; ``kwargs`` take its names and defaults:

  * ``"torch"``: ``torch.amp.GradScaler``: ``init_scale=2**16``, ``growth_factor=2``,
    ``backoff_factor=0.5``, ``growth_interval=2000``.
  * ``"keras"``: Keras 3 ``LossScaleOptimizer``: ``initial_scale=2**15``,
    ``dynamic_growth_steps=2000``; factor 2.
  * ``"jmp"``: ``jmp.DynamicLossScale``: ``loss_scale`` (required, as in jmp), ``period=2000``,
    ``factor=2``, ``min_loss_scale=1``.
  * ``"flax"``: ``DynamicScale``: ``growth_factor=2``, ``backoff_factor=0.5``,
    ``growth_interval=2000``, ``scale=2**16``, ``minimum_scale=2**-126`` (None in flax);
    grows on the ``growth_interval + 1``-th consecutive finite step.
  * ``"megatron"``: ``DynamicGradScaler``: ``initial_scale=2**32``, ``min_scale=1``,
    ``growth_factor=2``, ``backoff_factor=0.5``, ``growth_interval=1000``, ``hysteresis=2``;
    only a growth refills the hysteresis.
  * ``"deepspeed"``: ``DynamicLossScaler`` (0.19): ``init_scale=2**16``, ``scale_window=1000``,
    ``min_scale=1``, ``delayed_shift=2``, ``consecutive_hysteresis=False``; first growth on
    the ``scale_window + 1``-th step.

  **A kind of training**: :func:`~optax_dls.dynamic_policy` of ``growth_interval=1000``, these
  values and ``kwargs``:

  * ``"text_llm"`` (alias ``"llm"``): ``init_scale=2**16``, ``hysteresis=2``.
  * ``"multimodal"``: ``init_scale=2**13``, ``warmup_steps=1000``, ``hysteresis=2``.
  * ``"preference"`` (``"dpo"``, ``"alignment"``): ``init_scale=2**15``, ``max_scale=2**16``,
    ``hysteresis=2``: capped, as gradients jump when the margin flips.
  * ``"qlora"`` (``"lora"``): ``init_scale=2**16``, ``max_scale=2**24``.

  Args:
    name: str, a preset name above (or an alias).
    **kwargs: the settings to change, by the argument names above.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` whose ``preset`` (in its ``repr``) is the resolved name.

  Raises:
    ValueError: an unknown name (the message lists the known ones), or a value out of range.
    TypeError: an argument the preset does not take (the message lists those it takes), a
      wrong or traced value, or ``jmp`` without ``loss_scale``.

  Example:
    PyTorch's trajectory: two finite steps double the scale, an overflow halves it.

    >>> import jax.numpy as jnp, optax_dls
    >>> from optax_dls._policies.base import GradStats
    >>> policy = optax_dls.config.preset("torch", init_scale=2.0**16, growth_interval=2)
    >>> scale, state = policy.init()
    >>> for finite in [True, True, False]:
    ...   stats = GradStats(jnp.array(finite), jnp.array(0), grad_norm=jnp.array(1.0))
    ...   scale, state = policy.update(scale, state, stats)
    ...   print(float(scale))
    65536.0
    131072.0
    65536.0
  """
  name = _known(name)
  for key in sorted(set(kwargs) - _arguments(name)):
    raise TypeError(
      f"the loss-scale preset {name!r} takes no argument {key!r}; it takes "
      f"{sorted(_arguments(name))}."
    )
  if name in _FRAMEWORKS:
    if name == "jmp" and "loss_scale" not in kwargs:
      raise TypeError(
        "the loss-scale preset 'jmp' needs loss_scale, the initial scale (required, as in "
        "jmp.DynamicLossScale): optax_dls.config.preset('jmp', loss_scale=2.0**15)."
      )
    return _FRAMEWORKS[name](**kwargs)._replace(preset=name)
  return _policies.dynamic_policy(**(_PRESETS[name] | kwargs))._replace(preset=name)


def _load_config(path: str | os.PathLike) -> dict[str, Any]:
  """A YAML file's top-level mapping, read as by ``yaml.safe_load`` but refusing repeated keys."""
  yaml = _optional.require("yaml", "reading a YAML configuration")

  unique_keys: Any = type("UniqueKeyLoader", (yaml.SafeLoader,), {})

  def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
    own = [k for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"]  # not merged in
    data = loader.construct_mapping(node, deep=deep)  # merges, refuses an unhashable key
    seen: set[Any] = set()
    for key_node in own:
      if (key := loader.construct_object(key_node, deep=deep)) in seen:
        raise yaml.constructor.ConstructorError(
          None, None, f"duplicate key {key!r}", key_node.start_mark
        )
      seen.add(key)
    return data

  unique_keys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
  where = f"the configuration file {os.fspath(path)!r}"
  try:
    with open(path, encoding="utf-8") as f:
      data = yaml.load(f, Loader=unique_keys)  # a SafeLoader
  except UnicodeDecodeError as e:
    raise ValueError(f"{where} is not UTF-8 text (a binary file?): {e}") from None
  except yaml.YAMLError as e:
    raise ValueError(f"{where} is not valid YAML: {e}") from None
  if not isinstance(data, Mapping):  # the file's content, not an argument: a ValueError
    raise ValueError(f"{where} must hold a mapping, got {type(data).__name__}.")  # noqa: TRY004
  return dict(data)


def _section(config: Any) -> dict[str, Any]:
  """The ``loss_scale`` section (or the mapping itself) of a mapping or YAML file."""
  if isinstance(config, (str, os.PathLike)):
    config = _load_config(config)
  if not isinstance(config, Mapping):
    raise TypeError(f"config must be a mapping or a path to a YAML file, got {config!r}.")
  if "loss_scale" in config and (stray := sorted(k for k in config if k in _ALL_KEYS)):
    raise ValueError(
      f"the configuration has a 'loss_scale' section and also loss-scale keys at the top level, "
      f"{stray}, which would be ignored: move them into the 'loss_scale' section."
    )
  section = config.get("loss_scale", config)
  section = {} if section is None else section
  if not isinstance(section, Mapping):
    raise TypeError(f"config['loss_scale'] must be a mapping, got {section!r}.")
  for key, value in section.items():
    if not isinstance(key, str):  # a key of the configuration, as any unknown key
      raise ValueError(f"unknown loss-scale configuration key {key!r}.")  # noqa: TRY004
    if key in _NUMBER_KEYS and isinstance(value, str):
      raise TypeError(
        f"loss-scale configuration key {key!r} must be a number, got the string {value!r}. "
        "YAML (1.1, as PyYAML reads it) takes 1e4 and 1.0e4 for strings: write "
        + ("10000." if key in _WHOLE_KEYS else "1.0e+4 or 10000.")
      )
  for key in sorted(_HOST_KEYS & set(section)):
    raise ValueError(
      f"loss-scale configuration key {key!r}: alerts are raised on the host from "
      "optax_dls.metrics by optax_dls.SkipAlerts(alert_after=...), not configured "
      "in the transformation; remove the key."
    )
  return dict(section)


def _reject(keys: Any, allowed: frozenset[str], where: str) -> None:
  """ValueError naming the first of ``keys`` not in ``allowed``, ``where`` saying for what."""
  for key in sorted(set(keys) - allowed):
    raise ValueError(
      f"unknown loss-scale configuration key {key!r} for {where}; allowed keys: {sorted(allowed)}."
    )


def _take(section: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
  return {k: section.pop(k) for k in sorted(section) if k in keys}


def _policy(section: dict[str, Any]) -> Any:
  """The section's policy before any fallback; pops all but the wrapper keys from ``section``."""
  kind = section.pop("kind", "dynamic")
  if kind not in _KINDS:
    raise ValueError(f"loss_scale kind must be one of {_KINDS}, got kind={kind!r}.")
  if kind == "dynamic" and "preset" not in section:
    _reject(section, _POLICY_KEYS | _WRAPPER_KEYS, f"kind={kind!r}")
    return _policies.dynamic_policy(**_take(section, _POLICY_KEYS))
  if kind == "dynamic":
    name = section.pop("preset")
    arguments = _arguments(_known(name))  # a framework's preset takes its own names
    _reject(section, arguments | _WRAPPER_KEYS, f"kind={kind!r} with preset={name!r}")
    return preset(name, **_take(section, arguments))
  if kind == "static":
    _reject(section, frozenset({"scale"} | _WRAPPER_KEYS) - {"fallback_scale"}, f"kind={kind!r}")
    if "scale" not in section:
      raise ValueError("loss_scale kind='static' needs a 'scale' key.")
    return _policies.static_policy(section.pop("scale"))
  _reject(section, _TX_KEYS, f"kind={kind!r}")
  return _policies.noop_policy()


def from_config(config: Any, inner: optax.GradientTransformation | None = None) -> Any:
  """Builds loss scaling from a configuration mapping or YAML file.

  The mapping (or its ``loss_scale`` section, the others left alone) may hold these keys, each
  building exactly what the same argument does by hand:

  * ``kind``: ``"dynamic"`` (default), ``"static"`` or ``"none"``;
  * ``preset``: a name for :func:`preset` (dynamic only), overridden by
  * the :func:`~optax_dls.dynamic_policy` arguments (``init_scale``, ``growth_interval``,
    ``warmup_steps``, ...; with a framework's preset, its own names) for ``dynamic``, or
    ``scale`` for ``static``;
  * ``fallback_after``, ``fallback_steps``, ``fallback_scale``: :func:`~optax_dls.fp32_fallback`
    (``after``, ``steps``, ``scale``); kind ``static`` takes the first two, ``none`` none;
  * with ``inner`` only: ``axis_name`` and ``skip_lowering`` of :func:`~optax_dls.loss_scaled`,
    and ``underflow_stats`` (a bool: chain :func:`~optax_dls.underflow_stats` first inside, on the
    same ``axis_name``).

  Args:
    config: a mapping, or a ``str`` / ``os.PathLike`` path to a YAML file holding one (needs
      PyYAML), read as by ``yaml.safe_load`` but refusing a repeated key.
    inner: the optax transformation to wrap, or None (default).

  Returns:
    A :class:`~optax_dls.LossScalePolicy` if ``inner`` is None, else the loss-scaled ``inner``.

  Raises:
    ValueError: an unknown key (named), kind or preset, a wrapper option without ``inner``, a
      fallback option without ``fallback_after``, ``alerts`` (see :class:`~optax_dls.SkipAlerts`),
      a value out of range, loss-scale keys beside a ``loss_scale`` section, or a YAML file
      that is not UTF-8, does not parse, repeats a key, holds an unhashable key or a Python
      tag, or holds no mapping (named).
    TypeError: ``config`` (or its section) is neither a mapping nor a path, or a value of the
      wrong type (``1e4``, a string to YAML, gets a hint to write ``1.0e+4``).
    OSError: the YAML file cannot be read.
    ImportError: a path given without PyYAML (naming the ``monitoring`` extra).
  """
  section = _section(config)
  policy = _policy(section)
  fallback = {k.removeprefix("fallback_"): v for k, v in _take(section, _FALLBACK_KEYS).items()}
  if fallback.get("after") is not None:
    policy = _policies.fp32_fallback(policy, **fallback)
  elif set(fallback) - {"after"}:
    raise ValueError(
      f"loss-scale configuration keys {sorted('fallback_' + k for k in fallback)} "
      "need fallback_after (the consecutive skips that start the float32 fallback)."
    )
  if inner is None:
    for key in sorted(section):
      raise ValueError(
        f"loss-scale configuration key {key!r} configures the transformation: pass "
        "inner= to from_config to get a transformation, or remove it to get a policy."
      )
    return policy
  stats = section.pop("underflow_stats", False)
  if not isinstance(stats, (bool, type(None))):
    raise TypeError(f"underflow_stats in a configuration must be a bool, got {stats!r}.")
  if stats:  # the same axes as the transformation, as one would chain it by hand
    counts = _underflow.underflow_stats(axis_name=section.get("axis_name"))
    inner = optax.chain(counts, _accumulation.check_inner(inner))
  return _transform.loss_scaled(inner, policy, **section)
