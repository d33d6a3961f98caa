"""BFCL's own code is the oracle of ``rcgrpo eval protocol=bfcl``.

One deterministic stand-in chat server plays fixed answers per entry (ground truth, or a perturbation of it) and
logs every request. BFCL's inference loop (its `OpenAICompletionsHandler` and `inference_multi_turn_FC`, in a
process of its own: tests/data/bfcl_reference.py) and the project's eval are driven against it in turn; every
request (messages, tools, parameters, after JSON normalisation) and every verdict must be the same. Then BFCL's
own `bfcl evaluate` runner scores the result files that the project wrote, to the project's accuracies.

The stand-in decides its answer from the request alone (the model name names the family, the first user message
the entry, the user and assistant messages the turn and step), never from which pipeline asks.
"""

import json
import shutil
import subprocess
import sys
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nemo_rcgrpo.envs.bfcl.executor import named_arguments
from nemo_rcgrpo.envs.calls import parse_call_string
from nemo_rcgrpo.evaluation.run import main as eval_main

REFERENCE = Path(__file__).parents[1] / "data" / "bfcl_reference.py"
CATEGORIES = {"base": "base", "miss_func": "missfunc", "miss_param": "missparam", "long_context": "longcontext"}
FAMILIES = ("truth", "dropped", "changed", "malformed", "earlyholdout", "chatty", "calls34", "endless")
PER_CATEGORY = 3


def _tool_calls(calls):
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{k}",
                "type": "function",
                "function": {"name": n, "arguments": a if isinstance(a, str) else json.dumps(a)},
            }
            for k, (n, a) in enumerate(calls)
        ],
    }


def _text(text="Done."):
    return {"role": "assistant", "content": text}


class Script:
    """A family's fixed answers for one entry, by (turn, step)."""

    def __init__(self, task, family):
        self.family = family
        self.gold = [
            [(c.name, named_arguments(task.tool(c.name), c)) for c in map(parse_call_string, turn)]
            for turn in task.ground_truth
        ]
        self.first = next(t for t, calls in enumerate(self.gold) if calls)
        self.missed = [n for names in task.missed_functions.values() for n in names]
        self.later = {n: a for turn in self.gold for n, a in turn}

    def answer(self, turn, step):
        gold, f, first = self.gold[turn], self.family, turn == self.first
        if f == "chatty":  # every call in its own message after 5 messages of thinking aloud: > 20 messages
            if step < 5:
                return _tool_calls([("think", {"step": step})])
            return _tool_calls([gold[step - 5]]) if step - 5 < len(gold) else _text()
        if f == "endless" and first:  # never stops calling: BFCL force-quits the entry after 20 steps
            return _tool_calls([("think", {"step": step})])
        if step > 0 or not gold:
            return _text()
        if f == "dropped" and first:
            return _tool_calls(gold[:-1]) if len(gold) > 1 else _text()
        if f == "changed" and first:
            name, args = gold[0]
            key = next((k for k, v in args.items() if isinstance(v, str)), None)
            changed = {**args, key: args[key] + "_x"} if key else {**args, "extra": 1}
            return _tool_calls([(name, changed)] + gold[1:])
        if f == "malformed" and first:  # one call's arguments are not JSON
            return _tool_calls(gold + [("cd", "{folder: 'x'")])
        if f == "earlyholdout" and first and self.missed:  # a held-out tool called before it is offered
            name = self.missed[0]
            return _tool_calls([(name, self.later.get(name, {}))] + gold)
        if f == "calls34" and first:
            return _tool_calls(gold + [("think", {"k": k}) for k in range(34 - len(gold))])
        return _tool_calls(gold)


