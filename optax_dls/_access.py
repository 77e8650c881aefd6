"""Finding the loss-scale state anywhere inside an optimizer state, and reading it."""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_dls import _accumulation, _labels, _localisation, _validation
from optax_dls._state import LossScaleState


def _is_node(x: Any) -> bool:
  return isinstance(x, LossScaleState) or _accumulation.is_multisteps_state(x)


def _find_all(tree: Any) -> list[LossScaleState]:
  found = []
  for leaf in jax.tree.leaves(tree, is_leaf=_is_node):
    if _accumulation.is_multisteps_state(leaf):
      if _find_all(leaf.inner_opt_state):
        raise ValueError(_accumulation.MULTISTEPS_OUTSIDE)
    elif isinstance(leaf, LossScaleState):
      found.append(leaf)
      found.extend(_find_all((leaf.policy_state, leaf.inner_state)))
  return found


def _unwrap(tree: Any) -> Any:
  """Replaces flax ``nnx.Variable`` leaves (an ``nnx.Optimizer``'s state) by their arrays.

  flax is never imported here: without it loaded there can be no Variables.
  """
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return tree
  is_var = lambda x: isinstance(x, nnx.Variable)
  value = lambda x: x.get_value() if hasattr(x, "get_value") else x.value
  return jax.tree.map(lambda x: value(x) if is_var(x) else x, tree, is_leaf=is_var)


def find_state(opt_state: Any) -> LossScaleState:
  """Returns the one :class:`LossScaleState` inside ``opt_state``.

  ``opt_state`` may be the state itself or any pytree holding it: an
  ``optax.chain`` state, a loss-scaled ``optax.MultiSteps`` state, a dict, a
  flax ``TrainState``, an ``nnx.Optimizer`` or its ``opt_state``. Leaves
  wrapped in ``nnx.Variable`` are returned as plain arrays.

  Args:
    opt_state: any pytree holding the state of one loss-scaled transformation.

  Returns:
    That :class:`LossScaleState` (a new one, of arrays, where its leaves were
    ``nnx.Variable``); reading it does not change ``opt_state``.

  Raises:
    ValueError: there is no loss-scale state in ``opt_state``, or more than
      one, or it sits inside ``optax.MultiSteps`` (unsupported order; the
      message says what to do instead).

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax.chain(optax_dls.dynamic_loss_scale(optax.adam(1e-3)), optax.scale(0.5))
    >>> float(optax_dls.find_state(tx.init({'w': jnp.ones(2)})).loss_scale)
    32768.0
  """
  found = _find_all(opt_state)
  if not found:
    raise ValueError(
      "opt_state holds no LossScaleState: pass the state of an optimizer built with "
      "optax_dls.dynamic_loss_scale / static_loss_scale / no_loss_scale / loss_scaled, "
      f"got a {type(opt_state).__name__}."
    )
  if len(found) > 1:
    raise ValueError(
      f"opt_state holds {len(found)} LossScaleStates, so which scale to use is ambiguous: "
      "wrap the optimizer once, at the outside, or pass the sub-state you mean."
    )
  return _unwrap(found[0])


def find_feature(opt_state: Any, kind: type) -> Any:
  """The one node of type ``kind`` (a feature's state, e.g. a policy wrapper's)
  inside the loss-scale state of ``opt_state``, or None when there is none."""
  state = find_state(opt_state)
  nodes = [
    x
    for x in jax.tree.leaves(
      (state.policy_state, state.inner_state), is_leaf=lambda x: isinstance(x, kind)
    )
    if isinstance(x, kind)
  ]
  return nodes[0] if nodes else None


def loss_scale(opt_state: Any) -> jax.Array:
  """The current loss scale S: a float32 ``()`` array (stays on the device).

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.

  Returns:
    The state's ``loss_scale``: the S to multiply the next loss by, kept
    within the policy's ``[min_scale, max_scale]`` (see :class:`LossScaleState`).

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
    >>> optax_dls.loss_scale(tx.init({'w': jnp.ones(2)}))  # init_scale's default, 2**15
    Array(32768., dtype=float32)
  """
  return find_state(opt_state).loss_scale


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
  """Multiplies ``loss`` by the current loss scale S, before differentiation.

  Micikevicius et al. (2018), *Mixed Precision Training*: scaling the loss
  scales every gradient by S, lifting small fp16 gradients out of the
  underflow range. The optimizer built by :func:`dynamic_loss_scale` divides
  them by the same S.

  Args:
    loss: a floating array of any shape (usually the scalar loss, float32).
      bfloat16 and float16 losses are promoted to float32 so that the scaled
      value cannot overflow their range.
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.

  Returns:
    ``loss * S`` with dtype ``promote_types(loss.dtype, float32)``.

  Raises:
    TypeError: ``loss`` is not a floating-point array (e.g. an int, a str or None).
    ValueError: none or more than one loss-scale state in ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> state = tx.init({'w': jnp.ones(2)})
    >>> optax_dls.scale_loss(jnp.float16(0.5), state)
    Array(512., dtype=float32)
  """
  return times_scale(loss, loss_scale(opt_state))


