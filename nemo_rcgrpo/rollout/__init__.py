"""Rollouts: multi-turn episodes between a generator and environments."""
