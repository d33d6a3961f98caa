"""`rcgrpo eval` end to end: reference policies, an OpenAI-compatible endpoint (a local scripted server),
a checkpoint of the CPU pipeline, and what real models do wrong."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nemo_rcgrpo.envs.bfcl.env import merged_prompt
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan
from nemo_rcgrpo.evaluation.compare import main as compare_main
from nemo_rcgrpo.evaluation.run import main as eval_main


def _eval(tmp_path, name, *overrides):
    out = tmp_path / name
    rc = eval_main([f"out_dir={out}", "progress=false", *overrides])
    return rc, out


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("protocol", ["paper", "bfcl"])
def test_oracle_scores_100_and_null_0_on_every_category(tmp_path, protocol):
    rc, out = _eval(tmp_path, "oracle", "policy=oracle", f"protocol={protocol}")
    assert rc == 0
    r = _results(out)
    assert r["overall"] == 100.0 and r["complete"] and r["tasks"] == (80 if protocol == "paper" else 800)
    assert set(r["categories"]) == {"base", "miss_func", "miss_param", "long_context"}
    assert all(c["accuracy"] == 100.0 for c in r["categories"].values())
    assert all(t["outcomes"][0]["failure_reason"] is None for t in r["per_task"])
    rc, out_null = _eval(tmp_path, "null", "policy=null", f"protocol={protocol}")
    assert rc == 0
    n = _results(out_null)
    assert n["overall"] == 0.0 and all(c["accuracy"] == 0.0 for c in n["categories"].values())
    assert all(t["outcomes"][0]["failure_reason"] for t in n["per_task"])
    lines = (out_null / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == n["tasks"] and "messages" in json.loads(lines[0])
    assert "| **overall** |" in (out / "results.md").read_text()
    assert compare_main([str(out), str(out_null), "--labels", "oracle", "null", "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp.md").read_text()
    assert "| oracle | 100.0 | 100.0 | 100.0 | 100.0 | **100.0** |" in table and "| null | 0.0 |" in table
    assert (tmp_path / "cmp.png").stat().st_size > 1000


# ---------------------------------------------------------------------- a scripted OpenAI-compatible server
class _Server:
    """/v1/chat/completions that plays the ground truth (merged episodes) or misbehaves on purpose."""

    def __init__(self, suite, behaviour):
        self.behaviour = behaviour
        self.prompts = {merged_prompt(t): t for t in suite}
        self.requests = 0
        self.fail_first = 0
        self.die_after = None  # answer 503 to every request after this many
        self.first_users = []  # the first user message of every request
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests += 1
                if server.die_after is not None and server.requests > server.die_after:
                    return self._send(503, {"error": "gone"})
                if server.fail_first > 0:
                    server.fail_first -= 1
                    return self._send(503, {"error": "busy"})
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": "no route"})
                status, reply = server.reply(body)
                self._send(status, reply)

            def _send(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reply(self, body):
        assert body["model"] == "scripted" and body["tools"] and body["temperature"] == 0.0
        user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        self.first_users.append(user)
        task = self.prompts.get(user) or next(t for p, t in self.prompts.items() if p in user)  # a goal added
        written = sum(m["role"] == "assistant" for m in body["messages"])
        b = self.behaviour
        if b == "oracle":
            turns = [t for t in gold_plan(task) if t]
            calls = turns[written] if written < len(turns) else [type("C", (), {"name": "done", "kwargs": {}})()]
            return 200, _message(tool_calls=[(c.name, json.dumps(c.kwargs)) for c in calls])
        if b == "malformed":
            return 200, _message(tool_calls=[("cd", "{folder: 'x'"), ("ls", "[1]"), ("", "{}")])
        if b == "endless":
            return 200, _message(tool_calls=[("pwd", "{}")])
        if b == "refuse":
            return 200, _message(content="I'm sorry, I can't help with that.")
        if b == "empty":
            return 200, _message(content=None)
        if b == "too_long":
            return 400, {"error": {"message": "This model's maximum context length is 4096 tokens"}}
        if b == "cut":
            return 200, {
                "choices": [
                    {"message": {"role": "assistant", "content": '{"name": "ls", "argu'}, "finish_reason": "length"}
                ]
            }
        raise AssertionError(b)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _message(content="", tool_calls=()):
    msg = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(tool_calls)
        ]
    return {
        "choices": [{"message": msg, "finish_reason": "tool_calls" if tool_calls else "stop"}],
        "usage": {"completion_tokens": 7},
    }


@pytest.fixture
def server(suite):
    servers = []

    def make(behaviour):
        s = _Server(suite, behaviour)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def _endpoint_args(url, *extra):
    return [
        "policy=endpoint",
        f"endpoint.url={url}",
        "endpoint.model=scripted",
        "endpoint.backoff=0.01",
        "endpoint.concurrency=4",
        *extra,
    ]


def test_endpoint_playing_the_ground_truth_scores_100_with_retries(tmp_path, server):
    s = server("oracle")
    s.fail_first = 3  # transient 503s are retried with backoff
    rc, out = _eval(tmp_path, "ep", *_endpoint_args(s.url, "limit=3"))
    assert rc == 0
    r = _results(out)
    assert r["overall"] == 100.0 and r["tasks"] == 12 and r["policy"]["model"] == "scripted"
    assert s.requests > 12 + 3


def test_the_endpoint_is_conditioned_as_the_checkpoint_is(tmp_path, server):
    """reward_token applies to the endpoint as to a checkpoint: auto reads the served export's training record
    (endpoint.model_path), and the goal goes into the first user message as training wrote it."""
    from nemo_rcgrpo.data.reward_goal import RewardGoal
    from nemo_rcgrpo.utils.provenance import training_record, write_record

    export = tmp_path / "export"
    record = training_record("rctp", "smollm2", "<|high_reward|>", "<|low_reward|>", conditioned=True)
    write_record(
        export, {**record, "reward_goal": {"template": "Goal={token}", "position": "prefix", "separator": " "}}
    )
    goal = RewardGoal(template="Goal={token}", position="prefix", separator=" ")
    for setting, token in (("auto", "high"), ("low", "low"), ("none", None)):
        s = server("oracle")
        rc, out = _eval(
            tmp_path,
            setting,
            *_endpoint_args(
                s.url, "limit=1", "categories=[base]", f"endpoint.model_path={export}", f"reward_token={setting}"
            ),
        )
        assert rc == 0 and _results(out)["overall"] == 100.0
        episodes = [json.loads(l) for l in (out / "trajectories.jsonl").read_text().splitlines()]
        assert [e["reward_token"] for e in episodes] == [token]
        prompt = episodes[0]["messages"][next(i for i, m in enumerate(episodes[0]["messages"]) if m["role"] == "user")]
        if token is None:
            assert all("Goal=" not in u for u in s.first_users) and "Goal=" not in prompt["content"]
        else:
            conditioned = goal.apply([{"role": "user", "content": "X"}], token == "high")[0]["content"]
            assert conditioned.startswith(f"Goal=<|{token}_reward|> ")  # the record's template and position
            assert all(u.startswith(f"Goal=<|{token}_reward|> ") for u in s.first_users) and s.first_users
    # a model_path that is not a folder is one line, before any request
    rc, _ = _eval(
        tmp_path, "missing", *_endpoint_args("http://127.0.0.1:9/v1", f"endpoint.model_path={tmp_path / 'x'}")
    )
    assert rc == 2


@pytest.mark.parametrize(
    "behaviour, reason",
    [
        ("malformed", "more than 3 assistant messages"),  # parse errors become observations; the turn budget ends it
        ("endless", "more than 3 assistant messages"),
        ("refuse", "gold action(s) missing"),
        ("empty", "gold action(s) missing"),
        ("too_long", "endpoint refused the request (HTTP 400)"),
        ("cut", "finish_reason=length"),
    ],
)
def test_what_models_do_wrong_is_scored_not_crashed(tmp_path, server, behaviour, reason):
    s = server(behaviour)
    rc, out = _eval(tmp_path, behaviour, *_endpoint_args(s.url, "limit=1", "categories=[base]", "max_turns=3"))
    assert rc == 0
    r = _results(out)
    assert r["overall"] == 0.0 and r["complete"]
    outcome = r["per_task"][0]["outcomes"][0]
    assert reason in outcome["failure_reason"]
    record = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    if behaviour == "malformed":
        errors = record["observations"][0]
        assert len(errors) == 3 and all(e.startswith("Error") for e in errors)
        assert record["tool_errors"] == 9


def test_dead_endpoint_is_retried_then_reported_and_the_run_resumes(tmp_path, server):
    s = server("oracle")
    s.close()  # nothing listens there any more
    rc, out = _eval(tmp_path, "dead", *_endpoint_args(s.url, "limit=1", "endpoint.max_retries=2"))
    assert rc == 3
    r = _results(out)
    assert not r["complete"] and "did not answer after 3 attempts" in r["error"] and r["tasks"] == 0
    # a server that dies in the middle: the episodes scored before are kept ...
    s = server("oracle")
    s.die_after = 10
    args = _endpoint_args(s.url, "limit=2", "endpoint.max_retries=1", "endpoint.concurrency=1")
    rc, out = _eval(tmp_path, "mid", *args)
    assert rc == 3
    partial = _results(out)
    assert not partial["complete"] and 0 < partial["tasks"] < 8
    kept = {t["task_id"] for t in partial["per_task"]}
    # ... and resume=true against a live server scores only the rest
    s2 = server("oracle")
    rc, out = _eval(tmp_path, "mid", *_endpoint_args(s2.url, "limit=2", "endpoint.concurrency=1"), "resume=true")
    assert rc == 0
    r = _results(out)
    assert r["complete"] and r["tasks"] == 8 and r["overall"] == 100.0
    lines = [json.loads(l) for l in (out / "trajectories.jsonl").read_text().splitlines()]
    assert sorted(l["task_id"] for l in lines) == sorted({l["task_id"] for l in lines}) and len(lines) == 8
    first_user = [next(m["content"] for m in l["messages"] if m["role"] == "user") for l in lines]
    assert len(first_user) == 8 and kept < {l["task_id"] for l in lines}
    assert s2.requests < sum(l["num_turns"] for l in lines)  # the kept episodes were not played again


def test_bad_settings_exit_with_a_message(tmp_path, capsys):
    assert eval_main(["policy=checkpoint", "checkpoint.path=/nonexistent/model", f"out_dir={tmp_path / 'x'}"]) == 2
    assert "not a local HF folder" in capsys.readouterr().err
    rc, out = _eval(tmp_path, "o", "policy=oracle", "limit=1")
    assert rc == 0 and eval_main([f"out_dir={out}", "policy=oracle"]) == 2
    assert "exists" in capsys.readouterr().err


# ---------------------------------------------------------------------- a checkpoint of the CPU pipeline
@pytest.fixture(scope="module")
def stage1_run(tmp_path_factory, data_dir):
    """A stage-1 (RCTP-FT) run of the tiny model: its hf/ export and a checkpoint."""
    from nemo_rcgrpo.train import main

    root = tmp_path_factory.mktemp("stage1")
    assert (
        main(
            [
                "--config-name=rctp_smollm_cpu",
                "model.path=tiny-llama",
                f"data.dir={data_dir}",
                f"run_dir={root / 'run'}",
                "trainer.max_steps=1",
                "trainer.global_batch_size=2",
                "data.max_examples=4",
                "chat.max_length=1536",
                "logging.progress=false",
                "logging.tensorboard=false",
            ]
        )
        == 0
    )
    return root / "run"


@pytest.mark.parametrize("protocol", ["paper", "bfcl"])
def test_checkpoint_evaluates_end_to_end(tmp_path, stage1_run, protocol):
    # bfcl_handler=project: the project's per-turn episodes (BFCL's local-handler path of a checkpoint is
    # tests/functional/test_bfcl_oracle_local.py)
    common = [
        "policy=checkpoint",
        f"protocol={protocol}",
        "limit=1",
        "categories=[base,miss_param]",
        "max_new_tokens=12",
        "max_turns=2",
        "max_total_tokens=1536",
        "chat.tool_description=compact",
        "bfcl_handler=project",
    ]
    rc, out = _eval(tmp_path, "hf", *common, f"checkpoint.path={stage1_run}")
    assert rc == 0
    r = _results(out)
    assert r["policy"]["reward_token"] == "high"  # auto: the RCTP-FT export has the reward tokens
    assert r["tasks"] == 2 and r["complete"]
    records = [json.loads(l) for l in (out / "trajectories.jsonl").read_text().splitlines()]
    # 12 new tokens of a tiny model trained for one step solve nothing (measured: both episodes truncated), and the
    # summary counts the episodes' verdicts, overall and per category
    assert len(records) == 2 and not any(rec["success"] for rec in records)
    assert r["overall"] == 0.0 and r["categories"] == {c: {"accuracy": 0.0, "tasks": 1} for c in ("base", "miss_param")}
    assert all(rec["failure_reason"] for rec in records if not rec["success"])
    assert all(rec["generated_tokens"] > 0 for rec in records)
    # the same weights from checkpoints/step_1 (base model + saved state) give the same greedy episodes
    rc, out2 = _eval(tmp_path, "ckpt", *common, f"checkpoint.path={stage1_run / 'checkpoints' / 'step_1'}")
    assert rc == 0
    again = [json.loads(l) for l in (out2 / "trajectories.jsonl").read_text().splitlines()]
    assert [x["text"] for x in again] == [x["text"] for x in records]


@pytest.mark.parametrize("rate", [1.0, 0.0])
def test_checkpoint_through_the_scripted_generator_plays_the_evaluated_tasks(tmp_path, rate):
    """The generator is built from the evaluation's own settings (`EvalConfig.policy_setup`): with
    task_source=bfcl_micro the scripted generator knows the micro tasks, and its success rate is the score."""
    rc, out = _eval(
        tmp_path,
        f"scripted_{rate}",
        "policy=checkpoint",
        "checkpoint.path=tiny-llama",
        "task_source=bfcl_micro",
        "categories=[base]",
        "limit=6",
        "reward_token=none",
        "generation=scripted",
        f"generation.scripted.success_rate={rate}",
        "max_new_tokens=256",
        "max_turns=4",
        "max_total_tokens=2048",
        "chat.tool_description=compact",
    )
    assert rc == 0
    r = _results(out)
    records = [json.loads(l) for l in (out / "trajectories.jsonl").read_text().splitlines()]
    assert r["tasks"] == 6 and len(records) == 6 and all(rec["task_id"].startswith("micro_") for rec in records)
    assert [rec["success"] for rec in records] == [rate == 1.0] * 6 and r["overall"] == 100.0 * rate