def times_scale(loss: Any, scale: jax.Array) -> jax.Array:
  """``loss * scale`` in ``promote_types(loss.dtype, float32)``; TypeError for a loss that is
  not floating point."""
  if loss is None or isinstance(loss, (str, bytes)):
    raise TypeError(
      f"loss must be a floating-point array, got {loss!r} of type {type(loss).__name__}."
    )
  if isinstance(loss, (tuple, list, dict)):
    raise TypeError(
      f"loss must be a floating-point array, got a {type(loss).__name__}: a function that "
      "returns (loss, aux) needs has_aux=True (value_and_grad), or pass the loss alone "
      "(scale_loss(loss, opt_state))."
    )
  try:
    loss = jnp.asarray(loss)
  except (TypeError, ValueError) as e:
    raise TypeError(
      f"loss must be a floating-point array, got {loss!r} of type {type(loss).__name__}: {e}"
    ) from None
  if not jnp.issubdtype(loss.dtype, jnp.floating):
    raise TypeError(f"loss must be a floating-point array, got dtype {loss.dtype}.")
  dtype = jnp.promote_types(loss.dtype, jnp.float32)
  return loss.astype(dtype) * scale.astype(dtype)


def metrics(opt_state: Any) -> dict[str, jax.Array]:
  """What the loss scaler did, as a dict of device arrays (no host transfer).

  Every value is a 0-d array except the two bit sets. The keys:

  - ``loss_scale`` (float32): the scale for the next loss.
  - ``skipped`` (bool): whether the last step was skipped.
  - ``skip_count`` (int32): skipped steps so far.
  - ``consecutive_skips`` (int32): skipped steps since the last applied one.
  - ``num_steps`` (int32): updates so far, skipped included.
  - ``update_ratio`` (float32): applied steps over all steps, in [0, 1] (1
    before any).
  - ``grad_norm`` (float32): global L2 norm of the last step's unscaled
    gradients (NaN before the first step, and with :func:`no_loss_scale`
    unless it tracks the norm; inf or NaN when the gradients were not finite).
  - ``nonfinite_step`` (int32): the update number (``num_steps`` after it) of
    the last non-finite step; 0 before any.
  - ``nonfinite_loss`` (bool): whether the loss of that step was itself not
    finite (known when the loss is handed to ``update(..., loss=)`` or to
    :func:`value_and_grad`).
  - ``nonfinite_leaves``, ``nonfinite_nan`` (uint32 ``[W]``, one bit per
    floating gradient leaf, ``W = ceil(leaves / 32)``, at least 1): the
    leaves that were not finite on that step, and those of them that held a
    NaN (the others held infinities); :func:`nonfinite_leaves` names them,
    and :class:`optax_dls.writers.MetricsWriter` logs the names.
  - ``nonfinite_names_digest`` (uint32 ``()``): a checksum of the names of
    the parameter leaves the state was built for, with which
    :func:`nonfinite_leaves` and the writer refuse another params tree (the
    writer does not log it).
  - ``overflows/<label>`` (int32): with ``labels=``, the non-finite steps in
    which some leaf of that parameter group was not finite.

  The keys each feature adds: ``fp32_fallback`` (bool) with the
  :func:`fp32_fallback` policy wrapper; ``skips_at_min_scale`` (int32) with
  :func:`skips_at_min_scale`; ``underflow/zero_frac``,
  ``underflow/subnormal_frac`` and ``underflow/<label>/...`` (float32) with
  :func:`underflow_stats` chained inside; ``recomputed_steps`` and
  ``recompute_tries`` (int32) with :func:`recompute_stats` chained inside.

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`
      (any pytree around it, as for :func:`find_state`).

  Returns:
    A new ``dict`` from key to ``jax.Array``, as above.

  Raises:
    ValueError: none or more than one loss-scale state in ``opt_state``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1), init_scale=1024.0)
    >>> params = {'w': jnp.ones(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({'w': jnp.array([1.0, jnp.inf])}, state, params)
    >>> m = optax_dls.metrics(state)
    >>> float(m['loss_scale']), bool(m['skipped']), int(m['skip_count'])
    (512.0, True, 1)
  """
  s = find_state(opt_state)
  steps = s.num_steps.astype(jnp.float32)
  applied = steps - s.num_skipped.astype(jnp.float32)
  record = s.nonfinite
  out = {
    "loss_scale": s.loss_scale,
    "skipped": ~s.last_step_finite,
    "skip_count": s.num_skipped,
    "consecutive_skips": s.consecutive_skips,
    "num_steps": s.num_steps,
    "update_ratio": jnp.where(steps > 0, applied / jnp.maximum(steps, 1.0), 1.0),
    "grad_norm": s.grad_norm,
    "nonfinite_step": record.step,
    "nonfinite_loss": record.loss,
    "nonfinite_leaves": record.leaves,
    "nonfinite_nan": record.nan,
    "nonfinite_names_digest": record.names_digest,
    **{f"overflows/{label}": count for label, count in record.overflows.items()},
  }
  return {**out, **_feature_metrics((s.policy_state, s.inner_state))}