class StandIn:
    def __init__(self, suite, ids):
        self.scripts = {}
        for family in FAMILIES:
            for task_id in ids:
                task = suite[task_id]
                model = f"standin-{family}-{CATEGORIES[task.category]}"
                self.scripts[(model, task.turns[0][0]["content"])] = Script(task, family)
        self.log = defaultdict(list)  # phase -> [(model, first user message, request)]
        self.phase = None  # which bucket the test files requests under; never read by the answers
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = stand_in.reply(body)
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reply(self, body):
        messages = body["messages"]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        first = messages[users[0]]["content"]
        self.log[self.phase].append((body["model"], first, body))
        step = sum(m["role"] == "assistant" for m in messages[users[-1] :])
        message = self.scripts[(body["model"], first)].answer(len(users) - 1, step)
        return {
            "id": "standin",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _entries(suite):
    """PER_CATEGORY entries of each category whose first user message is their own (the stand-in's key)."""
    ids = []
    for category in CATEGORIES:
        tasks = [t for t in suite if t.category == category]
        firsts = defaultdict(int)
        for t in tasks:
            firsts[t.turns[0][0]["content"]] += 1
        ids += [t.id for t in tasks if firsts[t.turns[0][0]["content"]] == 1][:PER_CATEGORY]
    return ids


def _reference(mode, spec, tmp_path):
    spec_path, out_path = tmp_path / f"{mode}_spec.json", tmp_path / f"{mode}_out.json"
    spec_path.write_text(json.dumps(spec))
    env = {"BFCL_PROJECT_ROOT": str(tmp_path / "bfcl_root"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(REFERENCE), mode, str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out_path.read_text())


def _normal(body):
    return json.dumps(body, sort_keys=True)


@pytest.fixture(scope="module")
def compared(suite, tmp_path_factory):
    """Both pipelines against one stand-in: (stand-in, BFCL's runs, the project's records by model, out dirs)."""
    tmp = tmp_path_factory.mktemp("bfcl_oracle")
    ids = _entries(suite)
    stand_in = StandIn(suite, ids)
    models = sorted({m for m, _ in stand_in.scripts})
    runs = [[f"standin-{f}-{CATEGORIES[suite[t].category]}", t] for f in FAMILIES for t in ids]
    try:
        stand_in.phase = "bfcl"
        reference = _reference("infer", {"base_url": stand_in.url, "runs": runs, "models": models}, tmp)
        stand_in.phase = "project"
        records, outs = {}, {}
        for model in models:
            category = next(c for c, a in CATEGORIES.items() if model.endswith(f"-{a}"))
            out = tmp / "eval" / model
            tasks = [t for t in ids if suite[t].category == category]
            assert (
                eval_main(
                    [
                        "policy=endpoint",
                        f"endpoint.url={stand_in.url}",
                        f"endpoint.model={model}",
                        "endpoint.concurrency=1",
                        "protocol=bfcl",
                        f"categories=[{category}]",
                        f"tasks=[{','.join(tasks)}]",
                        f"out_dir={out}",
                        "progress=false",
                    ]
                )
                == 0
            )
            records[model] = {r["task_id"]: r for r in map(json.loads, (out / "trajectories.jsonl").open())}
            outs[model] = out
    finally:
        stand_in.close()
    return stand_in, reference, records, outs, tmp


def test_every_request_is_bfcls(compared):
    stand_in, reference, _, _, _ = compared
    by_run = {phase: defaultdict(list) for phase in ("bfcl", "project")}
    for phase, bucket in by_run.items():
        for model, first, body in stand_in.log[phase]:
            bucket[(model, first)].append(_normal(body))
    assert set(by_run["bfcl"]) == set(by_run["project"]) and len(by_run["bfcl"]) == len(reference)
    differing = {
        run: next(i for i, (a, b) in enumerate(zip(reqs, by_run["project"][run])) if a != b)
        if any(a != b for a, b in zip(reqs, by_run["project"][run]))
        else "count"
        for run, reqs in by_run["bfcl"].items()
        if reqs != by_run["project"][run]
    }
    total = sum(len(r) for r in by_run["bfcl"].values())
    assert not differing, (
        f"{len(differing)} of {len(by_run['bfcl'])} entry-runs differ (first request index): "
        f"{dict(list(differing.items())[:3])}"
    )
    assert total > 10 * len(by_run["bfcl"])  # multi-turn, multi-step episodes, not one request each
    # the families did what they are for: BFCL's own loop shows each behaviour
    first_requests = [json.loads(reqs[0]) for reqs in by_run["bfcl"].values()]
    assert all(
        "tools" in r
        and r["temperature"] == 0.001
        and r["store"] is False
        and "max_tokens" not in r
        and r["messages"][0]["role"] == "user"
        for r in first_requests
    )


def test_every_verdict_is_bfcls(compared):
    _, reference, records, _, _ = compared
    differ, by_family = [], defaultdict(list)
    for ref in reference:
        rec = records[ref["model"]][ref["id"]]
        ours = (
            rec["success"],
            None if rec["success"] else rec["failure_reason"].split(":")[0] + ":" + rec["failure_reason"].split(":")[1],
        )
        theirs = (ref["valid"], ref["error_type"])
        by_family[ref["model"].split("-")[1]].append(theirs)
        if ours != theirs:
            differ.append((ref["model"], ref["id"], theirs, ours))
        assert rec["bfcl_result"]["result"] == ref["result"]  # what BFCL writes for the entry, step for step
    assert not differ, f"{len(differ)} of {len(reference)} verdicts differ: {differ[:5]}"
    # what BFCL decided, family by family (12 entry-runs each): the scenarios exercise what they are meant to
    valid = {f: sum(v for v, _ in vs) for f, vs in by_family.items()}
    assert valid == {
        "truth": 12,
        "dropped": 0,
        "changed": 0,
        "malformed": 0,
        "earlyholdout": 12,
        "chatty": 12,
        "calls34": 12,
        "endless": 0,
    }
    # a message with one undecodable call is discarded whole, so the turn has no model response
    assert {e for _, e in by_family["malformed"]} == {"multi_turn:empty_turn_model_response"}
    assert {e for _, e in by_family["endless"]} == {"multi_turn:force_terminated"}  # more than 20 steps in a turn


def test_chatty_episodes_pass_past_twenty_messages(compared):
    _, _, records, _, _ = compared
    chatty = [r for m, recs in records.items() if "-chatty-" in m for r in recs.values()]
    long = [r for r in chatty if sum(m["role"] == "assistant" for m in r["messages"]) > 20]
    assert long and all(r["success"] for r in long)
    wide = [r for m, recs in records.items() if "-calls34-" in m for r in recs.values()]
    assert any(len(step) == 34 for r in wide for step in r["observations"])


# the families whose files BFCL's own evaluator reads back: every outcome (valid, a wrong state or result, an
# empty turn, a force-quit); every family's result lines already equal BFCL's own (test_every_verdict_is_bfcls)
EVALUATED = ("truth", "changed", "malformed", "endless")


def test_bfcl_evaluate_scores_the_written_result_files_the_same(compared):
    _, _, records, outs, tmp = compared
    outs = {m: out for m, out in outs.items() if m.split("-")[1] in EVALUATED}
    result_dir = tmp / "bfcl_results"
    for model, out in outs.items():
        shutil.copytree(out / "bfcl_result", result_dir, dirs_exist_ok=True)
    rows = _reference(
        "evaluate",
        {
            "result_dir": str(result_dir),
            "score_dir": str(tmp / "bfcl_scores"),
            "models": sorted(outs),
            "categories": ["multi_turn"],
        },
        tmp,
    )
    assert {r["Model"] for r in rows} == set(outs) and len(rows) == 16
    for row in rows:
        model = row["Model"]
        ours = json.loads((outs[model] / "results.json").read_text())["bfcl"]
        category = next(c for c, a in CATEGORIES.items() if model.endswith(f"-{a}"))
        assert float(row["Multi Turn Overall Acc"].rstrip("%")) == pytest.approx(ours["multi_turn_overall"], abs=0.01)
        column = {"base": "Base", "miss_func": "Miss Func", "miss_param": "Miss Param", "long_context": "Long Context"}[
            category
        ]
        assert float(row[column].rstrip("%")) == pytest.approx(ours["categories"][category], abs=0.01)
        assert not ours["leaderboard"] and "not the leaderboard's overall" in ours["note"]


def test_a_slow_or_refused_request_fails_its_entry_and_a_dead_server_stops_the_run(tmp_path, suite):
    """As in BFCL, an entry whose request is refused (HTTP 4xx) or answered later than endpoint.timeout on every
    attempt is that entry's inference error and the evaluation goes on; a server that cannot be reached stops it
    (exit 3, resumable)."""
    import time

    slow, refused = "multi_turn_base_0", "multi_turn_base_1"
    firsts = {suite[t].turns[0][0]["content"]: t for t in (slow, refused, "multi_turn_base_2")}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            task = firsts[next(m["content"] for m in body["messages"] if m["role"] == "user")]
            if task == slow:
                time.sleep(1.0)
            status, reply = (
                (400, {"error": "context too long"})
                if task == refused
                else (
                    200,
                    {
                        "choices": [{"message": {"role": "assistant", "content": "Done."}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                    },
                )
            )
            data = json.dumps(reply).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client gave up waiting
                pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    args = [
        "policy=endpoint",
        f"endpoint.url={url}",
        "endpoint.model=m",
        "endpoint.timeout=0.3",
        "endpoint.max_retries=1",
        "endpoint.backoff=0.01",
        "protocol=bfcl",
        "progress=false",
        "tasks=[multi_turn_base_0,multi_turn_base_1,multi_turn_base_2]",
        "categories=[base]",
    ]
    try:
        assert eval_main([*args, f"out_dir={tmp_path / 'a'}"]) == 0
    finally:
        httpd.shutdown()
        httpd.server_close()
    records = {r["task_id"]: r for r in map(json.loads, (tmp_path / "a" / "trajectories.jsonl").open())}
    assert records[slow]["bfcl_result"]["result"].startswith("Error during inference: endpoint")
    assert "timed out" in records[slow]["bfcl_result"]["result"]
    assert "HTTP 400" in records[refused]["bfcl_result"]["result"]
    assert all(records[t]["failure_reason"].startswith("multi_turn:inference_error") for t in (slow, refused))
    assert isinstance(records["multi_turn_base_2"]["bfcl_result"]["result"], list)  # played, failed by the checker
    # nothing listens any more: the run stops with the endpoint's message, exit 3
    assert eval_main([*args, f"out_dir={tmp_path / 'b'}"]) == 3
