"""An FSDP trainer with dynamic loss scaling, laid out as a real trainer is (as nanodo is).

    python examples/fsdp_trainer.py      # about 20 s on 2 CPU cores

A byte-level decoder-only transformer (flax linen, ``examples/lm/model.py``: 2 layers,
width 64, 256 tokens, 32-byte context) trains on the Python reference manual in float16
compute over float32 master parameters, on 8 virtual CPU devices, under
``jax_numpy_rank_promotion="raise"``:

* the mesh is ``jax.make_mesh((2, 4), ("data", "fsdp"))`` with Auto axes: the batch is
  split over both axes, each weight matrix along its largest dimension over "fsdp" (its
  Adam moments and accumulated gradients with it), vectors and scalars replicated, and the
  compiler gathers the weights where the model uses them. Not JAX's default Explicit axes:
  there flax linen's ``nn.Embed`` (``jnp.take`` of the table by batch-sharded tokens)
  raises a ``ShardingTypeError`` asking for the gather's ``out_sharding``;
* the state is a flax ``TrainState`` built by a jitted init, its shardings read from
  ``jax.eval_shape`` of that init; the optimizer is
  ``dynamic_loss_scale(optax.MultiSteps(optax.adamw(...), every_k_schedule=2))``;
* the step is jitted with ``in_shardings``, ``out_shardings`` and the state donated, its
  loss scaled by ``optax_dls.flax.value_and_grad``;
* step 5 puts an inf in the loss weights of one device's rows: the gradients overflow,
  every device skips the step (parameters and optimizer state kept bit for bit) and the
  scale backs off; it grows back after 6 clean micro-batches;
* the state after step 10 is saved with Orbax and restored with
  ``optax_dls.checkpoint.restore`` into an abstract target with the same shardings; steps
  11-20 run again from it and end on the uninterrupted run's state, bit for bit.
"""

import jax

if jax.config.jax_num_cpu_devices != 8:  # unless already set (by a test session)
  jax.config.update("jax_num_cpu_devices", 8)  # before any other JAX call
jax.config.update("jax_numpy_rank_promotion", "raise")

import tempfile

import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from lm.data import batch_starts, default_text, gather, split_bytes
from lm.model import Transformer
from lm.precision import FP16

import optax_dls
import optax_dls.checkpoint
import optax_dls.flax

STEPS, INF_STEP, SAVE_STEP, BATCH, SEQ = 20, 5, 10, 16, 32
MODEL = Transformer(d_model=64, num_layers=2, num_heads=4, max_len=SEQ, precision=FP16)


def init(key):
  params = MODEL.init(key, jnp.zeros((1, SEQ), jnp.int32))["params"]
  inner = optax.MultiSteps(optax.adamw(3e-3, weight_decay=0.1), every_k_schedule=2)
  tx = optax_dls.dynamic_loss_scale(inner, growth_interval=6)  # counts micro-batches
  return train_state.TrainState.create(apply_fn=MODEL.apply, params=params, tx=tx)


def fsdp(mesh, x):
  """A matrix split along its largest dimension over "fsdp"; vectors and scalars replicated."""
  spec = [None] * x.ndim
  if x.ndim >= 2:
    spec[int(np.argmax(x.shape))] = "fsdp"
  return NamedSharding(mesh, P(*spec))


def loss_fn(params, apply_fn, batch):
  logits = apply_fn({"params": params}, batch["tokens"][:, :-1])  # float32 logits
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
  return jnp.mean(losses * batch["weights"])


grad_fn = optax_dls.flax.value_and_grad(loss_fn)  # differentiates S * loss


def train_step(state, batch):
  (loss, grads), state = grad_fn(state, state.params, state.apply_fn, batch)
  state = state.apply_gradients(grads=grads)  # unscale, check, skip, adapt
  m = optax_dls.metrics(state)
  return state, {"loss": loss, "loss_scale": m["loss_scale"], "skipped": m["skipped"]}


