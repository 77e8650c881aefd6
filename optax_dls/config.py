"""Presets and configuration: loss scaling from a dict or a YAML file (public submodule).

A configuration is a mapping, or the ``loss_scale`` section of one, or the path of a
YAML file holding one::

    loss_scale:
      preset: text_llm        # optional: start from a preset
      init_scale: 4096        # any dynamic_loss_scale argument overrides it
      growth_interval: 100
      warmup_steps: 50

:func:`from_config` turns it into a :class:`~optax_dls.LossScalePolicy` or, given the
inner optimizer, a loss-scaled transformation. Unknown keys raise an error
naming the key, before anything is built.

:func:`preset` names a policy: another framework's scale trajectory (``"torch"``,
``"jmp"``, ``"keras"``, ``"flax"``, ``"megatron"``, ``"deepspeed"``) or settings for a kind of
training (``"text_llm"``, ``"multimodal"``, ``"preference"``, ``"qlora"``), as in
``optax_dls.loss_scaled(optax.adam(1e-3), optax_dls.config.preset("torch"))``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any

import optax

from optax_dls import _policies
from optax_dls._core import accumulation as _accumulation
from optax_dls._core import transform as _transform
from optax_dls._features import underflow as _underflow
from optax_dls._policies import presets as _presets
from optax_dls._util import optional as _optional

__all__ = ["from_config", "preset"]

_POLICY_KEYS = frozenset(
  {
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "hysteresis",
    "consecutive_hysteresis",
    "warmup_steps",
  }
)
_WRAPPER_KEYS = frozenset(
  {
    "axis_name",
    "skip_lowering",
    "underflow_stats",
    "fallback_after",
    "fallback_steps",
    "fallback_scale",
  }
)
_HOST_KEYS = frozenset({"alerts", "alert_after"})
_KINDS = ("dynamic", "static", "none")
_NUMBER_KEYS = (_POLICY_KEYS | _WRAPPER_KEYS | {"scale"}) - {
  "consecutive_hysteresis",
  "axis_name",
  "skip_lowering",
  "underflow_stats",
}
_ALL_KEYS = _POLICY_KEYS | _WRAPPER_KEYS | {"kind", "preset", "scale"}

# The presets for a kind of training: their dynamic_policy arguments (why each value: the
# docstring of preset and docs/observability.md).
_PRESETS: dict[str, dict[str, Any]] = {
  "text_llm": dict(init_scale=2.0**16, growth_interval=1000, hysteresis=2),
  "multimodal": dict(init_scale=2.0**13, growth_interval=1000, warmup_steps=1000, hysteresis=2),
  "preference": dict(init_scale=2.0**15, max_scale=2.0**16, growth_interval=1000, hysteresis=2),
  "qlora": dict(init_scale=2.0**16, growth_interval=1000, max_scale=2.0**24),
}
_ALIASES = {"dpo": "preference", "alignment": "preference", "llm": "text_llm", "lora": "qlora"}
# The presets that reproduce another framework's scale trajectory, each taking that
# framework's own argument names.
_FRAMEWORKS: dict[str, Callable[..., Any]] = {
  "torch": _presets.torch_policy,
  "jmp": _presets.jmp_policy,
  "keras": _presets.keras_policy,
  "flax": _presets.flax_policy,
  "megatron": _presets.megatron_policy,
  "deepspeed": _presets.deepspeed_policy,
}


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

  Use as ``optax_dls.loss_scaled(optax.adam(1e-3), optax_dls.config.preset("torch"))``
  or ``{"loss_scale": {"preset": "qlora"}}`` in a configuration (:func:`from_config`).

  **Another framework's scale trajectory.** The policy's scale, given the same sequence
  of finite / non-finite steps, equals that framework's loss scaler's bit for bit, as
  long as the reference stays inside ``[2**-126, 2**126]`` (the range of every optax_dls
  scale); ``kwargs`` take the framework's own argument names, with its defaults (where
  exact reproduction stops: ``docs/policies.md``):

  * ``"torch"``: PyTorch ``torch.amp.GradScaler``: ``init_scale=2**16``,
    ``growth_factor=2``, ``backoff_factor=0.5``, ``growth_interval=2000``. Grows on the
    ``growth_interval``-th consecutive finite step, backs off on every non-finite one.
  * ``"keras"``: Keras 3 ``LossScaleOptimizer``: ``initial_scale=2**15``,
    ``dynamic_growth_steps=2000``; factor 2.
  * ``"jmp"``: ``jmp.DynamicLossScale``: ``loss_scale`` (the initial scale, required as
    in jmp), ``period=2000``, ``factor=2``, ``min_loss_scale=1``; backs off by dividing
    by ``factor``.
  * ``"flax"``: ``flax.training.dynamic_scale.DynamicScale``: ``growth_factor=2``,
    ``backoff_factor=0.5``, ``growth_interval=2000``, ``scale=2**16``,
    ``minimum_scale=2**-126`` (None: no floor in flax, ``2**-126`` here); grows on the
    ``growth_interval + 1``-th consecutive finite step.
  * ``"megatron"``: Megatron-LM ``DynamicGradScaler``: ``initial_scale=2**32``,
    ``min_scale=1``, ``growth_factor=2``, ``backoff_factor=0.5``,
    ``growth_interval=1000``, ``hysteresis=2``; only a growth refills the hysteresis.
  * ``"deepspeed"``: DeepSpeed ``DynamicLossScaler`` (0.19): ``init_scale=2**16``,
    ``scale_window=1000``, ``min_scale=1``, ``delayed_shift=2`` (the hysteresis),
    ``consecutive_hysteresis=False``; the first growth on the ``scale_window + 1``-th
    consecutive finite step, later ones every ``scale_window``.

  **A kind of training.** :func:`~optax_dls.dynamic_policy` with these values;
  ``kwargs`` are :func:`~optax_dls.dynamic_policy` arguments:

  * ``"text_llm"`` (alias ``"llm"``): ``init_scale=2**16``, ``growth_interval=1000``,
    ``hysteresis=2``. Decoder-only text LLMs: gradients are small and well behaved
    after the first steps, so start high (2**16, PyTorch's default) and retry growth
    every 1000 steps (Megatron-LM's window); hysteresis 2 (Megatron, DeepSpeed) rides
    out the isolated overflow of a rare long or odd batch without halving the scale.
  * ``"multimodal"``: ``init_scale=2**13``, ``growth_interval=1000``,
    ``warmup_steps=1000``, ``hysteresis=2``. Vision-language and other multimodal
    models: patch embeddings, projector layers and freshly joined towers give large
    activations and gradient spikes early on, so start lower (2**13, between 2**12 and
    2**14) and hold growth for the first 1000 updates while the projector settles.
  * ``"preference"`` (aliases ``"dpo"``, ``"alignment"``): ``init_scale=2**15``,
    ``max_scale=2**16``, ``growth_interval=1000``, ``hysteresis=2``. Preference /
    alignment training (DPO, IPO, KTO): the loss is a function of sums of per-token
    log-probabilities of a policy and a reference, whose gradients jump when the margin
    flips; capping the scale at 65536 (2**16) keeps the scaled gradients out of float16
    overflow after long clean stretches.
  * ``"qlora"`` (alias ``"lora"``): ``init_scale=2**16``, ``growth_interval=1000``,
    ``max_scale=2**24``. QLoRA and other adapter fine-tuning: only small low-rank
    adapters train (LoRA B starts at zero), on a frozen quantized base, at a small
    learning rate; their gradients are tiny and underflow float16 easily, so start at
    2**16 or more and grow every 1000 steps up to 2**24.

  Args:
    name: a preset name above (or an alias).
    **kwargs: the settings to change, by the argument names above.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` with the dynamic rule's state
    (``growth_tracker``, ``hysteresis_left``).

  Raises:
    ValueError: an unknown name (the message lists the known ones), or a value out of
      range (the message names it).
    TypeError: an argument the preset does not take (the message lists those it
      takes), a wrong or traced value, or ``jmp`` without ``loss_scale``.

  Example:
    PyTorch's trajectory with ``growth_interval=2``: two finite steps double the scale,
    an overflow halves it.

    >>> import jax.numpy as jnp, optax_dls
    >>> from optax_dls._policies.base import GradStats
    >>> policy = optax_dls.config.preset("torch", init_scale=2.0**16, growth_interval=2)
    >>> scale, state = policy.init()
    >>> for finite in [True, True, False]:
    ...   stats = GradStats(finite=jnp.array(finite), step=jnp.array(0),
    ...                     grad_norm=jnp.array(1.0))
    ...   scale, state = policy.update(scale, state, stats)
    ...   print(float(scale))
    65536.0
    131072.0
    65536.0
  """
  name = _known(name)
  unknown = sorted(set(kwargs) - _arguments(name))
  if unknown:
    raise TypeError(
      f"the loss-scale preset {name!r} takes no argument {unknown[0]!r}; it takes "
      f"{sorted(_arguments(name))}."
    )
  if name in _FRAMEWORKS:
    if name == "jmp" and "loss_scale" not in kwargs:
      raise TypeError(
        "the loss-scale preset 'jmp' needs loss_scale, the initial scale (required, as in "
        "jmp.DynamicLossScale): optax_dls.config.preset('jmp', loss_scale=2.0**15)."
      )
    return _FRAMEWORKS[name](**kwargs)
  return _policies.dynamic_policy(**(_PRESETS[name] | kwargs))


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _unique_key_loader(yaml: Any) -> Any:
  """A ``yaml.SafeLoader`` that refuses a key given twice in one mapping.

  It reads everything ``yaml.safe_load`` reads, merge keys (``<<: *anchor``)
  included: a key that a merge brings in and the mapping then sets again is
  an override, not a duplicate. Python tags stay refused, as in
  ``SafeLoader``.
  """

  class UniqueKeyLoader(yaml.SafeLoader):
    pass

  def mapping(loader: Any, node: Any, deep: bool = False) -> Any:
    own = [key_node for key_node, _ in node.value if key_node.tag != _MERGE_TAG]
    loader.flatten_mapping(node)  # resolves the merge keys, as SafeLoader does
    seen = set()
    for key_node in own:
      key = loader.construct_object(key_node, deep=deep)
      try:
        duplicate = key in seen
      except TypeError:
        raise yaml.constructor.ConstructorError(
          "while constructing a mapping",
          node.start_mark,
          "found an unhashable key (a sequence or mapping used as a key)",
          key_node.start_mark,
        ) from None
      if duplicate:
        raise yaml.constructor.ConstructorError(
          None, None, f"duplicate key {key!r}", key_node.start_mark
        )
      seen.add(key)
    return loader.construct_mapping(node, deep=deep)

  UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
  return UniqueKeyLoader