def _feature_metrics(tree: Any) -> dict[str, jax.Array]:
  """The keys each feature's state reports (policy wrappers, chained transformations),
  nested ones included."""
  reports = lambda x: hasattr(x, "loss_scale_metrics")
  out = {}
  for node in jax.tree.leaves(tree, is_leaf=reports):
    if reports(node):
      out.update(_feature_metrics(tuple(node)))
      out.update(node.loss_scale_metrics())
  return out


def nonfinite_leaves(opt_state: Any, params: Any) -> dict[str, str]:
  """Names the gradient leaves that were not finite on the last non-finite step.

  Host side: reads the record's small arrays from the device (its two bit
  sets and the names' checksum). The names are the key
  paths of the parameter tree (``"params/decoder/layers_3/attn/query/kernel"``),
  in leaf order.

  Args:
    opt_state: an optimizer state holding one :class:`LossScaleState`, or the
      dict :func:`metrics` returns (device or host values).
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``; only the tree
      and the dtypes are read), or the list of leaf names.

  Returns:
    ``{name: "inf" | "nan"}``: ``"nan"`` where the leaf held a NaN, ``"inf"``
    where it held only infinities; empty before any non-finite step.

  Raises:
    TypeError: ``params`` is neither a pytree of arrays nor a list of names.
    ValueError: ``opt_state`` holds none or several loss-scale states; the
      floating leaves of ``params`` are not those the state was built for
      (their names, of which the state and :func:`metrics` keep a checksum;
      a dict without ``nonfinite_names_digest``, such as a logged row, keeps
      no count of its leaves either: it is checked only as far as its bits
      allow, ``params`` needing as many 32-bit words and a leaf for every
      bit set); or
      the state is stacked (``jax.vmap(tx.init)``, an ensemble): name one
      member's leaves, ``jax.tree.map(lambda x: x[i], opt_state)``.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> params = {'dense': {'kernel': jnp.ones(2), 'bias': jnp.ones(1)}}
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
    >>> grads = {'dense': {'kernel': jnp.array([1.0, jnp.nan]), 'bias': jnp.ones(1)}}
    >>> _, state = tx.update(grads, tx.init(params), params)
    >>> optax_dls.nonfinite_leaves(state, params)
    {'dense/kernel': 'nan'}
  """
  digest = None
  if isinstance(opt_state, dict) and "nonfinite_leaves" in opt_state:
    words, nan = opt_state["nonfinite_leaves"], opt_state["nonfinite_nan"]
    digest = opt_state.get("nonfinite_names_digest")
  else:
    record = find_state(opt_state).nonfinite
    words, nan, digest = record.leaves, record.nan, record.names_digest
  names = _names_of(params)
  words, nan = np.asarray(jax.device_get(words)), np.asarray(jax.device_get(nan))
  if words.ndim != 1:
    raise ValueError(
      f"opt_state is stacked: its record of non-finite leaves has the shape {words.shape} "
      f"(one row per member, as jax.vmap(tx.init) makes it), and names are given one member "
      f"at a time: nonfinite_leaves(jax.tree.map(lambda x: x[i], opt_state), params) for "
      f"member i of {words.shape[0]}."
    )
  if digest is not None and int(np.asarray(jax.device_get(digest))) != _localisation.digest(names):
    raise ValueError(
      f"params is not the tree the state was built for: its {len(names)} floating leaves "
      f"({_some(names)}) do not match the names the state keeps a checksum of (a leaf added, "
      "removed, renamed or reordered): pass the parameters given to tx.init, or their "
      "leaf_names."
    )
  set_bits = np.flatnonzero(_localisation.unpack(words | nan, words.shape[-1] * 32))
  if _localisation.num_words(len(names)) != words.shape[-1] or (
    set_bits.size and set_bits[-1] >= len(names)
  ):
    raise ValueError(
      f"params has {len(names)} floating leaves, which do not fit the record (made for "
      f"{32 * (words.shape[-1] - 1) + 1} to {32 * words.shape[-1]} leaves; leaf "
      f"{int(set_bits[-1]) if set_bits.size else 0} is recorded): pass the parameters the "
      "state was built for."
    )
  return _localisation.decode(words, nan, names)


