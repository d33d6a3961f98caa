"""data/stage1_datasets.py: the registered stage-1 datasets. RCTP-FT's templating puts the reward goal of a row's
outcome in its first user message: prepare-data's rows pass unchanged, rows of a user's own data that say only
``reward`` get the very text (so the very token ids) prepare-data writes, and contradictions are refused."""

import copy
import json

import pytest

from nemo_rcgrpo.config import TrainConfig
from nemo_rcgrpo.data.dataset import DataSchemaError, load_stage1
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.sft_data import build_examples, load_records
from nemo_rcgrpo.data.stage1_datasets import Prepared, Stage1Dataset, reward_conditioned, stage1_dataset
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.registry import register, table
from nemo_rcgrpo.utils.config import ConfigError, compose

GOAL = RewardGoal()


def _strip(row):
    """The row as a user might keep it: its goal text out of the first user message, no reward_goal field."""
    out = copy.deepcopy(row)
    out.pop("reward_goal", None)
    first = next(m for m in out["messages"] if m["role"] == "user")
    for success in (True, False):
        first["content"] = first["content"].replace(GOAL.separator + GOAL.text(success), "")
    return out


def test_prepare_datas_rows_pass_and_stripped_rows_get_the_same_text(micro_data_dir):
    rows = [json.loads(l) for l in (micro_data_dir / "rctp.jsonl").read_text().splitlines()][:400]
    assert {r["reward"] for r in rows} == {0, 1}
    for row in rows:
        assert reward_conditioned(row, GOAL) is row  # the goal is there and agrees with the reward
        stripped = _strip(row)
        assert stripped["messages"] != row["messages"]
        assert reward_conditioned(stripped, GOAL)["messages"] == row["messages"]
    assert stage1_dataset("sft").prepare(rows[0], GOAL) is rows[0]


def test_contradictions_and_rows_without_an_outcome_are_one_line():
    row = {"task_id": "t1", "messages": [{"role": "user", "content": "do it"}], "reward": 0}
    assert reward_conditioned(row, GOAL)["messages"][0]["content"] == "do it [Reward Goal: <|low_reward|>]"
    high = {**row, "messages": [{"role": "user", "content": "do it [Reward Goal: <|high_reward|>]"}]}
    with pytest.raises(
        DataSchemaError,
        match="row t1: the first user message holds <.high_reward.> but the row's reward says <.low_reward.>",
    ):
        reward_conditioned(high, GOAL)
    with pytest.raises(DataSchemaError, match="row t1: no reward goal in the first user message and no reward"):
        reward_conditioned({"task_id": "t1", "messages": row["messages"]}, GOAL)
    with pytest.raises(DataSchemaError, match=r"reward=2; an RCTP row's reward is 1"):
        reward_conditioned({**row, "reward": 2}, GOAL)
    later = {
        **row,
        "messages": [
            *row["messages"],
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "next [Reward Goal: <|low_reward|>]"},
        ],
    }
    with pytest.raises(DataSchemaError, match=r"row t1: messages\[2\] holds a reward goal token"):
        reward_conditioned(later, GOAL)
    in_system = {**row, "messages": [{"role": "system", "content": "[Reward Goal: <|high_reward|>]"}, *row["messages"]]}
    with pytest.raises(DataSchemaError, match=r"row t1: messages\[0\] holds a reward goal token"):
        reward_conditioned(in_system, GOAL)
    both = {**row, "messages": [{"role": "user", "content": "x <|high_reward|> <|low_reward|>"}]}
    with pytest.raises(DataSchemaError, match="holds both reward tokens"):
        reward_conditioned(both, GOAL)
    with pytest.raises(DataSchemaError, match="no user message"):
        reward_conditioned({"task_id": "t1", "messages": [{"role": "system", "content": "s"}], "reward": 1}, GOAL)
    # the row's reward_goal field alone decides when there is no reward
    said = {"task_id": "t1", "messages": row["messages"], "reward_goal": "<|high_reward|>"}
    assert reward_conditioned(said, GOAL)["messages"][0]["content"].endswith("<|high_reward|>]")


