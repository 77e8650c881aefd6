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

import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

WORD_BITS = 32


def num_words(num_leaves: int) -> int:
  """``uint32`` words holding one bit per leaf (at least one, so the record is never empty)."""
  return max(1, -(-num_leaves // WORD_BITS))


def pack(flags: jax.Array) -> jax.Array:
  """uint32 ``[num_words(n)]`` from bool ``[n]``: bit ``k % 32`` of word ``k // 32`` set
  where ``flags[k]``."""
  n = flags.shape[0]
  words = num_words(n)
  bits = jnp.pad(flags.astype(jnp.uint32), (0, words * WORD_BITS - n)).reshape(words, WORD_BITS)
  shifts = jnp.arange(WORD_BITS, dtype=jnp.uint32).reshape(1, WORD_BITS)  # no rank promotion
  return jnp.sum(bits << shifts, axis=1, dtype=jnp.uint32)


def unpack(words: Any, num_leaves: int) -> np.ndarray:
  """bool ``[num_leaves]`` from the packed words (host side, NumPy)."""
  words = np.asarray(words, np.uint32).reshape(-1)
  bits = (words[:, None] >> np.arange(WORD_BITS, dtype=np.uint32)) & 1
  return bits.reshape(-1)[:num_leaves].astype(bool)


def _key_text(key: Any) -> str:
  """One key of a path as text, a ``/`` or ``\\`` in it escaped by a ``\\``, so that a key
  ``'a/b'`` and the two keys ``'a'``, ``'b'`` give different names."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      text = str(getattr(key, attr))
      break
  else:
    text = str(key).strip(".[]'\"")
  return text.replace("\\", "\\\\").replace("/", "\\/")


def path_name(path: Sequence[Any]) -> str:
  """A key path as ``"params/decoder/layers_3/attn/query/kernel"`` (a ``/`` inside a key
  written ``\\/``)."""
  return "/".join(_key_text(k) for k in path)


def unique(names: Sequence[str]) -> list[str]:
  """``names`` with every repeat of an earlier name suffixed ``#k``, ``k`` its leaf index
  (two keys of one node that read alike, such as ``1`` and ``'1'``, stay apart)."""
  seen: set[str] = set()
  out = []
  for k, name in enumerate(names):
    out.append(name if name not in seen else f"{name}#{k}")
    seen.add(out[-1])
  return out


def digest(names: Sequence[str]) -> np.uint32:
  """uint32: a checksum (CRC-32) of the leaf names in order, and so of their number: the
  record keeps it to tell the parameters it was built for from others."""
  return np.uint32(zlib.crc32("\0".join(names).encode("utf-8")) & 0xFFFFFFFF)


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


class NonFiniteRecord(NamedTuple):
  """Where the last non-finite step came from, in the loss-scale state.

  Attributes:
    step: int32 ``()``: the update number (``num_steps`` after it) of the last
      non-finite step; 0 before any.
    leaves: uint32 ``[W]``: one bit per floating gradient leaf, set where that
      leaf was not finite on that step (:func:`decode` names them).
    nan: uint32 ``[W]``: set where that leaf held a NaN (clear: infinities only).
    loss: bool ``()``: whether the loss of that step was itself not finite
      (known when the loss was handed to ``update`` or ``value_and_grad``).
    overflows: dict of int32 ``()``, one per parameter-group label: the
      non-finite steps so far in which some leaf of that group was not finite
      (empty without labels). Saturating.
    names_digest: uint32 ``()``: a checksum of the names of the parameter
      leaves the state was built for (:func:`digest`), so that naming the bits
      with another tree is refused. Set by ``init``, never changed.
  """

  step: jax.Array
  leaves: jax.Array
  nan: jax.Array
  loss: jax.Array
  overflows: dict[str, jax.Array]
  names_digest: jax.Array


def init_record(names: Sequence[str], labels: Sequence[str] = ()) -> NonFiniteRecord:
  """The record before the first step for the floating leaves named ``names``: nothing
  recorded, every count 0."""
  num_leaves = len(names)
  clear = jnp.zeros([num_words(num_leaves)], jnp.uint32)
  zero = jnp.zeros([], jnp.int32)
  return NonFiniteRecord(
    step=zero,
    leaves=clear,
    nan=jnp.zeros_like(clear),
    loss=jnp.zeros([], jnp.bool_),
    overflows={label: jnp.zeros([], jnp.int32) for label in sorted(set(labels))},
    names_digest=jnp.asarray(digest(names), jnp.uint32),
  )


def group_masks(labels: Sequence[str]) -> dict[str, np.ndarray]:
  """uint32 ``[W]`` per label: the bits of the leaves labelled so (``labels``: one per leaf)."""
  masks = {}
  for label in sorted(set(labels)):
    masks[label] = _pack_host(np.array([x == label for x in labels], bool))
  return masks


def _pack_host(flags: np.ndarray) -> np.ndarray:
  words = num_words(flags.shape[0])
  bits = np.zeros(words * WORD_BITS, np.uint64)
  bits[: flags.shape[0]] = flags
  weights = np.uint64(1) << np.arange(WORD_BITS, dtype=np.uint64)
  return (bits.reshape(words, WORD_BITS) * weights).sum(axis=1).astype(np.uint32)


def recorded(
  record: NonFiniteRecord,
  finite: jax.Array,
  step: jax.Array,
  nonfinite: jax.Array,
  nan: jax.Array,
  loss_bad: jax.Array,
  masks: dict[str, np.ndarray],
) -> NonFiniteRecord:
  """``record`` after an update numbered ``step``: unchanged on a finite step; on a
  non-finite one the new bits, packed here from the check's per-leaf flags (``nonfinite``
  and ``nan``, bool ``[n]``), and ``loss`` True when ``loss_bad`` or when the record
  already says so for this very step (set before ``update`` by a recomputation that
  saw the loss not finite)."""
  keep = lambda old, new: jnp.where(finite, old, new)
  leaves, nan = pack(nonfinite), pack(nan)
  loss = loss_bad | (record.loss & (record.step == step))
  overflows = {
    label: jnp.where(
      ~finite & jnp.any((leaves & masks[label]) != 0), optax.safe_increment(count), count
    )
    for label, count in record.overflows.items()
  }
  return NonFiniteRecord(
    step=keep(record.step, step),
    leaves=keep(record.leaves, leaves),
    nan=keep(record.nan, nan),
    loss=keep(record.loss, loss),
    overflows=overflows,
    names_digest=record.names_digest,
  )
