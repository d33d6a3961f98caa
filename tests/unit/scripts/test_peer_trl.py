"""The pure parts of scripts/bench/peer_trl.py (no TRL needed): the env adapter that TRL's ``environment_factory``
drives plays the project's own BFCL env, and the equal-work checks."""

from __future__ import annotations

import inspect

import pytest

from nemo_rcgrpo.envs.bfcl.config import BFCLOpener, BFCLSettings
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan
from nemo_rcgrpo.envs.sources import make_suite
from scripts.bench import peer_trl


@pytest.fixture(scope="module")
def opened():
    suite = make_suite("bfcl_micro", ["base"])
    opener = BFCLOpener(BFCLSettings(mode="merged"), suite)
    task = next(t for t in suite if sum(map(len, t.ground_truth)) >= 2)
    env, messages = opener.open(task)
    cls = peer_trl.adapter_class(task.id, env.tools, lambda tid: opener.open(suite[tid]))
    return task, env, messages, cls


def _tools(adapter):
    """What TRL makes of an env instance: its public methods but reset / get_reward, by attribute name."""
    members = inspect.getmembers(type(adapter), predicate=inspect.isfunction)
    return [getattr(adapter, n) for n, _ in members if n not in ("reset", "get_reward") and not n.startswith("_")]


def test_the_adapter_offers_the_envs_tools_in_its_order_with_its_schemas(opened):
    _, env, _, cls = opened
    tools = _tools(cls())
    assert [t.__name__ for t in tools] == [t["function"]["name"] for t in env.tools]
    assert tools[-1].__name__ == "done"
    schema = peer_trl.schema_of(lambda f: {"derived": f.__name__})
    assert [schema(t) for t in tools] == env.tools  # bound methods hand over the env's own schemas
    assert schema(len) == {"derived": "len"}  # any other function: the original


def test_tool_calls_are_the_envs_steps_and_done_ends_the_episode(opened):
    task, _, messages, cls = opened
    adapter = cls()
    assert adapter.reset(prompt=messages, task_id=task.id) is None
    by_name = {t.__name__: t for t in _tools(adapter)}
    for call in [c for turn in gold_plan(task) for c in turn]:
        assert not by_name[call.name](**call.kwargs).startswith("Error"), call
    assert len(adapter.env.executed) == adapter.calls > 0
    done = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "done", "arguments": {}}}]}]
    assert peer_trl.rollout_reward(adapter, done, stopped=True) == (0.0, "turn cap or context budget")
    assert by_name["done"]() == peer_trl.DONE_MARKER and adapter.finished and adapter.env.done
    executed = len(adapter.env.executed)
    assert by_name[task.ground_truth[0][0].split("(")[0]]() == peer_trl.DONE_MARKER  # runs nothing after done()
    assert len(adapter.env.executed) == executed
    assert peer_trl.rollout_reward(adapter, done, stopped=True) == (1.0, None)  # the gold calls: reward 1

    adapter.reset(prompt=messages, task_id=task.id)  # a fresh episode: nothing carried over
    assert not adapter.finished and adapter.env.executed == []
    cut = [{"role": "assistant", "content": "<tool_call>\n{"}]
    assert peer_trl.rollout_reward(adapter, cut, stopped=False) == (0.0, "max_new_tokens without a stop token")
    answered = [{"role": "assistant", "content": "All set."}]
    assert peer_trl.rollout_reward(adapter, answered, stopped=True) == (0.0, None)  # the env's reward: nothing done


def test_a_message_runs_its_calls_up_to_done():
    calls = [{"function": {"name": n, "arguments": {}}} for n in ("ls", "done", "rm")]
    assert [c["function"]["name"] for c in peer_trl.cut_at_done(calls)] == ["ls", "done"]
    assert peer_trl.cut_at_done(calls[:1]) == calls[:1]


def _run(tasks, rollouts_per_step=4, turns=2, tokens=50, calls=1, sha="a"):
    steps = [
        {
            "tasks": list(t),
            "rollouts": [
                {
                    "task": t[0],
                    "turns": turns,
                    "tokens": tokens,
                    "calls": calls,
                    "reward": 0.0,
                    "truncated": None,
                    "prompt_sha": sha,
                }
                for _ in range(rollouts_per_step)
            ],
        }
        for t in tasks
    ]
    return {"steps": steps}


def test_equal_work_checks_tasks_rollouts_and_the_turn_cap():
    plan = [("a", "b"), ("c", "d")]
    lines, ok = peer_trl.equal_work([_run(plan)], [_run(plan, tokens=60)], tasks=2, group=2, max_turns=4)
    assert ok and any("comparable" in line and "NOT" not in line for line in lines)
    assert not any("single-turn" in line for line in lines)
    assert not peer_trl.equal_work([_run(plan)], [_run(plan[::-1])], 2, 2, 4)[1]  # other tasks
    assert not peer_trl.equal_work([_run(plan)], [_run(plan, rollouts_per_step=3)], 2, 2, 4)[1]  # other counts
    assert not peer_trl.equal_work([_run(plan)], [_run(plan, turns=5)], 2, 2, 4)[1]  # past the cap
    lines, ok = peer_trl.equal_work([_run(plan)], [_run(plan, tokens=500, calls=0, sha="b")], 2, 2, 4)
    assert ok  # reported, not refused: tokens differ by sampling, prompts by rendering
    text = "\n".join(lines)
    assert "NOT comparable" in text and "identical on both sides: NO" in text and "single-turn GRPO" in text


