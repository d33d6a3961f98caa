"""The training record: reward conditioning is a property of how a model was trained, not of its vocabulary."""

import pytest

from nemo_rcgrpo.stages import stage_of
from nemo_rcgrpo.utils.provenance import RECORD_FILE, auto_reward_token, read_record, training_record, write_record


@pytest.mark.parametrize(
    "stage, init_stage, conditioned",
    [
        ("sft", None, False),
        ("rctp", None, True),
        ("grpo", "sft", False),
        ("rcgrpo", "rctp", True),
        ("grpo", "rctp", True),  # GRPO from an RCTP-FT init: derived from a conditioned model
        ("dapo_filter", "sft", False),
        ("rcgrpo", "sft", True),
    ],
)
def test_conditioning_by_stage_and_init(tmp_path, stage, init_stage, conditioned):
    init = tmp_path / "init"
    if init_stage:
        write_record(
            init, training_record(init_stage, "smollm2", "<|h|>", "<|l|>", conditioned=stage_of(init_stage).conditioned)
        )
    record = training_record(stage, str(init), "<|h|>", "<|l|>", conditioned=stage_of(stage).conditioned)
    assert record["reward_conditioned"] is conditioned and record["init_stage"] == init_stage
    assert record["reward_tokens"] == {"high": "<|h|>", "low": "<|l|>"}
    write_record(tmp_path / "out", record)
    assert read_record(tmp_path / "out") == record
    assert auto_reward_token(record) == ("high" if conditioned else "none")


def test_missing_or_broken_records(tmp_path):
    assert read_record(tmp_path) is None and read_record("smollm2") is None
    (tmp_path / RECORD_FILE).write_text("{not json")
    assert read_record(tmp_path) is None and auto_reward_token(None) == "none"
