"""nemo_rcgrpo: reward-conditioned GRPO for multi-turn tool-calling agents."""

__version__ = "0.1.0"
