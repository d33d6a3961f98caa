"""Evaluation on BFCL v4 multi-turn: `rcgrpo eval` (run.py) and `rcgrpo compare` (compare.py)."""