def _load_config(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a YAML file into a dict (needs PyYAML), for :func:`from_config`.

  Reads what ``yaml.safe_load`` reads (anchors, aliases and merge keys
  included), except a key given twice in one mapping.

  Args:
    path: ``str`` or ``os.PathLike``, the YAML file.

  Returns:
    The file's top-level mapping, as a new ``dict``.

  Raises:
    ValueError: the file is not UTF-8 YAML, holds a key twice in one mapping,
      holds an unhashable key or a Python tag, or does not hold a mapping
      (each message names the file).
    OSError: the file cannot be read.
    TypeError: ``path`` is neither a ``str`` nor an ``os.PathLike``.
    ImportError: PyYAML is not installed (the message names the ``monitoring``
      extra that installs it).
  """
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(
      f"path must be a str or os.PathLike, got {path!r} of type {type(path).__name__}."
    )
  yaml = _optional.require("yaml", "reading a YAML configuration")
  name = os.fspath(path)
  try:
    with open(path, encoding="utf-8") as f:
      data = yaml.load(f, Loader=_unique_key_loader(yaml))
  except UnicodeDecodeError as e:
    raise ValueError(
      f"the configuration file {name!r} is not UTF-8 text (a binary file?): {e}"
    ) from None
  except yaml.YAMLError as e:
    raise ValueError(f"the configuration file {name!r} is not valid YAML: {e}") from None
  if not isinstance(data, Mapping):  # the file's content, not an argument: a ValueError
    raise ValueError(  # noqa: TRY004
      f"the configuration file {name!r} must hold a mapping, got {type(data).__name__}."
    )
  return dict(data)


def _section(config: Any) -> dict[str, Any]:
  if isinstance(config, (str, os.PathLike)):
    config = _load_config(config)
  if not isinstance(config, Mapping):
    raise TypeError(f"config must be a mapping or a path to a YAML file, got {config!r}.")
  section = config.get("loss_scale", config)
  if "loss_scale" in config:
    stray = sorted(k for k in config if k in _ALL_KEYS)
    if stray:
      raise ValueError(
        f"the configuration has a 'loss_scale' section and also loss-scale keys at the top level, "
        f"{stray}, which would be ignored: move them into the 'loss_scale' section."
      )
  if section is None:
    section = {}
  if not isinstance(section, Mapping):
    raise TypeError(f"config['loss_scale'] must be a mapping, got {section!r}.")
  for key in section:
    if not isinstance(key, str):  # a key of the configuration, as any unknown key
      raise ValueError(f"unknown loss-scale configuration key {key!r}.")  # noqa: TRY004
  return dict(section)


def _reject(keys: Any, allowed: frozenset[str], where: str) -> None:
  """ValueError naming the first of ``keys`` not in ``allowed``, ``where`` saying for what
  (``"kind='static'"``)."""
  for key in sorted(keys):
    if key not in allowed:
      raise ValueError(
        f"unknown loss-scale configuration key {key!r} for {where}; allowed keys: "
        f"{sorted(allowed)}."
      )


def _check_values(section: Mapping[str, Any]) -> None:
  """Refuses a number written as a string and a host-side (alerts) key.

  Args:
    section: the ``loss_scale`` section, its keys ``str``.

  Raises:
    TypeError: a number key whose value is a ``str`` (with the YAML hint).
    ValueError: an ``alerts`` or ``alert_after`` key.
  """
  for key, value in section.items():
    if key in _NUMBER_KEYS and isinstance(value, str):
      raise TypeError(
        f"loss-scale configuration key {key!r} must be a number, got the string {value!r}. "
        "YAML reads a number such as 1e4 as a string: write 1.0e4 or 10000."
      )
  for key in sorted(_HOST_KEYS & set(section)):
    raise ValueError(
      f"loss-scale configuration key {key!r}: alerts are raised on the host from "
      "optax_dls.metrics by optax_dls.SkipAlerts(alert_after=...), not configured "
      "in the transformation; remove the key."
    )


def _policy(section: dict[str, Any]) -> Any:
  """The policy the section's ``kind`` names, built from the keys of that kind.

  Pops ``kind``, ``preset``, ``scale`` and the policy keys from ``section``;
  the wrapper keys stay in it.

  Args:
    section: the ``loss_scale`` section, its keys ``str`` (changed in place).

  Returns:
    The :class:`~optax_dls.LossScalePolicy` (before any fallback).

  Raises:
    ValueError: an unknown kind, a key that the kind does not take, an
      unknown preset, ``kind='static'`` without ``scale``, a value out of range.
    TypeError: a value of the wrong type.
  """
  kind = section.pop("kind", "dynamic")
  if kind not in _KINDS:
    raise ValueError(f"loss_scale kind must be one of {_KINDS}, got kind={kind!r}.")
  if kind == "dynamic":
    if "preset" not in section:
      _reject(section, _POLICY_KEYS | _WRAPPER_KEYS, f"kind={kind!r}")
      kwargs = {k: section.pop(k) for k in list(section) if k in _POLICY_KEYS}
      return _policies.dynamic_policy(**kwargs)
    name = section.pop("preset")
    arguments = _arguments(_known(name))  # a framework's preset takes its own names
    _reject(section, arguments | _WRAPPER_KEYS, f"kind={kind!r} with preset={name!r}")
    return preset(name, **{k: section.pop(k) for k in list(section) if k in arguments})
  if kind == "static":
    _reject(section, frozenset({"scale"} | _WRAPPER_KEYS) - {"fallback_scale"}, f"kind={kind!r}")
    if "scale" not in section:
      raise ValueError("loss_scale kind='static' needs a 'scale' key.")
    return _policies.static_policy(section.pop("scale"))
  _reject(section, frozenset({"axis_name", "skip_lowering", "underflow_stats"}), f"kind={kind!r}")
  return _policies.noop_policy()


def _with_fallback(policy: Any, section: dict[str, Any]) -> Any:
  """``policy`` wrapped in :func:`~optax_dls.fp32_fallback` when the section asks for it.

  Pops the ``fallback_*`` keys from ``section``.

  Args:
    policy: the :class:`~optax_dls.LossScalePolicy` to wrap.
    section: the ``loss_scale`` section, its keys ``str`` (changed in place).

  Returns:
    The wrapped policy when ``fallback_after`` is set (not None), else ``policy``.

  Raises:
    ValueError: ``fallback_steps`` or ``fallback_scale`` without
      ``fallback_after``, or a value out of range.
    TypeError: a value of the wrong type.
  """
  fallback = {
    k.removeprefix("fallback_"): section.pop(k)
    for k in sorted(section)
    if k.startswith("fallback_")
  }
  if fallback.get("after") is not None:
    return _policies.fp32_fallback(policy, **fallback)
  if set(fallback) - {"after"}:
    raise ValueError(
      f"loss-scale configuration keys {sorted('fallback_' + k for k in fallback)} "
      "need fallback_after (the consecutive skips that start the float32 fallback)."
    )
  return policy


def _transformation(
  section: dict[str, Any], policy: Any, inner: optax.GradientTransformation
) -> Any:
  """``inner`` loss-scaled by ``policy``, with the wrapper keys left in ``section``.

  Args:
    section: the wrapper keys (``axis_name``, ``skip_lowering``,
      ``underflow_stats``) left after :func:`_policy` and :func:`_with_fallback`.
    policy: the :class:`~optax_dls.LossScalePolicy`.
    inner: the optax transformation to wrap.

  Returns:
    The loss-scaled transformation (:func:`~optax_dls.loss_scaled`).

  Raises:
    TypeError: ``underflow_stats`` neither a ``bool`` nor None, or a value of
      the wrong type for :func:`~optax_dls.loss_scaled`.
  """
  stats = section.pop("underflow_stats", False)
  if not isinstance(stats, (bool, type(None))):
    raise TypeError(f"underflow_stats in a configuration must be a bool, got {stats!r}.")
  if stats:  # the same axes as the transformation, as one would chain it by hand
    counts = _underflow.underflow_stats(axis_name=section.get("axis_name"))
    inner = optax.chain(counts, _accumulation.check_inner(inner))
  return _transform.loss_scaled(inner, policy, **section)


def from_config(config: Any, inner: optax.GradientTransformation | None = None) -> Any:
  """Builds loss scaling from a configuration mapping or YAML file.

  The mapping (or its ``loss_scale`` section, when it has one; the other
  sections are left alone) may hold:

  * ``kind``: ``"dynamic"`` (default), ``"static"`` or ``"none"``;
  * ``preset``: a name for :func:`preset` (dynamic only), overridden by
  * the :func:`~optax_dls.dynamic_policy` arguments (``init_scale``, ``growth_interval``,
    ``warmup_steps``, ...) for ``dynamic`` (with the preset of another framework, that
    framework's argument names, as :func:`preset` takes them), or ``scale`` for
    ``static``;
  * ``fallback_after``, ``fallback_steps``, ``fallback_scale``: wrap the
    policy in :func:`~optax_dls.fp32_fallback` (``after``, ``steps``, ``scale``);
    kind ``static`` takes the first two (it returns to its own scale), kind
    ``none`` takes none of them;
  * with ``inner`` only: ``axis_name`` and ``skip_lowering`` of
    :func:`~optax_dls.loss_scaled`, and ``underflow_stats`` (a bool: chain
    :func:`~optax_dls.underflow_stats` first inside, with the same ``axis_name``).

  Each key builds exactly what the same argument does by hand: the result
  equals ``loss_scaled(inner, policy, axis_name=..., skip_lowering=...)``
  with ``policy`` from :func:`~optax_dls.dynamic_policy`, or the policy of
  :func:`~optax_dls.static_loss_scale` or :func:`~optax_dls.no_loss_scale`
  (wrapped in :func:`~optax_dls.fp32_fallback` for the ``fallback_*`` keys).

  Args:
    config: a mapping, or a ``str`` / ``os.PathLike`` path to a YAML file (needs
      PyYAML), which must hold a mapping: read as ``yaml.safe_load`` reads it
      (anchors, aliases and merge keys included), except that a key given twice in
      one mapping is refused.
    inner: the optax transformation to wrap, or None.

  Returns:
    A :class:`~optax_dls.LossScalePolicy` when ``inner`` is None, otherwise the
    loss-scaled transformation (:func:`~optax_dls.loss_scaled`).

  Raises:
    ValueError: an unknown key (named in the message), an unknown kind or
      preset, a wrapper option without ``inner``, a fallback option without
      ``fallback_after``, ``alerts`` (alerts run on the host: see
      :class:`~optax_dls.SkipAlerts`), a value out of range, a ``loss_scale`` section
      together with loss-scale keys at the top level, or a YAML file that is
      not UTF-8, does not parse, repeats a key, holds an unhashable key or a
      Python tag, or holds no mapping (each message names the file).
    TypeError: ``config`` (or its ``loss_scale`` section) is not a mapping
      nor a path, or a value of the wrong type (a number written ``1e4``
      that YAML reads as a string gets a hint to write ``1.0e4``).
    OSError: the YAML file cannot be read.
    ImportError: a path given without PyYAML installed (the message names the
      ``monitoring`` extra that installs it).
  """
  section = _section(config)
  _check_values(section)
  policy = _with_fallback(_policy(section), section)
  if inner is None:
    for key in sorted(section):
      raise ValueError(
        f"loss-scale configuration key {key!r} configures the transformation: pass "
        "inner= to from_config to get a transformation, or remove it to get a policy."
      )
    return policy
  return _transformation(section, policy, inner)
