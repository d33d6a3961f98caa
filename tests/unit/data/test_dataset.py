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
    assert len(ds) == len(lines) and ds.features["messages"].feature["tool_calls"].feature["function"]["arguments"].dtype == "string"
    ds.to_parquet(str(tmp_path / "rctp.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for other in (tmp_path / "rctp.parquet", tmp_path / "saved"):
        assert _ids(load_records(other, "train"), renderer)[0] == expected, other
    assert len(load_records(path, "test")) == len(lines) - 2400


def test_rows_that_do_not_fit_are_one_line_naming_the_field(tmp_path):
    good = {"task_id": "t", "split": "train", "messages": [{"role": "user", "content": "hi"}], "tools": []}
    cases = [
        ({"task_id": "t", "split": "train"}, r"bad.jsonl:2: field 'messages' must be a non-empty list of chat messages "
                                             r"\(the row has \['split', 'task_id'\]\)"),
        ({**good, "messages": [{"role": 3, "content": "x"}]}, r"bad.jsonl:2: messages\[0\].role: must be a string"),
        ({**good, "messages": [{"role": "user", "text": "x"}]}, r"messages\[0\]: unknown field 'text'"),
        ({**good, "reward": True}, r"field 'reward' must be 0 or 1, not True"),
        ({**good, "tools": 5}, r"field 'tools' must be a list of tool schemas"),
        ({**good, "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
         r"messages\[0\].tool_calls\[0\].function.name: must be a string"),
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
    with pytest.raises(DataSchemaError, match=r"x.parquet: field 'messages' is missing \(columns: \['conversation', "
                                              r"'task_id'\]"):
        load_stage1(tmp_path / "x.parquet")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataSchemaError, match="must be written by Dataset.save_to_disk"):
        load_stage1(tmp_path / "folder")
    # an OpenAI-style call whose arguments are an object is stored as its JSON text
    call = {**good, "messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "ls", "arguments": {"a": 1}}}]}]}
    (tmp_path / "ok.jsonl").write_text(json.dumps(call) + "\n")
    row = load_records(tmp_path / "ok.jsonl", "all")[0]
    assert row["messages"][0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}' and "tool_call_id" not in row["messages"][0]


def test_stage1_trains_from_a_parquet_file(micro_data_dir, tmp_path):
    """A user's own data in the schema, here Parquet, trains with no code: data.file names it."""
    import shutil

    from nemo_rcgrpo.train import main
    from nemo_rcgrpo.utils.logging import read_metrics

    data = tmp_path / "data"
    shutil.copytree(micro_data_dir, data)
    load_stage1(data / "sft.jsonl").to_parquet(str(data / "mine.parquet"))
    (data / "sft.jsonl").unlink()  # nothing but the Parquet file to read
    assert main(["--config-name=micro_sft", f"data.dir={data}", "data.file=mine.parquet", f"run_dir={tmp_path / 'r'}",
                 "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
                 "trainer.export_hf=false", "logging.progress=false", "logging.tensorboard=false"]) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "r")] == [1, 2]
