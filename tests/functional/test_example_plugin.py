"""examples/plugins/kv_store: an environment outside the package (its tasks, env, reward, stage-1 data and
recipes), trained from the CLI by name: `rcgrpo train --config-dir examples/plugins/kv_store --config-name
kv_rcgrpo plugins=[kv_store]` runs its RCTP-FT first (rl.stage1_recipe) and then RC-GRPO steps on it, and
`rcgrpo eval env=kv_store ...` scores the export on the plugin's held-out tasks as the run's own evaluation did."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "examples" / "plugins" / "kv_store"


def _rcgrpo(*args, timeout=600):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PLUGIN), os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
    }
    return subprocess.run(
        [sys.executable, "-m", "nemo_rcgrpo.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def kv():
    sys.path.insert(0, str(PLUGIN))
    try:
        import kv_store
        import make_data

        yield make_data, kv_store
    finally:
        while str(PLUGIN) in sys.path:  # make_data.py puts its folder on the path too
            sys.path.remove(str(PLUGIN))
        import nemo_rcgrpo.registry as registry

        for kind in ("task_source", "env", "env_settings", "data_builder"):
            registry.table(kind).pop("kv_store", None)
        for name in ("make_data", "kv_store"):
            sys.modules.pop(name, None)


def test_the_data_builder_plays_every_trajectory_through_the_environment(kv, tmp_path):
    make_data, kv_store = kv
    counts = make_data.build(tmp_path)
    assert counts["sft"] == counts["failures"] == 360 and counts["rctp"] == 720
    assert counts["rl_train"] + counts["rl_test"] == 360 and counts["rl_test"] > 20
    tasks = kv_store.make_tasks()
    for line in (tmp_path / "rctp.jsonl").read_text().splitlines()[:60]:
        r = json.loads(line)
        env, _ = kv_store.KVOpener(8).open(tasks[r["task_id"]])
        calls = [c["function"] for m in r["messages"] if m["role"] == "assistant" for c in m.get("tool_calls", [])]
        for c in calls:  # replaying the line's calls in a fresh env earns the line's reward label
            env.step([kv_store.ToolCall(c["name"], json.loads(c["arguments"]))])
        assert env.reward().value == r["reward"], r["task_id"]
    # untrusted calls are error observations: unknown tool, a non-string value, an unparsable call
    env, _ = kv_store.KVOpener(8).open(tasks["kv_0"])
    from nemo_rcgrpo.types import ToolCallError

    res = env.step(
        [
            kv_store.ToolCall("rm", {"key": "x"}),
            kv_store.ToolCall("put", {"key": "x", "value": 3}),
            ToolCallError("{bad", "not JSON"),
        ]
    )
    assert [o.ok for o in res.observations] == [False, False, False] and not env.done


def test_trains_stage1_then_rc_grpo_from_the_cli(kv, tmp_path):
    make_data, kv_store = kv
    data = tmp_path / "data"
    make_data.build(data)
    common = [
        "--config-dir",
        str(PLUGIN),
        "--config-name",
        "kv_rcgrpo",
        f"data.dir={data}",
        f"run_dir={tmp_path / 'rl'}",
        f"model.path={tmp_path / 's1' / 'hf'}",
        "trainer.max_steps=2",
        "rl.eval_every=2",
        "rl.eval_tasks=10",
        "logging.progress=false",
        "logging.tensorboard=false",
        "rl.stage1_overrides=['trainer.max_steps=30','logging.tensorboard=false']",
    ]
    proc = _rcgrpo("train", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training rl.stage1_recipe=kv_rctp first" in proc.stderr
    assert "categories ['copy', 'delete', 'put']" in proc.stdout + proc.stderr  # the plugin's own, not BFCL's
    s1 = [json.loads(l) for l in (tmp_path / "s1" / "metrics.jsonl").read_text().splitlines()]
    assert len(s1) == 30 and s1[-1]["loss"] < s1[0]["loss"]  # stage 1 (RCTP-FT) trained on the plugin's data
    metrics = [json.loads(l) for l in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "eval_accuracy_put" in metrics[1]
    tasks = kv_store.make_tasks()
    records = [json.loads(l) for l in (tmp_path / "rl" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(records) == 20 and {r["category"] for r in records} <= {"put", "copy", "delete"}
    assert {r["reward_token"] for r in records} == {"high", "low"}  # stratified reward tokens in every group
    for r in records:  # the reward is the environment's own: final store against the task's target
        task = tasks[r["task_id"]]
        store_ok = r["reward_details"]["store"] == dict(task.target) and r["truncated"] is None
        assert r["reward"] == float(store_ok and r["actions_ok"]) and r["state_ok"] == store_ok, r
    # a wrong env name is one line naming the registered ones, the plugin's included
    proc = _rcgrpo("train", *common, "env.name=kv_stor")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: env.name='kv_stor': no env of that name; registered: ['bfcl', 'kv_store']; "
        "did you mean 'kv_store'? (a plugin's env needs plugins=[its module])"
    )
    # `rcgrpo eval` on the plugin's env (its held-out tasks): the exported model's greedy episodes are those of
    # the run's own in-training evaluation at its last step
    _eval_as_in_training(data, tmp_path / "rl", tmp_path / "eval")
    proc = _rcgrpo("plugins", "plugins=[kv_store]")
    assert proc.returncode == 0 and "env (env.name): bfcl, kv_store" in proc.stdout
    # trained as served: data whose system prompt is not the env's is refused before any rollout
    import shutil

    shutil.copytree(data, tmp_path / "data2")
    lines = [json.loads(l) for l in (data / "rctp.jsonl").read_text().splitlines()]
    for line in lines:
        line["messages"][0]["content"] += " Be brief."
    (tmp_path / "data2" / "rctp.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    proc = _rcgrpo("train", *common, f"data.dir={tmp_path / 'data2'}", f"run_dir={tmp_path / 'rl2'}")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and "is not a prefix of its stage-1 rendering" in last, proc.stderr[-2000:]
    assert "the opening messages and tools of env kv_store" in last


def _eval_as_in_training(data, run, out):
    in_training = [json.loads(l) for l in (run / "eval" / "step_2.jsonl").read_text().splitlines()]
    ids = [r["task_id"] for r in in_training]
    proc = _rcgrpo(
        "eval",
        "policy=checkpoint",
        "plugins=[kv_store]",
        "task_source=kv_store",
        "env=kv_store",
        f"data_dir={data}",
        f"checkpoint.path={run / 'hf'}",
        f"out_dir={out}",
        f"tasks=[{','.join(ids)}]",
        "chat.tool_description=full",
        "max_new_tokens=64",
        "max_turns=4",
        "max_steps=4",
        "max_total_tokens=1024",
        "progress=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "reward token high" in proc.stderr and "'base'" not in proc.stderr  # the plugin's categories
    scored = {r["task_id"]: r for r in map(json.loads, (out / "trajectories.jsonl").read_text().splitlines())}
    assert sorted(scored) == sorted(ids) and len(ids) == 10
    for r in in_training:
        assistant = [m for m in r["messages"] if m["role"] == "assistant"]
        assert assistant == [m for m in scored[r["task_id"]]["messages"] if m["role"] == "assistant"], r["task_id"]
        assert scored[r["task_id"]]["reward"] == r["reward"]
    held_out = [json.loads(l)["task_id"] for l in (data / "rl_test.jsonl").read_text().splitlines()]
    assert set(ids) <= set(held_out)


def test_the_generic_commands_work_on_the_plugin_env(tmp_path):
    """prepare-data (through the plugin's registered data builder), eval (oracle and null, on the held-out split
    prepare-data wrote) and compare, each from the command line, keep the plugin's own category names."""
    data = tmp_path / "data"
    made = _rcgrpo("prepare-data", "task_source=kv_store", "plugins=[kv_store]", f"out_dir={data}", "tokenizer=null")
    assert made.returncode == 0, made.stderr
    stats = json.loads((data / "stats.json").read_text())["files"]
    assert stats["sft.jsonl"]["lines"] == stats["failures.jsonl"]["lines"] == 360
    assert stats["sft.jsonl"]["success_rate"] == 1.0 and stats["failures.jsonl"]["success_rate"] == 0.0
    held_out = [json.loads(line) for line in (data / "rl_test.jsonl").read_text().splitlines()]
    assert [p["task_id"] for p in held_out] == json.loads((data / "split.json").read_text())["test"]
    assert {p["env"] for p in held_out} == {"kv_store"} and {p["category"] for p in held_out} == {
        "put",
        "copy",
        "delete",
    }
    for policy, accuracy in (("oracle", 100.0), ("null", 0.0)):
        ran = _rcgrpo(
            "eval",
            f"policy={policy}",
            "task_source=kv_store",
            "env=kv_store",
            "plugins=[kv_store]",
            f"data_dir={data}",
            f"out_dir={tmp_path / policy}",
            "progress=false",
        )
        assert ran.returncode == 0, ran.stderr
        result = json.loads((tmp_path / policy / "results.json").read_text())
        assert result["overall"] == accuracy and result["tasks"] == len(held_out)
        assert set(result["categories"]) == {"put", "copy", "delete"}
    compared = _rcgrpo("compare", str(tmp_path / "oracle"), str(tmp_path / "null"), "--out", str(tmp_path / "cmp"))
    assert compared.returncode == 0, compared.stderr
    table = (tmp_path / "cmp.md").read_text()
    assert "### task source kv_store, paper protocol" in table and "| run | copy | delete | put | overall |" in table
    refused = _rcgrpo(
        "prepare-data",
        "task_source=kv_store",
        "plugins=[kv_store]",
        f"out_dir={tmp_path / 'x'}",
        "mode=per_turn",
        "tokenizer=null",
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("the kv_store environment plays merged episodes only (mode=merged)")


@pytest.fixture
def docs_minimal_env(tmp_path):
    """docs/extending.md's minimal environment, as a user takes it: its python block saved as minimal_env.py in a
    folder of its own; returns the folder and the page's section (its bash blocks are the commands to run there)."""
    page = (REPO / "docs" / "extending.md").read_text()
    section = page[page.index("### A minimal environment") :]
    code = re.search(r"```python\n(# minimal_env\.py.*?)```", section, re.S).group(1)
    assert len(code.splitlines()) < 80  # the page promises a minimal one
    (tmp_path / "minimal_env.py").write_text(code)
    return tmp_path, section


def _bash(commands: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "PYTHONWARNINGS": "ignore",
    }
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", commands], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def test_the_minimal_env_of_the_docs_trains_from_the_cli(docs_minimal_env):
    """docs/extending.md's minimal environment, as a user takes it: its python block saved as minimal_env.py, its
    bash block run as it stands (data, then two GRPO steps and a held-out evaluation through the CLI)."""
    tmp_path, section = docs_minimal_env
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    proc = _bash(commands, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "add"
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # the held-out sample is stratified: rl.eval_tasks=2 of the 4 held-out tasks (small_0, small_5, large_0,
    # large_5 in rl_test.jsonl's order, whose first two are both small), one per category
    assert {"eval_accuracy_small", "eval_accuracy_large"} <= set(metrics[1])
    episodes = [json.loads(l) for l in (run / "eval" / "step_2.jsonl").read_text().splitlines()]
    assert sorted(e["category"] for e in episodes) == ["large", "small"]
    records = [json.loads(l) for l in (run / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["category"] for r in records} <= {"small", "large"}
    assert all(r["error"] is None and r["reward"] in (0.0, 1.0) for r in records)  # the contract held
    # rcgrpo eval (the export and the null policy, on rl_test.jsonl's 4 tasks) and rcgrpo compare, as the page runs them
    for name in ("trained", "null"):
        result = json.loads((tmp_path / "eval" / name / "results.json").read_text())
        assert result["tasks"] == 4 and set(result["categories"]) == {"small", "large"}
    assert json.loads((tmp_path / "eval" / "trained" / "results.json").read_text())["policy"]["policy"] == "checkpoint"
    assert "| run | large | small | overall | tasks |" in (tmp_path / "eval" / "add.md").read_text()


def test_the_scripted_generator_plays_the_minimal_env_of_the_docs(docs_minimal_env):
    """generation=scripted on the page's environment, by the page's command (its "Scripted rollouts" section) after
    its data script: each rollout plays the suite's oracle_calls (reward 1) or a verified failure (the one call
    dropped: a closing text, reward 0), by a seeded coin (GRPO: success_rate 0.5)."""
    tmp_path, section = docs_minimal_env
    scripted = section[section.index("### Scripted rollouts of your environment") :]
    command = re.search(r"```bash\n(.*?)```", scripted, re.S).group(1)
    assert "generation=scripted" in command
    proc = _bash("python minimal_env.py data/add\n" + command, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(l) for l in (tmp_path / "runs" / "add_scripted" / "rollouts" / "step_1.jsonl").open()]
    assert len(records) == 8 and {r["category"] for r in records} <= {"small", "large"}
    assert {r["reward"] for r in records} == {0.0, 1.0}  # mixed: successes and failures
    for r in records:
        category, i = r["task_id"].split("_")
        a, b = int(i), int(i) + 1 if category == "small" else 1000 * int(i)
        oracle = [[{"name": "add", "arguments": {"a": a, "b": b}}]]
        assert r["turns"] == (oracle if r["reward"] == 1.0 else [[]]) and r["truncated"] is None, r
    metrics = [json.loads(l) for l in (tmp_path / "runs" / "add_scripted" / "metrics.jsonl").open()]
    assert metrics[0]["reward_mean"] == sum(r["reward"] for r in records) / 8


def test_the_scripted_generator_plays_the_plugin_env(kv, tmp_path):
    """generation=scripted on examples/plugins/kv_store from the command line: RC-GRPO with stratified reward tokens
    (two high, two low per group), success_high=1 and success_low=0 (the defaults): every high rollout plays the
    suite's oracle calls and then done() (reward 1), every low one a failure verified to score 0 (an oracle call
    dropped), each in the plugin's own categories."""
    make_data, kv_store = kv
    data = tmp_path / "data"
    make_data.build(data)
    proc = _rcgrpo(
        "train",
        "--config-dir",
        str(PLUGIN),
        "--config-name",
        "kv_rcgrpo",
        f"data.dir={data}",
        f"run_dir={tmp_path / 'rl'}",
        "model.path=tiny-llama",
        "rl.stage1_recipe=null",
        "generation=scripted",
        "trainer.max_steps=1",
        "rl.tasks_per_step=2",
        "rl.group_size=4",
        "rl.sampling.max_new_tokens=128",
        "logging.progress=false",
        "logging.tensorboard=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tasks = kv_store.make_tasks()
    records = [json.loads(l) for l in (tmp_path / "rl" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(records) == 8 and {r["category"] for r in records} <= {"put", "copy", "delete"}
    assert [r["reward"] for r in records] == [float(r["reward_token"] == "high") for r in records]
    assert {r["reward_token"] for r in records} == {"high", "low"}
    for r in records:
        oracle = [{"name": name, "arguments": dict(args)} for name, args in tasks[r["task_id"]].gold]
        played = [c for calls in r["turns"] for c in calls]
        assert played[-1] == {"name": "done", "arguments": {}} and r["truncated"] is None, r
        if r["reward"] == 1.0:
            assert played[:-1] == oracle, r
        else:  # the oracle's calls with one dropped
            assert any(played[:-1] == oracle[:i] + oracle[i + 1 :] for i in range(len(oracle))), r
