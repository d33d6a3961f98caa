"""data/dataset.py: stage-1 data through `datasets` with a declared schema, from JSONL (prepare-data's), Parquet
(verl's habit) or a saved Dataset, giving the same token ids as the JSONL lines themselves; a row or column that
does not fit is one line naming the file, the row and the field."""

import json

import pytest

from nemo_rcgrpo.data.dataset import DataSchemaError, load_stage1
from nemo_rcgrpo.data.sft_data import build_examples, load_records
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.models.hf import load_tokenizer


@pytest.fixture(scope="module")
def renderer():
    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    return ChatRenderer(tok, "hermes", tool_description="compact")


def _ids(records, renderer):
    examples, stats = build_examples(records, renderer, 1024, seed=3, max_examples=120)
    return [(e.task_id, e.ids, e.mask) for e in examples], stats


def test_every_form_gives_the_ids_of_the_jsonl_lines(micro_data_dir, renderer, tmp_path):
    path = micro_data_dir / "rctp.jsonl"
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    direct = [r for r in lines if r["split"] == "train"]
    expected, stats = _ids(direct, renderer)
    assert len(expected) == 120 and stats["records"] == len(direct) == 2400
    assert _ids(load_records(path, "train"), renderer)[0] == expected
    ds = load_stage1(path, "all")
    assert (
        len(ds) == len(lines)
        and ds.features["messages"].feature["tool_calls"].feature["function"]["arguments"].dtype == "string"
    )
    ds.to_parquet(str(tmp_path / "rctp.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for other in (tmp_path / "rctp.parquet", tmp_path / "saved"):
        assert _ids(load_records(other, "train"), renderer)[0] == expected, other
    assert len(load_records(path, "test")) == len(lines) - 2400


def test_rows_that_do_not_fit_are_one_line_naming_the_field(tmp_path):
    good = {"task_id": "t", "split": "train", "messages": [{"role": "user", "content": "hi"}], "tools": []}
    cases = [
        (
            {"task_id": "t", "split": "train"},
            r"bad.jsonl:2: field 'messages' must be a non-empty list of chat messages "
            r"\(the row has \['split', 'task_id'\]\)",
        ),
        ({**good, "messages": [{"role": 3, "content": "x"}]}, r"bad.jsonl:2: messages\[0\].role: must be a string"),
        ({**good, "messages": [{"role": "user", "text": "x"}]}, r"messages\[0\]: unknown field 'text'"),
        ({**good, "reward": True}, r"field 'reward' must be 0 or 1, not True"),
        ({**good, "tools": 5}, r"field 'tools' must be a list of tool schemas"),
        (
            {**good, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
            r"messages\[0\].tool_calls\[0\].function.name: must be a string",
        ),
    ]
    for bad, message in cases:
        (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(DataSchemaError, match=message):
            load_stage1(tmp_path / "bad.jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n{oops\n")
    with pytest.raises(DataSchemaError, match=r"bad.jsonl:2: not JSON"):
        load_stage1(tmp_path / "bad.jsonl")
    import datasets

    datasets.Dataset.from_list([{"task_id": "t", "conversation": "hi"}]).to_parquet(str(tmp_path / "x.parquet"))
    with pytest.raises(
        DataSchemaError,
        match=r"x.parquet: field 'messages' is missing \(columns: \['conversation', "
        r"'task_id'\]",
    ):
        load_stage1(tmp_path / "x.parquet")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataSchemaError, match="must be written by Dataset.save_to_disk"):
        load_stage1(tmp_path / "folder")
    # an OpenAI-style call whose arguments are an object is stored as its JSON text
    call = {
        **good,
        "messages": [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "ls", "arguments": {"a": 1}}}],
            }
        ],
    }
    (tmp_path / "ok.jsonl").write_text(json.dumps(call) + "\n")
    row = load_records(tmp_path / "ok.jsonl", "all")[0]
    assert (
        row["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
        and "tool_call_id" not in row["messages"][0]
    )


def test_stage1_trains_from_a_parquet_file(micro_data_dir, tmp_path):
    """A user's own data in the schema, here Parquet, trains with no code: data.file names it."""
    import shutil

    from nemo_rcgrpo.train import main
    from nemo_rcgrpo.utils.logging import read_metrics

    data = tmp_path / "data"
    shutil.copytree(micro_data_dir, data)
    load_stage1(data / "sft.jsonl").to_parquet(str(data / "mine.parquet"))
    (data / "sft.jsonl").unlink()  # nothing but the Parquet file to read
    assert (
        main(
            [
                "--config-name=micro_sft",
                f"data.dir={data}",
                "data.file=mine.parquet",
                f"run_dir={tmp_path / 'r'}",
                "trainer.max_steps=2",
                "trainer.global_batch_size=4",
                "trainer.micro_batch_size=4",
                "trainer.export_hf=false",
                "logging.progress=false",
                "logging.tensorboard=false",
            ]
        )
        == 0
    )
    assert [m["step"] for m in read_metrics(tmp_path / "r")] == [1, 2]


def test_a_row_in_the_schemas_shape():
    """check_record: the row as the Dataset stores it (ids as text, tools as JSON text, absent fields None)."""
    from nemo_rcgrpo.data.dataset import check_record

    call = {"id": "c", "function": {"name": "ls", "arguments": {"a": 1}}}
    row = check_record(
        {
            "task_id": 7,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "x", "tool_call_id": "c", "name": "ls"},
            ],
            "tools": [{"type": "function"}],
            "reward": 0,
            "category": "base",
            "split": "train",
        },
        "w",
    )
    assert row == {
        "task_id": "7",
        "tools": '[{"type": "function"}]',
        "reward": 0,
        "category": "base",
        "split": "train",
        "mode": None,
        "failure_type": None,
        "reward_goal": None,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "ls", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "content": "x", "tool_call_id": "c", "name": "ls"},
        ],
    }
    bare = check_record(
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"type": "x", "function": {"name": "f"}},
                        {"function": {"name": "g", "arguments": "[1]"}},
                    ],
                }
            ],
            "tools": "[]",
            "reward": 1,
        },
        "w",
    )
    assert bare["task_id"] is None and bare["tools"] == "[]" and bare["reward"] == 1
    assert bare["messages"][0]["tool_calls"] == [
        {"id": None, "type": "x", "function": {"name": "f", "arguments": "{}"}},  # no arguments: an empty object
        {"id": None, "type": "function", "function": {"name": "g", "arguments": "[1]"}},
    ]
    assert check_record({"messages": [{"role": "user"}], "tools": None}, "w")["tools"] is None


