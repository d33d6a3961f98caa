"""data/rl_tasks.py: the RL task pointers through `datasets` with a declared schema, from JSONL (prepare-data's),
Parquet or a saved Dataset, giving the same task ids in the same order; a row that does not fit is one line
naming the file, the row and the field; and the RL loop reads its tasks through it."""

import json
import shutil

import pytest

from nemo_rcgrpo.data.consistency import DataMismatchError
from nemo_rcgrpo.data.dataset import DataSchemaError
from nemo_rcgrpo.data.rl_tasks import find_pointers, load_pointers, load_rl_tasks, stratified_sample, task_ids
from nemo_rcgrpo.envs.config import EnvConfig


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
    for text, message in (
        (
            '{"task_id": "a"}\n{"id": "b"}\n',
            r"rl_train.jsonl:2: field 'task_id' must be a task id "
            r"\(a string\) \(the row has \['id'\]\)",
        ),
        ('{"task_id": "a"}\n\n["b"]\n', r"rl_train.jsonl:3: must be an object with a task_id"),
        ('{"task_id": "a", "category": 3}\n', r"rl_train.jsonl:1: field 'category' must be a string"),
        ('{"task_id": "a"\n', r"rl_train.jsonl:1: not JSON"),
    ):
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
    args = [
        "--config-name=rcgrpo_smollm_cpu",
        "model.path=tiny-llama",
        "rl.stage1_recipe=null",
        f"data.dir={data}",
        f"run_dir={tmp_path / 'run'}",
        "rl.group_size=2",
        "rl.tasks_per_step=2",
        "rl.max_turns=4",
        "rl.sampling.max_new_tokens=64",
        "rl.max_total_tokens=4096",
        "trainer.max_steps=1",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        "generation=scripted",
    ]
    assert main(args) == 0
    dumped = {
        json.loads(l)["task_id"] for l in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    }
    assert dumped and dumped <= set(wanted)


def test_eval_tasks_are_a_seeded_sample_stratified_by_category():
    # 6 of category a, 3 of b, 1 of c (10 in all), in the split's order: a-first, as BFCL's test split is
    ids = [f"a{i}" for i in range(6)] + [f"b{i}" for i in range(3)] + ["c0"]
    category = lambda t: t[0]  # noqa: E731
    counts = lambda sample: {c: sum(t[0] == c for t in sample) for c in "abc"}  # noqa: E731
    # k=5: shares 3.0 / 1.5 / 0.5 -> 3 / 1 / 0, one left over -> b (remainder 5 of 10; c's is also 5, b is named first)
    five = stratified_sample(ids, category, 5, seed=0)
    assert counts(five) == {"a": 3, "b": 2, "c": 0} and len(set(five)) == 5
    # k=4: 2.4 / 1.2 / 0.4 -> 2 / 1 / 0, one left over -> a (remainder 4 of 10, as c's; a is named first)
    assert counts(stratified_sample(ids, category, 4, seed=0)) == {"a": 3, "b": 1, "c": 0}
    # k=7: 4.2 / 2.1 / 0.7 -> 4 / 2 / 0, one left over -> c (remainder 7 beats 2 and 1)
    assert counts(stratified_sample(ids, category, 7, seed=0)) == {"a": 4, "b": 2, "c": 1}
    # never the split's first k (what slicing did), in the split's order, the same for the same seed
    assert any(stratified_sample(ids, category, 5, seed=s) != ids[:5] for s in range(3))
    assert five == [t for t in ids if t in five] == stratified_sample(ids, category, 5, seed=0)
    # the seed decides which: over seeds every task of a category is drawn
    assert {t for s in range(20) for t in stratified_sample(ids, category, 5, seed=s)} == set(ids) - {"c0"}
    # the order the ids come in does not change the sample's set
    assert set(stratified_sample(ids[::-1], category, 5, seed=0)) == set(five)
    # k at least the number of ids: all of them
    assert stratified_sample(ids, category, 10, seed=1) == ids == stratified_sample(ids, category, 99, seed=1)


def test_a_run_loads_the_tasks_its_suite_holds(micro_data_dir, tmp_path):
    """The training tasks are the pointers the suite holds, in order; the held-out sample is stratified over
    rl_test's; data of another task source, or pointers of which the suite holds none, are refused in one line."""
    env = EnvConfig(task_source="bfcl_micro")
    tasks = load_rl_tasks(micro_data_dir, "train", env, eval_tasks=8, seed=0)
    assert tasks.train == task_ids(micro_data_dir, "train") and set(tasks.train) <= set(tasks.suite.tasks)
    test = task_ids(micro_data_dir, "test")
    assert len(tasks.held_out) == 8 and set(tasks.held_out) <= set(test)
    assert tasks.held_out == stratified_sample(test, lambda t: tasks.suite[t].category, 8, 0) != test[:8]
    # pointers to tasks the suite does not hold (ids renamed): none is left to train on
    data = tmp_path / "d"
    shutil.copytree(micro_data_dir, data)
    lines = (data / "rl_train.jsonl").read_text().splitlines()
    (data / "rl_train.jsonl").write_text(
        "\n".join(l.replace('"task_id": "', '"task_id": "gone_') for l in lines) + "\n"
    )
    with pytest.raises(ValueError, match="no task of the rl_train pointers in .* is in task source bfcl_micro"):
        load_rl_tasks(data, "train", env, eval_tasks=8, seed=0)
    with pytest.raises(DataMismatchError, match="env.task_source=bfcl but .* was prepared with task_source=bfcl_micro"):
        load_rl_tasks(micro_data_dir, "train", EnvConfig(task_source="bfcl"), eval_tasks=8, seed=0)