@pytest.mark.parametrize("config", ["equal", "fastest"])
def test_equal_runs_a_rollout_per_pass_and_fastest_the_projects_default(config, tmp_path):
    """equal: one rollout per forward/backward, as TRL's per_device_train_batch_size=1; fastest: the project as
    shipped, whole groups per micro-batch (trainer.micro_batch_tokens=auto: G x max_total_tokens on CPU)."""
    import argparse

    args = argparse.Namespace(
        model=tmp_path / "model", data=tmp_path / "data", tasks=2, group_size=5, max_turns=4, max_new_tokens=128,
        temperature=1.0, steps=2, config=config, fast_tokens="auto",
    )  # fmt: skip
    cfg = peer_trl.recipe_config(args, str(tmp_path / "run"))
    if config == "equal":
        assert (cfg.trainer.micro_batch_size, cfg.micro_batch_budget("cpu")) == (1, None)
    else:
        assert cfg.trainer.micro_batch_tokens == "auto"
        assert cfg.micro_batch_budget("cpu") == 5 * cfg.rl.max_total_tokens


def test_a_failed_run_is_a_row_not_the_end_of_the_benchmark():
    """A child killed by the kernel (or exiting non-zero) is reported with its peak RSS; its side's median is not
    taken, the ratio is left blank, and the equal-work check says it could not be made."""
    import argparse

    plan = [("a", "b"), ("c", "d")]
    for run, rep in ((_run(plan), 0), (_run(plan, tokens=60), 1)):
        run.update(rep=rep, load=(1.5, 1.0, 1.0), rss_kib=5 * 2**20, seconds=100.0)
        for k, step in enumerate(run["steps"]):
            step.update(wall=10.0 + k, rollout=4.0, generation=3.0, train=6.0 + k, tokens=200)
    killed = peer_trl.failure(-9, ["loading", "step 1", ""])
    assert killed.startswith("killed by signal 9 (SIGKILL") and killed.endswith("last line: step 1")
    assert peer_trl.failure(1, []) == "exit code 1"
    assert peer_trl.failure(1, ["Loading weights: 100%|####| 272/272"]).endswith("100%\\|####\\| 272/272")
    dead = {"steps": [], "failed": killed, "rep": 0, "load": (2.0, 1.0, 1.0), "rss_kib": 24 * 2**20, "seconds": 80.0}
    ok_run = _run(plan)
    ok_run.update(rep=0, load=(1.0, 1.0, 1.0), rss_kib=6 * 2**20, seconds=90.0)
    for step in ok_run["steps"]:
        step.update(wall=20.0, rollout=8.0, generation=6.0, train=12.0, tokens=210)

    assert peer_trl.summarize([dead]) is None
    assert peer_trl.summarize([dead, ok_run])["wall"] == 20.0  # the completed run alone
    lines, ok = peer_trl.equal_work([ok_run], [dead], 2, 2, 4)
    assert not ok and lines == ["- Not checked: no run of TRL completed (see the runs above)."]

    args = argparse.Namespace(
        model="m", tasks=2, group_size=2, max_turns=4, max_new_tokens=128, temperature=1.0, runs=1, steps=1,
        fast_tokens="auto", trl_fast_rows=2, trl_kv_memory=0.1, date="2026-12-08",
    )  # fmt: skip
    results = {"fastest": {"project": [ok_run], "trl": [dead]}}
    text = "\n".join(peer_trl.section(args, results, {"trl": "1.16.0"}))
    assert "- Date: 2026-12-08;" in text
    row = next(line for line in text.splitlines() if line.startswith("| fastest:") and "| TRL |" in line)
    assert "failed in 1 of 1 runs: killed by signal 9" in row and "| 24.00 | - |" in row
    project = next(line for line in text.splitlines() if line.startswith("| fastest:") and "| project |" in line)
    assert project.endswith("| 20.0 [20.0, 20.0] | 8.0 | 6.0 | 12.0 | 210 | 6.00 |  |")  # no ratio without TRL
    assert "failed after 80 s: killed by signal 9" in text and "Not checked: no run of TRL completed" in text


