"""Alerts on repeated skips, raised on the host from :func:`optax_dls.metrics`."""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping
from typing import Any

import jax

from optax_dls._util import validation as _validation

logger = logging.getLogger("optax_dls")


class SkipAlerts:
  """Logs a warning when skipped steps pile up, read from :func:`optax_dls.metrics`.

  Warns (``optax_dls`` logger, process 0 only) once per run of consecutive skips: after
  ``alert_after`` of them, and at a skip at the policy's minimum scale (reported by the
  :func:`fp32_fallback` wrapper's ``skips_at_min_scale``). A run shorter than the gap between two
  calls can go unseen. :func:`optax_dls.locate` on that step's batch names what overflowed.

  Args:
    alert_after: int in [1, 2**31 - 1], consecutive skips that raise the first alert. Default 3.

  Raises:
    TypeError: ``alert_after`` is not an integer (a bool or a float is not one).
    ValueError: ``alert_after`` is outside [1, 2**31 - 1].

  Example:
    >>> import jax.numpy as jnp, optax, optax_dls
    >>> alerts = optax_dls.SkipAlerts(alert_after=2)
    >>> tx = optax_dls.dynamic_loss_scale(optax.sgd(0.1))
    >>> state = tx.init({'w': jnp.ones(1)})
    >>> for step in range(3):
    ...   _, state = tx.update({'w': jnp.array([jnp.inf])}, state)
    ...   fired = alerts(step, optax_dls.metrics(state))
    >>> fired
    []
    >>> len(alerts.fired), alerts.fired[0].split(';')[0]
    (1, 'optax_dls: 2 consecutive skipped steps (non-finite gradients) at step 1')
  """

  def __init__(self, alert_after: int = 3):
    self.alert_after = _validation.count("alert_after", alert_after)
    self.fired: list[str] = []
    self._episode = {"skips": None, "at_min": None}

  def __call__(self, step: int, metrics: Mapping[str, Any]) -> list[str]:
    """Checks the metrics of ``step`` and logs what fires now.

    Args:
      step: int, the training step the metrics belong to (shown in the message).
      metrics: :func:`optax_dls.metrics` of the optimizer state after that step.

    Returns:
      The messages logged by this call (also appended to ``self.fired``).

    Raises:
      TypeError: ``step`` not an int, ``metrics`` not a mapping.
      KeyError: ``metrics`` lacks ``consecutive_skips``, ``skip_count`` or ``loss_scale``.
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
      raise TypeError(f"step must be an int, got {step!r} of type {type(step).__name__}.")
    if not isinstance(metrics, Mapping):
      raise TypeError(f"metrics must be a mapping (optax_dls.metrics(opt_state)), got {metrics!r}.")
    m = jax.device_get(
      {k: metrics[k] for k in ("consecutive_skips", "skip_count", "loss_scale")}
      | {k: metrics[k] for k in ("skips_at_min_scale",) if k in metrics}
    )
    consecutive, scale = int(m["consecutive_skips"]), float(m["loss_scale"])
    episode = int(m["skip_count"]) - consecutive  # skips before this episode: names it
    messages = []
    if consecutive >= self.alert_after and self._episode["skips"] != episode:
      self._episode["skips"] = episode
      messages.append(
        f"optax_dls: {consecutive} consecutive skipped steps (non-finite gradients) at step "
        f"{step}; loss scale now {scale:g}. See docs/observability.md for what to check."
      )
    if int(m.get("skips_at_min_scale", 0)) >= 1 and self._episode["at_min"] != episode:
      self._episode["at_min"] = episode
      messages.append(
        f"optax_dls: loss scale stuck at its minimum {scale:g}: step {step} was non-finite even at "
        f"the minimum scale ({consecutive} consecutive skips). The overflow is not caused by the "
        "loss scale: check the data, the learning rate, the forward pass, or use the float32 "
        "fallback."
      )
    if jax.process_index() == 0:
      for message in messages:
        logger.warning(message)
    self.fired.extend(messages)
    return messages
