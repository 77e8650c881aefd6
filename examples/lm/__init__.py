"""Helpers of examples/train_lm.py: precision policy, model, data, report."""