def test_a_users_parquet_without_goals_gives_prepare_datas_token_ids(micro_data_dir, tmp_path):
    """RCTP rows kept as a user keeps them (reward only) in Parquet, read through the rctp dataset: the token ids
    are those of prepare-data's rows."""
    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    renderer = ChatRenderer(tok, "hermes", tool_description="compact")
    lines = [json.loads(l) for l in (micro_data_dir / "rctp.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["split"] == "train"][:200]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(_strip(r)) + "\n" for r in train))
    load_stage1(path, "all").to_parquet(str(tmp_path / "mine.parquet"))
    rows = load_records(tmp_path / "mine.parquet", "train")

    def ids(records):
        return [(e.task_id, e.ids, e.mask) for e in build_examples(records, renderer, 1024, 3, None)[0]]

    expected = ids(train)
    assert ids(Prepared(rows, stage1_dataset("rctp"), GOAL)) == expected
    assert ids(rows) != expected  # without the templating the goals are missing


def test_data_dataset_is_validated_and_a_plugin_dataset_is_chosen_by_name():
    cfg = TrainConfig.from_dict(compose("smoke_stage1", []))
    assert cfg.stage == "rctp" and cfg.stage1_dataset_name == "rctp"
    assert TrainConfig.from_dict(compose("smoke_stage1", ["stage=sft"])).stage1_dataset_name == "sft"
    with pytest.raises(ConfigError, match="data.dataset=sft: stage=rctp trains on a reward-conditioned dataset"):
        TrainConfig.from_dict(compose("smoke_stage1", ["data.dataset=sft"]))
    with pytest.raises(ConfigError, match="data.dataset=rctp: stage=sft trains on an unconditioned dataset"):
        TrainConfig.from_dict(compose("smoke_stage1", ["stage=sft", "data.dataset=rctp"]))
    with pytest.raises(
        ConfigError, match=r"data.dataset='nope': no stage1_dataset of that name; registered: \['sft', 'rctp'"
    ):
        TrainConfig.from_dict(compose("smoke_stage1", ["data.dataset=nope"]))
    register("stage1_dataset", "test_no_system")(
        Stage1Dataset(lambda r, goal: {**r, "messages": [m for m in r["messages"] if m["role"] != "system"]})
    )
    try:
        cfg = TrainConfig.from_dict(compose("smoke_stage1", ["stage=sft", "data.dataset=test_no_system"]))
        row = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
        assert stage1_dataset(cfg.stage1_dataset_name).prepare(row, GOAL)["messages"] == row["messages"][1:]
    finally:
        table("stage1_dataset").pop("test_no_system")


def test_rctp_ft_on_rows_without_goals_trains_as_on_prepare_datas(micro_data_dir, tmp_path):
    """The stage-1 loop reads through the stage's dataset: RCTP-FT from a user's JSONL of goal-less rows takes the
    same first step (loss, tokens) as from prepare-data's rctp.jsonl."""
    import shutil

    from nemo_rcgrpo.train import main
    from nemo_rcgrpo.utils.logging import read_metrics

    data = tmp_path / "data"
    shutil.copytree(micro_data_dir, data)
    rows = [json.loads(l) for l in (data / "rctp.jsonl").read_text().splitlines()]
    (data / "mine.jsonl").write_text("".join(json.dumps(_strip(r)) + "\n" for r in rows))
    firsts = []
    for name in ("rctp.jsonl", "mine.jsonl"):
        run = tmp_path / name
        assert (
            main(
                [
                    "--config-name=micro_rctp",
                    f"data.dir={data}",
                    f"data.file={name}",
                    f"run_dir={run}",
                    "trainer.max_steps=1",
                    "trainer.global_batch_size=4",
                    "trainer.micro_batch_size=4",
                    "trainer.export_hf=false",
                    "logging.progress=false",
                    "logging.tensorboard=false",
                ]
            )
            == 0
        )
        firsts.append({k: read_metrics(run)[0][k] for k in ("loss", "tokens")})
    assert firsts[0] == firsts[1]
