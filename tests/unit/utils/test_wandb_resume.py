"""W&B: a resumed run continues the same W&B run; name, entity, group and tags are settable."""

import re

from nemo_rcgrpo.config_schema import WandbConfig
from nemo_rcgrpo.utils.logging import MetricsLogger, wandb_init_args


def test_init_args_keep_one_id_per_run_folder(tmp_path):
    cfg = WandbConfig(enabled=True, mode="offline", entity="team", name="exp1", group="g", tags=("a", "b"))
    (tmp_path / "r").mkdir()
    first = wandb_init_args(cfg, tmp_path / "r", {}, 0)
    again = wandb_init_args(cfg, tmp_path / "r", {}, 5)
    assert first["id"] == again["id"] and len(first["id"]) == 16 and first["resume"] == "allow"
    assert (first["entity"], first["name"], first["group"], first["tags"]) == ("team", "exp1", "g", ["a", "b"])
    (tmp_path / "s").mkdir()
    other = wandb_init_args(WandbConfig(enabled=True), tmp_path / "s", {}, 0)
    assert other["id"] != first["id"] and other["name"] == "s" and other["tags"] is None


def test_a_resumed_run_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = WandbConfig(enabled=True, mode="offline")
    run = tmp_path / "run"
    for step in (1, 2):  # two invocations of one run
        logger = MetricsLogger(run, tensorboard=False, wandb_cfg=cfg, resume_step=step - 1)
        logger.log(step, {"loss": 1.0 / step})
        logger.close()
    runs = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    wanted = (run / "wandb_id").read_text().strip()
    # offline-run-<time>-<id>; two invocations within one second get "-1" after the second folder's name
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{wanted}(-\d+)?", n) for n in runs), runs
