"""Reading the defaults YAML and its comments for `--help`."""

from nemo_rcgrpo.utils.cli_help import _description, _parents, _split_comment, documented_settings, recipes


def test_values_and_comments():
    assert _split_comment(" 5   # G") == ("5", "G")
    assert _split_comment("   # a section") == ("", "a section")
    assert _split_comment(" I can't stop  # note") == ("I can't stop", "note")  # a quote inside a plain value
    assert _split_comment(' "a \\" # b"  # c') == ('"a \\" # b"', "c")
    assert _split_comment(" 'it''s # x' # y") == ("'it''s # x'", "y")
    assert _split_comment(" <|high_reward|>") == ("<|high_reward|>", "")
    assert _split_comment(" a#b") == ("a#b", "")  # '#' without a space before it is part of the value


def test_sections_flow_maps_and_defaults_lists(tmp_path):
    (tmp_path / "base_defaults.yaml").write_text(
        "defaults:\n  - _self_\n  - generation: hf\nrl:                 # stage 2\n"
        "  loss: {clip_low: 0.2, kl: {beta: 0.1}}  # the objective\n  group_size: 5   # G\n"
    )
    (tmp_path / "flow.yaml").write_text(
        "# A recipe in flow style. More words here.\ndefaults: [base_defaults, _self_]\n"
    )
    (tmp_path / "slash.yaml").write_text("# Another\n# one, on two lines. Then more.\ndefaults:\n  - /base_defaults\n")
    (tmp_path / "other.yaml").write_text("# Not built on the base.\nx: 1\n")
    assert documented_settings(tmp_path / "base_defaults.yaml") == [
        ("rl.loss.clip_low", "0.2", "the objective"),
        ("rl.loss.kl.beta", "0.1", "the objective"),
        ("rl.group_size", "5", "G"),
    ]
    assert _parents((tmp_path / "flow.yaml").read_text()) == ["base_defaults"]
    assert recipes("base_defaults", tmp_path) == [
        ("flow", "A recipe in flow style."),
        ("slash", "Another one, on two lines."),
    ]
    assert _description("# No stop at all\nx: 1") == "No stop at all"
