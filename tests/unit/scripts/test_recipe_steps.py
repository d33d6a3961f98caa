"""The pure parts of scripts/bench/recipe_steps.py: it runs every shipped CPU recipe, each stage-2 recipe after the
stage-1 recipe whose export it starts from, and reads the micro-batching the RL banner states."""

from __future__ import annotations

from types import SimpleNamespace

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.recipes.rl import RLTrainer
from nemo_rcgrpo.utils.config import compose, conf_dir
from scripts.bench import recipe_steps


def test_every_shipped_cpu_recipe_runs_and_stage_1_comes_first():
    shipped = {
        p.stem for p in conf_dir().glob("*.yaml") if p.stem.endswith("_cpu") or p.stem.startswith(("smoke_", "micro_"))
    }
    listed = [*recipe_steps.STAGE1, *recipe_steps.STAGE2]
    assert set(listed) == shipped - {"eval_smollm_cpu"}
    for name in recipe_steps.STAGE2:
        cfg = TrainConfig.from_dict(compose(name, []))
        assert cfg.is_rl, name
        init = cfg.rl.stage1_recipe or cfg.model.path.split("/")[1]  # runs/<stage-1 recipe>/hf
        assert init in recipe_steps.STAGE1, name
    for name in recipe_steps.STAGE1:
        assert not TrainConfig.from_dict(compose(name, [])).is_rl, name


def test_the_banners_micro_batching_is_read_back():
    def banner(tokens):
        update = SimpleNamespace(micro_batch_tokens=tokens, micro_batch_size=2)
        return RLTrainer._micro_batching(SimpleNamespace(settings=SimpleNamespace(update=update)))

    assert recipe_steps.BUDGET.search(f"steps ...; {banner(6144)}").groups() == ("6144", None)
    assert recipe_steps.BUDGET.search(f"steps ...; {banner(None)}").groups() == (None, "2")
    update = SimpleNamespace(micro_batch_tokens=None, micro_batch_size=1)
    one = RLTrainer._micro_batching(SimpleNamespace(settings=SimpleNamespace(update=update)))
    assert one == "micro-batches of 1 rollout" and recipe_steps.BUDGET.search(one).groups() == (None, "1")