def _some(names: list[str], shown: int = 4) -> str:
  more = f", ... {len(names) - shown} more" if len(names) > shown else ""
  return ", ".join(names[:shown]) + more


def _names_of(params: Any) -> list[str]:
  """The leaf names of ``params`` (a pytree of arrays, or the list of names)."""
  if _is_names(params):
    return list(params)
  if (
    params is None
    or isinstance(params, (str, bytes))
    or (isinstance(params, (list, tuple)) and any(isinstance(n, str) for n in params))
  ):
    raise TypeError(
      f"params must be the parameters (a pytree of arrays) or the list of their leaf names "
      f"(strings), got {params!r} of type {type(params).__name__}."
    )
  return leaf_names(params)


def _is_names(params: Any) -> bool:
  return (
    isinstance(params, (list, tuple)) and bool(params) and all(isinstance(n, str) for n in params)
  )


def leaf_names(params: Any) -> list[str]:
  """The names :func:`nonfinite_leaves` and the metrics writer give the floating leaves of
  ``params``, in the order of the record's bits: key paths joined by ``/``
  (``"params/decoder/layers_3/attn/query/kernel"``).

  A leaf is named where it has a bit in the record: where it is floating or
  complex, by the same test that picks the leaves the finite check reads. A
  flax nnx ``Variable`` (``nnx.state(model, nnx.Param)``) is named by its own
  path, without the ``/value`` of its array (``"linear/kernel"``); an Equinox
  module's leaves by their attribute paths (``"layers/0/weight"``), its
  functions and other leaves that are not arrays having no name.
  Names are unique: a ``/`` inside a key is written ``\\/`` (and a ``\\`` as
  ``\\\\``), so a key ``'a/b'`` and the path ``a``, ``b`` differ, and a name that
  would still repeat an earlier one gets ``#k`` appended, ``k`` its leaf index.

  Args:
    params: a pytree of arrays or ``jax.ShapeDtypeStruct``; ``None`` leaves and
      leaves that are not floating point (integer, bool) have no bit and no name.

  Returns:
    A list of ``"a/b/c"`` key-path names (``str``), one per floating leaf.

  Example:
    >>> import jax.numpy as jnp, optax_dls
    >>> optax_dls.leaf_names({'dense': {'kernel': jnp.ones(2), 'bias': jnp.ones(1)}})
    ['dense/bias', 'dense/kernel']
  """
  return _labels.leaf_names(params)


