"""evaluation/policies.py: how an evaluated model is conditioned. ``reward_token=auto`` follows the model's training
record (a model trained without reward tokens is evaluated without one); the reward goal's wording is the record's;
the warnings name the cases where the setting and the model disagree."""

import pytest

from nemo_rcgrpo.config_schema import ModelConfig, RewardTokensConfig
from nemo_rcgrpo.evaluation.config import EvalConfig
from nemo_rcgrpo.evaluation.policies import conditioning
from nemo_rcgrpo.utils.provenance import training_record, write_record


def _cfg(token="auto", reward_tokens="special"):
    return EvalConfig(
        out_dir="x",
        reward_token=token,
        model=ModelConfig(reward_tokens=reward_tokens),
        reward_tokens=RewardTokensConfig(high="<|H|>", low="<|L|>"),
    )


def _model(tmp_path, stage, conditioned, goal=None):
    record = training_record(stage, "smollm2", "<|h|>", "<|l|>", conditioned=conditioned)
    if goal is not None:
        record["reward_goal"] = goal
    write_record(tmp_path / stage, record)
    return tmp_path / stage


@pytest.mark.parametrize(
    "stage, conditioned, expected",
    [("rctp", True, "high"), ("rcgrpo", True, "high"), ("sft", False, "none"), ("grpo", False, "none")],
)
def test_auto_follows_the_training_record(tmp_path, capsys, stage, conditioned, expected):
    token, goal = conditioning(_cfg(), _model(tmp_path, stage, conditioned), "m", has_tokens=True)
    assert token == expected and capsys.readouterr().err == ""
    for explicit in ("high", "low", "none"):  # an explicit setting is taken as it is
        assert conditioning(_cfg(explicit), _model(tmp_path, stage, conditioned), "m", True)[0] == explicit


def test_the_goal_is_the_records_wording_with_the_runs_tokens(tmp_path):
    saved = {"template": "<goal {token}>", "position": "prefix", "separator": "\n", "high_token": "<|other|>"}
    _, goal = conditioning(_cfg(), _model(tmp_path, "rctp", True, goal=saved), "m", True)
    assert (goal.template, goal.position, goal.separator) == ("<goal {token}>", "prefix", "\n")
    assert (goal.high_token, goal.low_token) == ("<|H|>", "<|L|>")  # the run's tokens, not the record's
    _, plain = conditioning(_cfg(), _model(tmp_path, "sft", False), "m", True)  # no goal recorded: the default
    assert (plain.template, plain.position, plain.separator) == ("[Reward Goal: {token}]", "suffix", " ")
    token, none = conditioning(_cfg("high"), None, "endpoint", None)  # an endpoint without a folder
    assert token == "high" and (none.template, none.high_token) == ("[Reward Goal: {token}]", "<|H|>")


@pytest.mark.parametrize(
    "model, has_tokens, warned",
    [
        ("folder", True, "m has reward tokens but no training record"),  # a checkpoint without its record
        ("folder", None, "m no training record"),  # an endpoint served from a folder without one
        ("folder", False, None),  # no tokens, no record: a plain model, rightly evaluated without a token
        (None, None, None),  # an endpoint without a folder: nothing to read
    ],
)
def test_auto_without_a_record_says_so_where_the_model_may_be_conditioned(tmp_path, capsys, model, has_tokens, warned):
    token, _ = conditioning(_cfg(), tmp_path if model else None, "m", has_tokens)
    err = capsys.readouterr().err
    assert token == "none"
    if warned:
        assert warned in err and "reward_token=auto evaluates it without a token" in err and err.count("\n") == 1
    else:
        assert err == ""


@pytest.mark.parametrize(
    "token, has_tokens, reward_tokens, warned",
    [
        ("high", False, "special", True),
        ("low", False, "special", True),
        ("none", False, "special", False),  # no token asked for
        ("high", None, "special", False),
        ("high", True, "special", False),  # unknown, or the tokens are there
        ("high", False, "literal", False),  # literal tokens are plain text: nothing untrained is added
    ],
)
def test_a_token_asked_of_a_model_without_them_is_warned(tmp_path, capsys, token, has_tokens, reward_tokens, warned):
    model = _model(tmp_path, "sft", False)
    got, _ = conditioning(_cfg(token, reward_tokens), model, "m", has_tokens)
    err = capsys.readouterr().err
    assert got == token
    assert ("m was not trained with reward tokens; reward_token=" + token in err) is warned
