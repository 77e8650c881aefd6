"""Sharded fp16 training with dynamic loss scaling on 8 virtual CPU devices.

Data-parallel plus sharded parameters (FSDP-style) under ``jax.jit`` with
``NamedSharding``: the batch is split over the "data" mesh axis, the weight
matrices (and with them the gradients and Adam's moments) over "data" and
"model". No ``axis_name`` is needed: under jit the all-finite check is one
global reduction, so every device takes the same skip decision and the
loss-scale state stays replicated. The first steps overflow fp16 for real
(the initial scale is too large) and back the scale off; step 12 feeds a batch
with an inf in one data shard only, and every device skips it.

Run: python examples/sharded_training.py   (about 10 s on a laptop CPU)
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any other JAX call

import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_dls

STEPS, INF_STEP, BATCH, D_IN, D_HIDDEN = 24, 12, 64, 32, 64


def main():
  # Auto axes: the compiler propagates shardings through the model (classic pjit).
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  print(f"mesh: {dict(mesh.shape)} over {mesh.devices.size} devices")
  shard = lambda spec: NamedSharding(mesh, spec)

  # fp32 master parameters, sharded like FSDP (rows over "data") plus tensor
  # parallelism (hidden units over "model").
  param_specs = {"w1": P("data", "model"), "b1": P("model"), "w2": P("model", None)}
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  params = {
    "w1": jax.random.normal(k1, (D_IN, D_HIDDEN)) / np.sqrt(D_IN),
    "b1": jnp.zeros((D_HIDDEN,)),
    "w2": jax.random.normal(k2, (D_HIDDEN, 1)) / np.sqrt(D_HIDDEN),
  }
  params = jax.device_put(params, jax.tree.map(shard, param_specs))
  true_w = jax.random.normal(k3, (D_IN, 1))

  tx = optax_dls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**15, growth_interval=4)
  state_specs = optax.tree_map_params(
    tx,
    lambda _, s: s,
    tx.init(params),
    param_specs,
    transform_non_params=lambda _: P(),
    is_leaf=lambda x: isinstance(x, P),
  )
  opt_state = jax.jit(tx.init, out_shardings=jax.tree.map(shard, state_specs))(params)

  def loss_fn(p, x, y, opt_state):
    h = jax.nn.relu(
      x.astype(jnp.float16) @ p["w1"].astype(jnp.float16) + p["b1"].astype(jnp.float16)
    )
    pred = (h @ p["w2"].astype(jnp.float16)).astype(jnp.float32)  # fp16 compute, fp32 loss
    loss = jnp.mean((pred - y) ** 2)
    return optax_dls.scale_loss(loss, opt_state), loss

  @jax.jit
  def train_step(params, opt_state, x, y):
    grads, loss = jax.grad(loss_fn, has_aux=True)(params, x, y, opt_state)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  print("parameter shardings:", {k: v.sharding.spec for k, v in params.items()})
  print(
    "Adam first moment:  ", {k: v.sharding.spec for k, v in opt_state.inner_state[0].mu.items()}
  )
  print("loss scale:          ", opt_state.loss_scale.sharding.spec, "(replicated)")

  for step in range(STEPS):
    x = np.array(jax.random.normal(jax.random.key(100 + step), (BATCH, D_IN)))
    if step == INF_STEP:
      x[40, 0] = np.inf  # batch row 40: in data shard 2 of 4 only
    y = x @ np.asarray(true_w)
    x, y = jax.device_put((x, y), shard(P("data")))
    scale = float(optax_dls.find_state(opt_state).loss_scale)
    params, opt_state, loss = train_step(params, opt_state, x, y)
    logs = optax_dls.metrics(opt_state)
    note = ""
    if bool(logs["skipped"]):
      why = "the injected inf" if step == INF_STEP else "fp16 overflow"
      note = f"  <- {why}: skipped on every device"
    print(
      f"step {step:2d}  loss {float(loss):10.4f}  loss scale {scale:8.0f} -> "
      f"{float(logs['loss_scale']):8.0f}  skipped {int(logs['skip_count'])}{note}"
    )

  print("parameter shardings after training:", {k: v.sharding.spec for k, v in params.items()})
  print("loss scale sharding after training:", opt_state.loss_scale.sharding.spec)


if __name__ == "__main__":
  main()
