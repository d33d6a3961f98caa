"""Environments (one instance per rollout)."""
