"""data/rl_tasks.py: the RL task pointers through `datasets` with a declared schema, from JSONL (prepare-data's),
Parquet or a saved Dataset, giving the same task ids in the same order; a row that does not fit is one line
naming the file, the row and the field; and the RL loop reads its tasks through it."""

import json
import shutil

import pytest

from nemo_rcgrpo.data.dataset import DataSchemaError
from nemo_rcgrpo.data.rl_tasks import find_pointers, load_pointers, task_ids


def test_every_form_gives_the_jsonl_ids(micro_data_dir, tmp_path):
    lines = [json.loads(l) for l in (micro_data_dir / "rl_train.jsonl").read_text().splitlines()]
    want = [r["task_id"] for r in lines]
    assert task_ids(micro_data_dir, "train") == want and len(want) == 1200
    ds = load_pointers(micro_data_dir / "rl_train.jsonl")
    assert ds.features["task_id"].dtype == "string" and ds[0]["task_source"] == "bfcl_micro"
    parquet, saved = tmp_path / "p", tmp_path / "s"
    parquet.mkdir()
    saved.mkdir()
    ds.to_parquet(str(parquet / "rl_train.parquet"))
    ds.save_to_disk(str(saved / "rl_train"))
    assert find_pointers(parquet, "train").name == "rl_train.parquet" and task_ids(parquet, "train") == want
    assert find_pointers(saved, "train").name == "rl_train" and task_ids(saved, "train") == want
    assert task_ids(tmp_path, "test", required=False) == []
    with pytest.raises(FileNotFoundError, match="no RL task pointers rl_test"):
        task_ids(tmp_path, "test")


def test_rows_that_do_not_fit_are_one_line(tmp_path):
    path = tmp_path / "rl_train.jsonl"
    for text, message in (('{"task_id": "a"}\n{"id": "b"}\n', r"rl_train.jsonl:2: field 'task_id' must be a task id "
                                                                r"\(a string\) \(the row has \['id'\]\)"),
                          ('{"task_id": "a"}\n\n["b"]\n', r"rl_train.jsonl:3: must be an object with a task_id"),
                          ('{"task_id": "a", "category": 3}\n', r"rl_train.jsonl:1: field 'category' must be a string"),
                          ('{"task_id": "a"\n', r"rl_train.jsonl:1: not JSON")):
        path.write_text(text)
        with pytest.raises(DataSchemaError, match=message):
            load_pointers(path)
    path.write_text('{"task_id": 7}\n')
    assert task_ids(tmp_path, "train") == ["7"]


def test_the_rl_loop_reads_its_tasks_from_parquet_pointers(data_dir, tmp_path):
    """RC-GRPO with the pointers as Parquet only (no rl_*.jsonl): it rolls out the pointed tasks."""
    from nemo_rcgrpo.train import main

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    wanted = task_ids(data, "train")[:5]
    load_pointers(data / "rl_train.jsonl").select(range(5)).to_parquet(str(data / "rl_train.parquet"))
    (data / "rl_train.jsonl").unlink()
    (data / "rl_test.jsonl").unlink()
    args = ["--config-name=rcgrpo_smollm_cpu", "model.path=tiny-llama", "rl.stage1_recipe=null", f"data.dir={data}",
            f"run_dir={tmp_path / 'run'}", "rl.group_size=2", "rl.tasks_per_step=2", "rl.max_turns=4",
            "rl.sampling.max_new_tokens=64", "rl.max_total_tokens=4096", "trainer.max_steps=1",
            "trainer.export_hf=false", "logging.progress=false", "logging.tensorboard=false", "generation=scripted"]
    assert main(args) == 0
    dumped = {json.loads(l)["task_id"] for l in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()}
    assert dumped and dumped <= set(wanted)
