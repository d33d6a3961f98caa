"""BFCL's local-model path is the oracle of ``rcgrpo eval protocol=bfcl`` for self-hosted checkpoints.

BFCL runs a Llama-3.1 or Qwen checkpoint on a local path through its handler for the family (`LlamaHandler_3_1`,
`QwenFCHandler`): a prompt it formats itself, sent to ``/v1/completions``. A stand-in completions server plays
fixed answers in each family's format; BFCL's handler (tests/data/bfcl_reference.py, `--local-model-path` with
the server already up) and the project's eval of the same served folder (``policy=endpoint
bfcl_handler=llama3_1|qwen_fc``) must send the same requests (prompt text, max_tokens, temperature, model) and
reach the same verdicts. The checkpoint policy builds the same prompts and feeds the generator the ids vLLM's
completions endpoint makes of them.
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
HANDLERS = {"llama3_1": "tiny-llama", "qwen_fc": "tiny-qwen2"}  # a tiny checkpoint of each family
FAMILIES = ("truth", "malformed", "earlyholdout", "chatty")
PER_CATEGORY = 1  # every category once: the prompts are long, and both sides tokenize each one


def _render(handler, calls):
    if not calls:
        return "Done."
    if handler == "llama3_1":
        return json.dumps([{"name": n, "parameters": a} for n, a in calls])
    return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)


def _position(handler, prompt):
    """(turn, step) of a prompt: the user messages so far, and the assistant messages after the last one."""
    if handler == "llama3_1":
        user = "<|start_header_id|>user<|end_header_id|>"
        tail = prompt[prompt.rindex(user) :]
        return prompt.count(user) - 1, tail.count("<|start_header_id|>assistant<|end_header_id|>") - 1
    starts = [
        i
        for i in range(len(prompt))
        if prompt.startswith("<|im_start|>user\n", i) and not prompt.startswith("<|im_start|>user\n<tool_response>", i)
    ]
    return len(starts) - 1, prompt[starts[-1] :].count("<|im_start|>assistant\n") - 1


class Script:
    def __init__(self, task, family, handler):
        self.family, self.handler = family, handler
        self.gold = [
            [(c.name, named_arguments(task.tool(c.name), c)) for c in map(parse_call_string, turn)]
            for turn in task.ground_truth
        ]
        self.first = next(t for t, calls in enumerate(self.gold) if calls)
        self.missed = [n for names in task.missed_functions.values() for n in names]
        self.later = {n: a for turn in self.gold for n, a in turn}

    def answer(self, turn, step):
        gold, f = self.gold[turn], self.family
        if f == "chatty":
            if step < 5:
                return _render(self.handler, [("think", {"step": step})])
            return _render(self.handler, [gold[step - 5]] if step - 5 < len(gold) else [])
        if step > 0 or not gold:
            return "Done."
        if f == "malformed" and turn == self.first:  # one call that does not decode
            good = _render(self.handler, gold)
            return (
                good + '\n<tool_call>\n{"name": "cd", "arguments": {folder: 1}}\n</tool_call>'
                if self.handler == "qwen_fc"
                else good[:-1] + ', {"name": "cd", "parameters": {folder: 1}}]'
            )
        if f == "earlyholdout" and turn == self.first and self.missed:
            name = self.missed[0]
            return _render(self.handler, [(name, self.later.get(name, {}))] + gold)
        return _render(self.handler, gold)


class StandIn:
    def __init__(self, suite, ids, folders):
        self.scripts = defaultdict(dict)  # model -> first user message -> Script
        self.handler_of = {}
        for (handler, family), folder in folders.items():
            self.handler_of[str(folder)] = handler
            for task_id in ids:
                task = suite[task_id]
                self.scripts[str(folder)][task.turns[0][0]["content"].strip()] = Script(task, family, handler)
        self.log = defaultdict(list)
        self.phase = None
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # BFCL waits for the server: GET /v1/models
                self._send({"object": "list", "data": []})

            def do_POST(self):
                self._send(stand_in.reply(json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

            def _send(self, payload):
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def reply(self, body):
        prompt, scripts = body["prompt"], self.scripts[body["model"]]
        first = min((prompt.index(text), text) for text in scripts if text in prompt)[1]
        self.log[self.phase].append((body["model"], first, body))
        turn, step = _position(self.handler_of[body["model"]], prompt)
        text = scripts[first].answer(turn, step)
        return {
            "id": "standin",
            "object": "text_completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107},
        }

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _entries(suite):
    """PER_CATEGORY entries of each category whose first user message is no other entry's (the stand-in's key:
    the same scenario shares it across categories)."""
    firsts = defaultdict(int)
    for t in suite:
        firsts[t.turns[0][0]["content"].strip()] += 1
    ids = []
    for category in ("base", "miss_func", "miss_param", "long_context"):
        ids += [t.id for t in suite if t.category == category and firsts[t.turns[0][0]["content"].strip()] == 1][
            :PER_CATEGORY
        ]
    return ids


def _reference(mode, spec, tmp):
    spec_path, out_path = tmp / f"{mode}.json", tmp / f"{mode}_out.json"
    spec_path.write_text(json.dumps(spec))
    env = {
        "BFCL_PROJECT_ROOT": str(tmp / "root"),
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, str(REFERENCE), mode, str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out_path.read_text())


@pytest.fixture(scope="module")
def compared(suite, tmp_path_factory):
    from nemo_rcgrpo.models.hf import tiny_model_dir

    tmp = tmp_path_factory.mktemp("bfcllocal")
    folders = {}
    for handler, tiny in HANDLERS.items():
        for family in FAMILIES:  # one served folder per family: the model name tells the stand-in which
            folder = tmp / f"standin-{family}-{handler.replace('_', '')}"
            shutil.copytree(tiny_model_dir(tiny), folder)
            folders[(handler, family)] = folder
    ids = _entries(suite)
    stand_in = StandIn(suite, ids, folders)
    reference, records, outs = [], {}, {}
    try:
        stand_in.phase = "bfcl"
        runs = [[str(folder), t] for folder in folders.values() for t in ids]
        reference = _reference(
            "infer_local",
            {"base_url": stand_in.url, "runs": runs, "handlers": {str(f): h for (h, _), f in folders.items()}},
            tmp,
        )
        stand_in.phase = "project"
        for (handler, family), folder in folders.items():
            out = tmp / "eval" / folder.name
            assert (
                eval_main(
                    [
                        "policy=endpoint",
                        f"endpoint.url={stand_in.url}",
                        f"endpoint.model={folder}",
                        f"endpoint.model_path={folder}",
                        "endpoint.concurrency=1",
                        "reward_token=none",
                        "protocol=bfcl",
                        f"bfcl_handler={handler}",
                        f"bfcl_registry={folder.name}",
                        f"tasks=[{','.join(ids)}]",
                        f"out_dir={out}",
                        "progress=false",
                    ]
                )
                == 0
            )
            records[str(folder)] = {r["task_id"]: r for r in map(json.loads, (out / "trajectories.jsonl").open())}
            outs[folder.name] = (handler, out)
    finally:
        stand_in.close()
    return stand_in, reference, records, outs, tmp


def test_every_completions_request_is_bfcls(compared):
    stand_in, reference, _, _, _ = compared
    runs = {p: defaultdict(list) for p in ("bfcl", "project")}
    for phase in runs:
        for model, first, body in stand_in.log[phase]:
            runs[phase][(model, first)].append(json.dumps(body, sort_keys=True))
    assert set(runs["bfcl"]) == set(runs["project"]) and len(runs["bfcl"]) == len(reference)
    differing = [run for run, reqs in runs["bfcl"].items() if reqs != runs["project"][run]]
    assert not differing, f"{len(differing)} of {len(runs['bfcl'])} entry-runs differ, e.g. {differing[:2]}"
    bodies = [json.loads(b) for reqs in runs["bfcl"].values() for b in reqs]
    assert len(bodies) > 5 * len(runs["bfcl"])
    assert all(
        set(b) == {"model", "prompt", "max_tokens", "temperature"}
        and b["temperature"] == 0.001
        and 0 < b["max_tokens"] <= 4096
        for b in bodies
    )
    assert any(b["prompt"].startswith("<|begin_of_text|>") for b in bodies)  # Llama-3.1's hand-built prompt
    assert any("# Tools" in b["prompt"] and "<tools>" in b["prompt"] for b in bodies)  # QwenFCHandler's


def test_every_verdict_is_bfcls(compared):
    _, reference, records, _, _ = compared
    differ, valid = [], defaultdict(int)
    for ref in reference:
        rec = records[ref["model"]][ref["id"]]
        ours = (rec["success"], None if rec["success"] else ":".join(rec["failure_reason"].split(":")[:2]))
        if ours != (ref["valid"], ref["error_type"]):
            differ.append((ref["model"], ref["id"], (ref["valid"], ref["error_type"]), ours))
        assert rec["bfcl_result"]["result"] == ref["result"]
        valid[Path(ref["model"]).name] += ref["valid"]
    assert not differ, f"{len(differ)} of {len(reference)} verdicts differ: {differ[:4]}"
    n = len({ref["id"] for ref in reference})
    # Llama's JSON true/false/null is not Python, so BFCL's own decoder (eval) fails on calls that use them:
    # fewer ground-truth entries pass in Llama's format than in Qwen's, on both sides alike
    assert valid["standin-truth-qwenfc"] == n and 0 < valid["standin-truth-llama31"] <= n
    assert valid["standin-malformed-llama31"] == 0  # one bad call fails Llama's whole message
    assert valid["standin-malformed-qwenfc"] == n  # Qwen's parser skips the bad <tool_call> and runs the rest


def test_bfcl_evaluate_scores_the_local_result_files_the_same(compared):
    _, _, _, outs, tmp = compared
    result_dir = tmp / "bfcl_results"
    for _, out in outs.values():
        shutil.copytree(out / "bfcl_result", result_dir, dirs_exist_ok=True)
    rows = _reference(
        "evaluate",
        {
            "result_dir": str(result_dir),
            "score_dir": str(tmp / "bfcl_scores"),
            "models": sorted(outs),
            "handlers": {m: h for m, (h, _) in outs.items()},
            "categories": ["multi_turn"],
        },
        tmp,
    )
    assert {r["Model"] for r in rows} == set(outs)
    for row in rows:
        ours = json.loads((outs[row["Model"]][1] / "results.json").read_text())["bfcl"]
        assert float(row["Multi Turn Overall Acc"].rstrip("%")) == pytest.approx(ours["multi_turn_overall"], abs=0.01)


def test_a_checkpoint_is_prompted_as_bfcls_local_handler_prompts_it(tmp_path, suite):
    """policy=checkpoint: BFCL's prompt text for the checkpoint's family, its ids as vLLM's completions endpoint
    makes them, BFCL's max_tokens; a prompt that no longer fits the model's context is BFCL's inference error."""
    from transformers import AutoConfig, AutoTokenizer

    from nemo_rcgrpo.envs.bfcl.local import handler, max_tokens
    from nemo_rcgrpo.envs.bfcl.official import bfcl_entry
    from nemo_rcgrpo.evaluation.config import EvalConfig
    from nemo_rcgrpo.models.setup import load_tokenizer_and_model

    # an export of the tiny Qwen2 checkpoint as stage 1 writes one: the chat format's tokens added
    tokenizer, model = load_tokenizer_and_model(
        EvalConfig(out_dir=str(tmp_path), policy="checkpoint").policy_setup("tiny-qwen2")
    )
    task = "multi_turn_base_1"
    entry = bfcl_entry(task)
    h = handler("qwen_fc")
    data = h.add_first_turn_message_prompting(h._pre_query_processing_prompting(entry), entry["question"][0])
    first_prompt = h._format_prompt(data["message"], data["function"])
    context = len(tokenizer.tokenize(first_prompt)) + 2 + 24  # room for 24 new tokens, then no more
    model.config.max_position_embeddings = context
    folder = tmp_path / "short"
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    served = AutoTokenizer.from_pretrained(str(folder))  # what BFCL (and a vLLM server) load from the folder
    assert served.tokenize(first_prompt) == tokenizer.tokenize(first_prompt)
    assert AutoConfig.from_pretrained(str(folder)).max_position_embeddings == context
    out = tmp_path / "eval"
    assert (
        eval_main(
            [
                "policy=checkpoint",
                f"checkpoint.path={folder}",
                "protocol=bfcl",
                f"tasks=[{task}]",
                "categories=[base]",
                "reward_token=none",
                f"out_dir={out}",
                "progress=false",
            ]
        )
        == 0
    )
    result = json.loads((out / "results.json").read_text())
    assert result["policy"]["handler"] == "QwenFCHandler" and "local model" in result["policy"]["pipeline"]
    record = json.loads((out / "trajectories.jsonl").read_text().splitlines()[0])
    assert record["prompt"] == first_prompt and max_tokens(len(tokenizer.tokenize(first_prompt)), context) == 24
    # the first turn ran (at most 24 tokens, whatever the random model wrote); a later, longer prompt does not fit
    assert record["bfcl_result"]["result"].startswith("Error during inference: the prompt is")
    assert record["failure_reason"].startswith("multi_turn:inference_error")
    assert 0 < record["generated_tokens"] <= 24 * record["num_turns"]
