"""Test setup: 8 virtual CPU devices, set before any JAX computation."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
