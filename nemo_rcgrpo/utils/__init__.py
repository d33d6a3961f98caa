"""Utilities: configuration, checkpoints, logging, distributed helpers."""
