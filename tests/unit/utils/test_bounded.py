"""utils/bounded.py: a record's JSON line within its cap, tool results clipped longest first (in ``observations``
and in the ``role: tool`` messages alike), the rest whole; a record within its cap written as json.dumps does."""

import json

from nemo_rcgrpo.utils.bounded import (
    DUMP_FLOOR_CHARS,
    MAX_DUMP_RECORD_CHARS,
    _clipped,
    bounded_line,
    clip,
    clip_observations,
    dump_cap,
    generated_chars,
)


def test_clip_cuts_only_when_the_marker_makes_the_text_shorter():
    assert clip("a" * 100, 10) == "a" * 10 + "... [clipped 90 characters]"
    assert clip("a" * 30, 10) == "a" * 30  # 10 + 27 characters of marker would be longer
    assert clip("abc", 10) == "abc"


def test_the_longest_results_are_clipped_first_and_the_rest_stays_whole():
    record = {
        "reward": 1.0,
        "observations": [["s" * 50, "m" * 2_000], ["l" * 10_000]],
        "messages": [
            {"role": "assistant", "content": "ls()", "tool_calls": []},
            {"role": "tool", "content": "s" * 50},
            {"role": "tool", "content": "m" * 2_000},
            {"role": "tool", "content": "l" * 10_000},
        ],
    }
    line = clip_observations(record, 12_000)
    assert line is not None and len(line) <= 12_000
    out = json.loads(line)
    assert out["observations_clipped"] is True and out["reward"] == 1.0 and out["messages"][0] == record["messages"][0]
    short, medium, long = out["observations"][0][0], out["observations"][0][1], out["observations"][1][0]
    assert short == "s" * 50 and medium == "m" * 2_000  # only the longest needed cutting
    assert long.startswith("l" * 1_000) and long.endswith(" characters]") and "... [clipped " in long
    assert [m["content"] for m in out["messages"][1:]] == [short, medium, long]  # both copies alike
    # the largest keep that fits: one character more would not
    keep = long.index(".")
    assert len(json.dumps(_clipped(record, keep + 1))) > 12_000
    assert record["observations"][1][0] == "l" * 10_000  # the record itself is not changed


def test_a_record_within_its_cap_is_written_as_it_is_and_the_cap_follows_the_generated_text():
    record = {
        "task_id": "t",
        "messages": [
            {"role": "assistant", "content": "é" * 10, "tool_calls": [{"a": 1}]},
            {"role": "tool", "content": "r" * 1_000},
        ],
    }
    assert bounded_line(record) == json.dumps(record, default=str)
    assert generated_chars(record) == 10 + len('[{"a": 1}]')
    assert dump_cap(record) == DUMP_FLOOR_CHARS + 64 * generated_chars(record)
    assert dump_cap({"messages": [{"role": "assistant", "content": "x" * 100_000}]}) == MAX_DUMP_RECORD_CHARS
    # a record over its cap with nothing to clip is written whole and not flagged
    assert bounded_line({"text": "t" * 500}, limit=100) == json.dumps({"text": "t" * 500})
    # when even 32 characters of each result do not fit, each is cut to 32 and the rest written as it is
    tight = json.loads(bounded_line({"prompt": "p" * 500, "observations": [["o" * 5_000]]}, limit=100))
    assert tight["observations"] == [["o" * 32 + "... [clipped 4968 characters]"]] and tight["observations_clipped"]
