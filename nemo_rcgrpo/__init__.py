"""nemo_rcgrpo: reward-conditioned GRPO for multi-turn tool-calling agents.

``from nemo_rcgrpo import register``: the decorator that adds a part (advantage baseline, KL estimator, reward-token
sampler, generator, ...) under a name the config can choose (`nemo_rcgrpo.registry`).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "register":  # imported on use: `import nemo_rcgrpo` stays light
        from nemo_rcgrpo.registry import register

        return register
    raise AttributeError(f"module 'nemo_rcgrpo' has no attribute {name!r}")
