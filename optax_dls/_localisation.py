"""Where a non-finite step came from: which gradient leaves held an inf or a NaN.

The finite check reduces every floating gradient leaf; each update keeps, for
the last non-finite step, one bit per leaf for "not finite" and one for "held a
NaN" (an inf only, when clear), packed into ``uint32`` words, and whether the
loss handed to ``update`` was itself not finite. Leaf ``k`` is the ``k``-th
floating leaf of the gradients in ``jax.tree.leaves`` order, the same order as
the floating leaves of the parameters. The names are made here, on the host,
from the parameters' key paths; nothing of them enters the compiled step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WORD_BITS = 32


def num_words(num_leaves: int) -> int:
  """``uint32`` words holding one bit per leaf (at least one, so the record is never empty)."""
  return max(1, -(-num_leaves // WORD_BITS))


def pack(flags: Sequence[jax.Array]) -> jax.Array:
  """uint32 ``[num_words(len(flags))]``: bit ``k % 32`` of word ``k // 32`` set where ``flags[k]``."""
  words = num_words(len(flags))
  if not flags:
    return jnp.zeros([words], jnp.uint32)
  bits = jnp.stack([jnp.asarray(f, jnp.uint32) for f in flags])
  bits = jnp.pad(bits, (0, words * WORD_BITS - len(flags))).reshape(words, WORD_BITS)
  return jnp.sum(bits << jnp.arange(WORD_BITS, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def unpack(words: Any, num_leaves: int) -> np.ndarray:
  """bool ``[num_leaves]`` from the packed words (host side, NumPy)."""
  words = np.asarray(words, np.uint32).reshape(-1)
  bits = (words[:, None] >> np.arange(WORD_BITS, dtype=np.uint32)) & 1
  return bits.reshape(-1)[:num_leaves].astype(bool)


def _key_text(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key).strip(".[]'\"")


def path_name(path: Sequence[Any]) -> str:
  """A key path as ``"params/decoder/layers_3/attn/query/kernel"``."""
  return "/".join(_key_text(k) for k in path)


def _is_float(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    dtype = jnp.result_type(x) if x is not None else None
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def leaf_names(tree: Any) -> list[str]:
  """The names of the floating leaves of ``tree`` (parameters, gradients or their shapes),
  in the order of the bits of the non-finite record.

  Args:
    tree: a pytree of arrays or ``jax.ShapeDtypeStruct``; ``None`` leaves and
      leaves that are not floating point (integer, bool) have no bit and no name.

  Returns:
    A list of ``"a/b/c"`` key-path names, one per floating leaf.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_dls import _localisation
    >>> _localisation.leaf_names({'dense': {'kernel': jnp.ones(2), 'bias': jnp.ones(1)}})
    ['dense/bias', 'dense/kernel']
  """
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return [path_name(path) for path, x in leaves if _is_float(x)]


def decode(leaves: Any, nan: Any, names: Sequence[str]) -> dict[str, str]:
  """``{name: "inf" | "nan"}`` for each leaf whose bit is set in ``leaves`` (host side).

  Args:
    leaves: the packed "not finite" words (uint32 ``[W]``, device or host).
    nan: the packed "held a NaN" words, same shape.
    names: the leaf names, as :func:`leaf_names` gives them.

  Returns:
    The non-finite leaves in leaf order: ``"nan"`` where the leaf held a NaN,
    ``"inf"`` where it held only infinities.
  """
  bad = unpack(leaves, len(names))
  has_nan = unpack(nan, len(names))
  return {name: ("nan" if n else "inf") for name, b, n in zip(names, bad, has_nan) if b}