@pytest.mark.parametrize(
    "row, message",
    [
        ([], "w: must be an object, not list"),
        ({"messages": []}, "w: field 'messages' must be a non-empty list of chat messages$"),
        ({"messages": "hi"}, "w: field 'messages' must be a non-empty list"),
        ({"messages": ["hi"]}, r"w: messages\[0\]: must be a message object, not str"),
        ({"messages": [{"role": "user"}, {"content": "x"}]}, r"w: messages\[1\].role: must be a string"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\].content: must be a string or absent"),
        ({"messages": [{"role": "tool", "tool_call_id": 1}]}, r"messages\[0\].tool_call_id: must be a string"),
        ({"messages": [{"role": "tool", "name": ["x"]}]}, r"messages\[0\].name: must be a string or absent"),
        ({"messages": [{"role": "assistant", "tool_calls": {"a": 1}}]}, r"messages\[0\].tool_calls: must be a list"),
        (
            {"messages": [{"role": "assistant", "tool_calls": ["f"]}]},
            r"tool_calls\[0\].function.name: must be a string",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}, {"function": {"name": 1}}]}
                ]
            },
            r"tool_calls\[1\].function.name: must be a string",
        ),
        ({"messages": [{"role": "user"}], "tools": {"a": 1}}, "field 'tools' must be a list of tool schemas"),
        ({"messages": [{"role": "user"}], "reward": 2}, "field 'reward' must be 0 or 1, not 2"),
        ({"messages": [{"role": "user"}], "reward": False}, "field 'reward' must be 0 or 1, not False"),
        ({"messages": [{"role": "user"}], "split": 1}, "field 'split' must be a string, not int"),
        ({"messages": [{"role": "user"}], "reward_goal": {}}, "field 'reward_goal' must be a string, not dict"),
    ],
)
def test_every_field_that_does_not_fit_is_one_line(row, message):
    from nemo_rcgrpo.data.dataset import check_record

    with pytest.raises(DataSchemaError, match=message) as e:
        check_record(row, "w")
    assert "\n" not in str(e.value)


def test_jsonl_lines_and_records_as_the_renderer_takes_them(tmp_path):
    from nemo_rcgrpo.data.dataset import _select, jsonl_objects, to_record

    f = tmp_path / "d.jsonl"
    f.write_text('{"a": 1}\n\n  \n[2]\n')
    assert list(jsonl_objects(f)) == [(f"{f}:1", {"a": 1}), (f"{f}:4", [2])]  # blank lines skipped, counted
    row = {
        "task_id": "t",
        "tools": '[{"type": "function"}]',
        "reward": None,
        "messages": [
            {
                "role": "assistant",
                "content": None,
                "name": None,
                "tool_calls": [{"id": None, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            }
        ],
    }
    assert to_record(row) == {
        "task_id": "t",
        "tools": [{"type": "function"}],
        "messages": [
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        ],
    }
    assert to_record({"task_id": "t", "tools": None, "messages": []}) == {"task_id": "t", "messages": []}
    import datasets

    ds = datasets.Dataset.from_list([{"split": "train", "i": 0}, {"split": "test", "i": 1}, {"split": "train", "i": 2}])
    assert _select(ds, "train")["i"] == [0, 2] and _select(ds, "test")["i"] == [1] and _select(ds, "all") is ds