def reset_scale(opt_state: Any, value: Any, *, tx: Any = None) -> Any:
  """Returns ``opt_state`` with the loss scale set to ``value``.

  The policy state restarts its growth count (each node of it that defines
  ``after_scale_reset()``, as the built-in policies' states do); every other
  field, the inner state included, is kept. The state holds no scale range
  (that belongs to the transformation): with ``tx``, the loss-scaled
  transformation the state is for (by default a flax ``TrainState``'s own
  ``tx``), a static ``value`` outside its policy's
  ``[min_scale, max_scale]`` raises and a traced one is clamped into it;
  without ``tx`` the value is only checked to be a valid scale, and the next
  update of the transformation keeps the scale it leaves within its range
  (the loss of that step is scaled by ``value`` and unscaled by it too). A
  traced NaN makes the next step skip and restart from the policy's initial
  scale. A state stacked by ``jax.vmap(tx.init)`` (an ensemble) takes one
  ``value`` for every member, or one per member (an array of the stacked
  shape).

  Args:
    opt_state: an optimizer state holding exactly one :class:`LossScaleState`.
    value: the new loss scale: a real number, or a float array (traced or not)
      of shape ``()`` or of the state's ``loss_scale`` shape, in
      ``[2**-126, 2**126]`` (and in ``tx``'s range when given).
    tx: optional, the loss-scaled transformation (what :func:`loss_scaled`,
      :func:`dynamic_loss_scale`, ... return) whose range ``value`` is checked
      against. Default None.

  Raises:
    ValueError: a static ``value`` that is NaN, not finite, not > 0, outside
      ``[2**-126, 2**126]``, or outside ``tx``'s ``[min_scale, max_scale]``;
      a ``value`` of another shape; none or more than one loss-scale state in
      ``opt_state``.
    TypeError: ``value`` not a real number; ``tx`` not a loss-scaled
      transformation.

  Returns:
    A new ``opt_state`` of the same structure and dtypes (each leaf in the
    wrapper it had, e.g. an ``nnx.Variable``); ``opt_state`` itself is not
    changed.

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> state = optax_dls.dynamic_loss_scale(optax.sgd(0.1)).init({'w': jnp.ones(2)})
    >>> optax_dls.loss_scale(optax_dls.reset_scale(state, 2.0**12))
    Array(4096., dtype=float32)
  """
  state = find_state(opt_state)
  low, high = scale_range(opt_state, tx)
  shape = jnp.shape(state.loss_scale)
  if np.ndim(value) and not isinstance(value, jax.core.Tracer):
    values = np.asarray(value)
    if values.shape != shape:
      raise ValueError(
        f"value must be a number or an array of the loss scale's shape {shape}, got shape "
        f"{values.shape}."
      )
    for v in values.reshape(-1):
      _validation.scale("value", v, low, high)
  elif isinstance(value, jax.core.Tracer):
    if value.shape not in ((), shape):
      raise ValueError(
        f"value must be a scalar or of the loss scale's shape {shape}, got a traced value "
        f"{value!r} of shape {value.shape}."
      )
  else:
    value = _validation.scale("value", value, low, high)
  scale = jnp.clip(jnp.asarray(value, jnp.float32), np.float32(low), np.float32(high))
  scale = jnp.broadcast_to(scale, shape)
  restarts = lambda n: hasattr(n, "after_scale_reset")
  policy_state = jax.tree.map(
    lambda n: n.after_scale_reset() if restarts(n) else n, state.policy_state, is_leaf=restarts
  )
  return replace_state(opt_state, state._replace(loss_scale=scale, policy_state=policy_state))


def scale_range(opt_state: Any, tx: Any = None) -> tuple[float, float]:
  """``[min_scale, max_scale]`` of ``tx``'s policy (by default the ``tx`` of ``opt_state``
  when it is a flax ``TrainState`` of a loss-scaled transformation); every valid scale
  without one."""
  tx = loss_scaled_tx(opt_state, tx)
  if tx is None:
    return _validation.SCALE_MIN, _validation.SCALE_MAX
  return tx.scaler.scale_range


def loss_scaled_tx(owner: Any, tx: Any, required: bool = False) -> Any:
  """``tx`` when it is a loss-scaled transformation (TypeError otherwise); given None, the
  ``tx`` of ``owner`` (a flax ``TrainState``) when that one is, else None (TypeError when
  ``required``)."""
  if tx is None and not required:
    tx = getattr(owner, "tx", None)
    return tx if getattr(tx, "scaler", None) is not None else None
  if getattr(tx, "scaler", None) is None:
    raise TypeError(
      f"tx must be the loss-scaled transformation the state is for (what "
      f"optax_dls.dynamic_loss_scale, static_loss_scale or no_loss_scale return), got {tx!r}."
    )
  return tx


def replace_state(opt_state: Any, new: LossScaleState) -> Any:
  """``opt_state`` with its one :class:`LossScaleState` replaced by ``new`` (a state of
  the same structure, as :func:`find_state` returns it: each leaf keeps the dtype and
  the wrapper, e.g. an ``nnx.Variable``, of the leaf it replaces)."""

  def put(node: Any) -> Any:
    if not isinstance(node, LossScaleState):
      return node
    old_leaves, treedef = jax.tree.flatten(node, is_leaf=_is_variable)
    return jax.tree.unflatten(
      treedef, [_like(o, n) for o, n in zip(old_leaves, jax.tree.leaves(new))]
    )

  return jax.tree.map(put, opt_state, is_leaf=lambda x: isinstance(x, LossScaleState))


def _is_variable(x: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(x, nnx.Variable)


def _like(old: Any, new: Any) -> Any:
  """``new`` in ``old``'s place: same dtype, and same wrapper (an nnx Variable) if any."""
  dtype = jnp.result_type(jax.tree.leaves(old)[0])
  return jax.tree.unflatten(jax.tree.structure(old), [jnp.asarray(new, dtype)])
