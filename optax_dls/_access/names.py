"""The names of the gradient leaves that were not finite, and of every floating leaf."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from optax_dls._access.find import find_state
from optax_dls._core import labels as _labels
from optax_dls._core import record as _record
from optax_dls._util import model as _model


def nonfinite_leaves(opt_state: Any, params: Any) -> dict[str, str]:
  """Names the gradient leaves that were not finite on the last non-finite step.

  Host side. Every floating or complex leaf is named, in leaf order, by its key path joined by
  ``/`` (``"decoder/layers_3/attn/query/kernel"``), as the metrics writer writes it; an nnx
  ``Variable`` or linen box adds no ``/value``; an Equinox module's arrays are named by attribute
  path (``"layers/0/weight"``), its other leaves unnamed. A ``/`` inside a key is written ``\\/``
  (``\\`` as ``\\\\``); a name repeating an earlier one gets ``#k``, ``k`` its leaf index.

  Args:
    opt_state: an optimizer state holding one :class:`LossScaleState`, or the dict :func:`metrics`
      returns (device or host values).
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``; only the tree and the dtypes are
      read), or the list of leaf names.

  Returns:
    ``{name: "inf" | "nan"}`` (``"nan"`` where it held a NaN); empty before any non-finite step.

  Raises:
    TypeError: ``params`` is neither a pytree of arrays nor a list of names.
    ValueError: ``opt_state`` holds none or several loss-scale states; ``params`` has another number
      of floating leaves than the state was built for (for a :func:`metrics` dict: as many 32-bit
      words, a leaf per bit set); or the state is stacked (``jax.vmap(tx.init)``).

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> params = {'dense': {'kernel': jnp.ones(2), 'bias': jnp.ones(1)}}
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
    >>> grads = {'dense': {'kernel': jnp.array([1.0, jnp.nan]), 'bias': jnp.ones(1)}}
    >>> _, state = tx.update(grads, tx.init(params), params)
    >>> optax_dls.nonfinite_leaves(state, params)
    {'dense/kernel': 'nan'}
  """
  names = _names_of(params)
  if isinstance(opt_state, dict) and "nonfinite_leaves" in opt_state:
    words = np.asarray(jax.device_get(opt_state["nonfinite_leaves"]))
    nan = np.asarray(jax.device_get(opt_state["nonfinite_nan"]))
    _check_stacked(words.shape[:-1])
    n = words.shape[-1] * 32
    bad, is_nan = _record.unpack(words, n), _record.unpack(nan, n)
    set_bits = np.flatnonzero(bad | is_nan)
    if _record.num_words(len(names)) != words.shape[-1] or (
      set_bits.size and set_bits[-1] >= len(names)
    ):
      raise ValueError(
        f"params has {len(names)} floating leaves, which do not fit the record (made for "
        f"{32 * (words.shape[-1] - 1) + 1} to {32 * words.shape[-1]} leaves; leaf "
        f"{int(set_bits[-1]) if set_bits.size else 0} is recorded): pass the parameters the "
        "state was built for."
      )
    codes = np.where(is_nan, 2, bad.astype(np.int32))[: len(names)]
  else:
    record = np.asarray(jax.device_get(find_state(opt_state).nonfinite))
    _check_stacked(record.shape[:-1])
    codes = record[:-2]
    if codes.shape[0] != len(names):
      more = f", ... {len(names) - 4} more" if len(names) > 4 else ""
      raise ValueError(
        f"params is not the tree the state was built for: it has {len(names)} floating "
        f"leaves ({', '.join(names[:4])}{more}) and the state records {codes.shape[0]}: pass the "
        "parameters given to tx.init, or their leaf names."
      )
  return {n: ("nan" if c == 2 else "inf") for n, c in zip(names, codes) if c}


def _check_stacked(batch: tuple[int, ...]) -> None:
  if batch:
    raise ValueError(
      f"opt_state is stacked: its record of non-finite leaves has {batch} leading "
      f"dimensions (one row per member, as jax.vmap(tx.init) makes it), and names are "
      f"given one member at a time: nonfinite_leaves(jax.tree.map(lambda x: x[i], "
      f"opt_state), params) for member i of {batch[0]}."
    )


def _names_of(params: Any) -> list[str]:
  """The leaf names of ``params`` (a pytree of arrays, or the list of names)."""
  strings = isinstance(params, (list, tuple)) and [isinstance(n, str) for n in params]
  if strings and all(strings):
    return list(params)
  if params is None or isinstance(params, (str, bytes)) or (strings and any(strings)):
    raise TypeError(
      f"params must be the parameters (a pytree of arrays) or the list of their leaf names "
      f"(strings), got {params!r} of type {type(params).__name__}."
    )
  return leaf_names(params)


def leaf_names(params: Any) -> list[str]:
  """The names :func:`~optax_dls.nonfinite_leaves` gives the floating leaves of ``params``."""
  return _labels.leaf_names(_model.arrays_of_modules(params))