def test_a_record_renders_the_section_again_without_running(tmp_path, monkeypatch):
    """Every run is kept in the record as it ends; ``--render RECORD`` writes the same section from it, with the
    command that ran and its date, and refuses work that was not equal as the run itself does."""
    import argparse

    plan = [("a", "b"), ("c", "d")]
    runs = {}
    for side, wall in (("project", 20.0), ("trl", 40.0)):
        run = _run(plan)
        run.update(rep=0, load=(1.0, 1.0, 1.0), rss_kib=6 * 2**20, seconds=90.0)
        for step in run["steps"]:
            step.update(wall=wall, rollout=8.0, generation=6.0, train=wall - 8.0, tokens=210)
        runs[side] = [run]
    args = argparse.Namespace(
        model=tmp_path / "model", data=tmp_path / "data", tasks=2, group_size=2, max_turns=4, max_new_tokens=128,
        temperature=1.0, runs=1, steps=1, fast_tokens="auto", trl_fast_rows=2, trl_kv_memory=0.2, date="2026-12-08",
        side=None, out=None,
    )  # fmt: skip
    record = tmp_path / "runs.json"
    monkeypatch.setattr(peer_trl.sys, "argv", ["scripts/bench/peer_trl.py", "--runs", "1"])
    peer_trl.save_record(record, args, {"equal": runs}, {"trl": "1.16.0"})
    saved = peer_trl.json.loads(record.read_text())
    assert saved["settings"]["date"] == "2026-12-08" and "side" not in saved["settings"]
    out = tmp_path / "bench.md"
    assert peer_trl.render(record, out) == 0
    text = out.read_text()
    # the command as it ran (with the environment variables that change a measurement, such as make test's)
    assert saved["command"].endswith("python -m scripts.bench.peer_trl --runs 1")
    assert f"Command: `{saved['command']}`" in text and "- Date: 2026-12-08;" in text
    row = next(line for line in text.splitlines() if line.startswith("| equal:") and "| project |" in line)
    assert row.endswith("| 0.50 |")  # 20 s against 40 s
    runs["trl"][0]["steps"][0]["tasks"] = ["x", "y"]  # another task set on one side: refused
    peer_trl.save_record(record, args, {"equal": runs}, {"trl": "1.16.0"})
    with pytest.raises(SystemExit, match="did not play the same work"):
        peer_trl.render(record, out)


def test_each_part_is_compared_and_where_trl_is_faster_is_named():
    """project / TRL per part, from the medians: generation, the env's share of the rollouts, training, the step;
    a part above 1 is named as TRL's; a configuration with a side that never completed is unmeasured."""
    plan = [("a", "b"), ("c", "d")]

    def run(wall, rollout, generation):
        r = _run(plan)
        r.update(rep=0, load=(1.0, 1.0, 1.0), rss_kib=2**20, seconds=1.0)
        for step in r["steps"]:
            step.update(wall=wall, rollout=rollout, generation=generation, train=wall - rollout, tokens=1)
        return r

    results = {
        "equal": {"project": [run(30.0, 12.0, 9.0)], "trl": [run(40.0, 10.0, 6.0)]},
        "fastest": {"project": [run(10.0, 5.0, 4.0)], "trl": [{"steps": [], "failed": "exit code 1", "rep": 0}]},
    }
    lines = peer_trl.part_lines(results)
    assert lines[0] == (
        "- `equal`: step 0.75, generation 1.50, env, tools and reward 0.75, training 0.60 (3.00 s against 4.00 s of "
        "env, tools and reward); TRL faster: generation. Generation per token generated: 9000.0 ms against 6000.0 ms "
        "(1.50)."
    )
    assert lines[1] == "- `fastest`: not measured on both sides (a side's runs failed or have not run)."


def test_a_record_saved_part_way_renders_what_ran(tmp_path, monkeypatch):
    """The record is saved after every run: rendered after the first one alone, the other side is 'not run', the
    check is not made (and refuses nothing), and a side with one failed run of two says so beside its medians."""
    import argparse

    plan = [("a", "b"), ("c", "d")]
    first = _run(plan)
    first.update(rep=0, load=(1.0, 1.0, 1.0), rss_kib=6 * 2**20, seconds=90.0)
    for step in first["steps"]:
        step.update(wall=20.0, rollout=8.0, generation=6.0, train=12.0, tokens=210)
    args = argparse.Namespace(
        model="m", tasks=2, group_size=2, max_turns=4, max_new_tokens=128, temperature=1.0, runs=2, steps=1,
        fast_tokens="auto", trl_fast_rows=2, trl_kv_memory=0.2, date="2026-12-08",
    )  # fmt: skip
    monkeypatch.setattr(peer_trl.sys, "argv", ["scripts/bench/peer_trl.py"])
    record, out = tmp_path / "runs.json", tmp_path / "bench.md"
    partial = {"equal": {"project": [first], "trl": []}, "fastest": {"project": [], "trl": []}}
    peer_trl.save_record(record, args, partial, {})
    assert peer_trl.render(record, out) == 0
    text = out.read_text()
    assert "| TRL | not run | - |" in text and "Not checked: a side has not run yet" in text
    dead = {"steps": [], "failed": "exit code 1", "rep": 1, "load": (1.0,), "rss_kib": 2**20, "seconds": 5.0}
    partial["equal"]["project"].append(dead)
    partial["equal"]["trl"].append(first)
    peer_trl.save_record(record, args, partial, {})
    assert peer_trl.render(record, out) == 0
    assert "| project (1 of 2 runs completed) | 20.0 [20.0, 20.0] |" in out.read_text()