def batches(steps):
  """``{step: {"tokens", "weights"}}``, steps from 1: byte windows of the manual."""
  data, _ = split_bytes(default_text(), SEQ + 1)
  starts = batch_starts(data.size, SEQ + 1, steps, BATCH, seed=0)
  out = {}
  for i, s in enumerate(starts, start=1):
    weights = np.ones((BATCH, SEQ), np.float32)
    if i == INF_STEP:
      weights[13, 0] = np.inf  # row 13: in one device's 2 rows only
    out[i] = {"tokens": gather(data, s, SEQ + 1), "weights": weights}
  return out


def host(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def same_bits(a, b):
  return all(x.tobytes() == y.tobytes() for x, y in zip(host(a), host(b), strict=True))


def main(ckpt_dir=None):
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  abstract = jax.eval_shape(init, jax.random.key(0))
  shardings = jax.tree.map(lambda x: fsdp(mesh, x), abstract)
  state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
  on_devices = NamedSharding(mesh, P(("data", "fsdp")))  # the batch split 8 ways
  step = jax.jit(
    train_step,
    in_shardings=(shardings, on_devices),
    out_shardings=(shardings, NamedSharding(mesh, P())),
    donate_argnums=0,
  )
  emb = lambda tree: tree["Embed_0"]["embedding"].sharding.spec
  adam = state.opt_state.inner_state.inner_opt_state[0]  # loss scale > MultiSteps > adamw
  print(
    f"embedding {emb(state.params)}, its Adam moment {emb(adam.mu)}, "
    f"loss scale {state.opt_state.loss_scale.sharding.spec}"
  )
  data, manager = batches(STEPS), ocp.CheckpointManager(ckpt_dir or tempfile.mkdtemp())

  def run(state, first, log, verbose):
    for i in range(first, STEPS + 1):
      kept = host((state.params, state.opt_state.inner_state)) if i == INF_STEP else None
      state, m = step(state, data[i])
      log.append({k: v.item() for k, v in m.items()})
      if kept is not None:  # a copy: the state was donated
        log[-1]["kept"] = same_bits(kept, (state.params, state.opt_state.inner_state))
        log[-1]["devices"] = sum(bool(s.data) for s in m["skipped"].addressable_shards)
      if i == SAVE_STEP:
        manager.save(i, args=ocp.args.StandardSave(state))  # copied to host: donation is safe
      if verbose:
        r = log[-1]
        print(
          f"step {i:2d}  loss {r['loss']:7.4f}  next loss scale {r['loss_scale']:6.0f}  "
          f"skipped {r['skipped']}" + ("  <- inf in one shard" if i == INF_STEP else "")
        )
    return state

  logs = []
  state = run(state, 1, logs, verbose=True)
  at_skip = logs[INF_STEP - 1]
  print(
    f"step {INF_STEP}: skipped on {at_skip['devices']} of {mesh.size} devices, parameters "
    f"and optimizer state kept bit for bit: {at_skip['kept']}"
  )

  manager.wait_until_finished()
  # The abstract state with its shardings; weak types kept (TrainState.step, the Python int
  # 0), so that the restored state has the step's types and compiles no second program.
  sharded = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type)
  target = jax.tree.map(sharded, abstract, shardings)
  restored = optax_dls.checkpoint.restore(manager, target, step=SAVE_STEP)
  manager.close()
  resumed = run(restored, SAVE_STEP + 1, [], verbose=False)
  resumed_equal = same_bits(resumed, state)
  print(f"resumed at step {SAVE_STEP + 1}: step {STEPS} equal bit for bit: {resumed_equal}")
  return {
    "final_loss": logs[-1]["loss"],
    "losses": [r["loss"] for r in logs],
    "skipped_steps": [i for i, r in enumerate(logs, start=1) if r["skipped"]],
    "loss_scales": [r["loss_scale"] for r in logs],
    "kept_at_skip": at_skip["kept"],
    "devices_skipped": at_skip["devices"],
    "resumed_equal": resumed_equal,
    "programs": step._cache_size(),
  }


if __name__ == "__main__":
  main()
