"""The project's chat formats against the official chat templates of their model families.

A model trained here is served with vLLM, which renders a conversation with the model's own
chat template (transformers' Jinja environment) and tokenises the text. The hermes format must
write what Qwen2.5-7B-Instruct's template writes and llama3_json what Llama-3.1-8B-Instruct's
writes, byte for byte, on real BFCL conversations; and every token the project renders itself
(everything but the model's own output) must be the server's tokenization of that text.
"""

import copy
import json
from itertools import groupby
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from nemo_rcgrpo.data.chat_format import (
    OneCallPerMessageError,
    format_spec,
    one_call_per_message,
    render_pieces,
    render_text,
)
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.tokenize import ChatRenderer, ensure_format_tokens
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan, play
from nemo_rcgrpo.models.hf import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
OFFICIAL = {"hermes": "Qwen2.5-7B-Instruct.jinja", "llama3_json": "Llama-3.1-8B-Instruct.jinja"}
BOS = {"hermes": "<|endoftext|>", "llama3_json": "<|begin_of_text|>"}  # Qwen's template writes no bos_token


def official(fmt, messages, tools, add_generation_prompt=False):
    """The conversation as the server renders it: arguments as objects (vLLM parses the JSON strings of
    OpenAI-format calls before templating), no ``tool_calls`` key on messages without calls."""
    served = []
    for m in messages:
        m = copy.deepcopy(m)
        if m.get("tool_calls"):
            for call in m["tool_calls"]:
                args = call["function"].get("arguments")
                if isinstance(args, str):
                    call["function"]["arguments"] = json.loads(args) if args.strip() else {}
        else:
            m.pop("tool_calls", None)
        if m.get("content") is None:
            m["content"] = ""
        served.append(m)
    rendered, _ = render_jinja_template(
        [served],
        tools=tools,
        chat_template=(TEMPLATES / OFFICIAL[fmt]).read_text(),
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS[fmt],
    )
    return rendered[0]


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer("smollm2")  # ChatML control tokens are its own; the Llama ones are added
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    ensure_format_tokens(tok, "llama3_json")
    return tok


def _conversations(suite, step=40):
    """Every 40th of the 800 tasks (all four categories), gold trajectories in both modes, reward goal applied."""
    for task in list(suite)[::step]:
        for mode in ("merged", "per_turn"):
            played = play(task, gold_plan(task), mode)
            yield task.id, mode, RewardGoal().apply(played.messages, task.scenario % 2 == 0), played.tools


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_renderings_are_byte_identical_to_the_official_template(suite, fmt):
    parallel = 0
    for task_id, mode, messages, tools in _conversations(suite):
        parallel += sum(len(m.get("tool_calls") or []) > 1 for m in messages)
        served = one_call_per_message(messages) if fmt == "llama3_json" else messages
        assert render_text(messages, tools, fmt, "full") == official(fmt, served, tools), (task_id, mode)
        for k in range(1, len(served)):  # every prompt a rollout is generated from
            if served[k]["role"] == "assistant":
                prompt = render_text(served[:k], tools, fmt, "full") + "".join(
                    p.text for p in format_spec(fmt).generation_prompt()
                )
                assert prompt == official(fmt, served[:k], tools, add_generation_prompt=True), (task_id, mode, k)
    assert parallel > 10  # the sample holds parallel-call turns (split for llama3_json)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_project_tokens_are_the_servers_tokenization(suite, tokenizer, fmt):
    """Each run of untrained tokens (prompts, tool results, headers) equals the tokenizer applied to the
    template's text of that run, special tokens recognised, as the server tokenises a prompt; the trained
    runs are the model's own output and its end-of-turn token."""
    renderer = ChatRenderer(tokenizer, fmt, renderer="project", tool_description="full")
    eot = tokenizer.convert_tokens_to_ids(renderer.spec.stop_tokens[0])
    checked = 0
    for task_id, mode, messages, tools in _conversations(suite):
        tok = renderer.render(messages, tools)
        id_runs, pos = [], 0
        for m, g in groupby(tok.mask):
            n = len(list(g))
            id_runs.append((m, tok.ids[pos : pos + n]))
            pos += n
        text_runs = [
            (t, "".join(p.text for p in g))
            for t, g in groupby(render_pieces(messages, tools, fmt, "full"), key=lambda p: p.train)
        ]
        assert [m for m, _ in id_runs] == [t for t, _ in text_runs]
        for (trained, ids), (_, text) in zip(id_runs, text_runs):
            if trained:
                body = text[: -len(renderer.spec.stop_tokens[0])]
                assert ids == tokenizer(body, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [eot]
            else:
                assert ids == tokenizer(text, add_special_tokens=False)["input_ids"], (task_id, mode)
                checked += 1
    assert checked > 100


def test_edge_cases_match_the_official_templates():
    """Non-ASCII text and arguments (tojson writes them unescaped), whitespace the Llama template trims,
    consecutive tool results (one user block in Qwen's), content beside a call, a plain-text reply."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "café",
                "description": "ünïcode — “quotes” <b>",
                "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
            },
        }
    ]

    def call(x):
        return {"id": "c", "type": "function", "function": {"name": "café", "arguments": json.dumps({"x": x})}}

    messages = [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "  Ça va? <|im_end|> 日本\n\n"},
        {"role": "assistant", "content": "Calling twice.", "tool_calls": [call("é"), call("ß & <tag>")]},
        {"role": "tool", "content": '{"ok": "ü"}'},
        {"role": "tool", "content": "plain\nresult "},
        {"role": "assistant", "content": "  Done — ✓ \n"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": None, "tool_calls": [call("z")]},
        {"role": "tool", "content": "[1, 2]"},
    ]
    assert render_text(messages, tools, "hermes") == official("hermes", messages, tools)
    llama = one_call_per_message(messages)
    assert [m["role"] for m in llama[2:6]] == ["assistant", "tool", "assistant", "tool"]
    assert render_text(messages, tools, "llama3_json") == official("llama3_json", llama, tools)
    with pytest.raises(Exception, match="single tool-calls"):  # the official template refuses parallel calls
        official("llama3_json", messages, tools)
    with pytest.raises(OneCallPerMessageError):  # a parallel message without one result per call
        one_call_per_message(messages[:4])


def test_the_7b_and_8b_recipes_use_the_official_renderings():
    """The deliberate differences (compact tool list) are options that no 7B/8B recipe uses."""
    from nemo_rcgrpo.utils.config import compose

    paths = sorted(ROOT.glob("conf/*[78]b.yaml"))
    assert len(paths) == 16
    for path in paths:  # as composed (the model group sets the chat section)
        chat = compose(path.stem).get("chat") or {}
        assert chat.get("tool_description") == "full", path.name
        assert chat.get("format") == ("hermes" if "qwen" in path.name else "llama3_json"), path.name


def test_parallel_turns_split_by_call_id():
    """Results follow their own call (matched by id); a call without a result (done) stays a message of its own;
    a result that answers no call (a parse error's) follows the last pair."""

    def call(i, name):
        return {"id": i, "type": "function", "function": {"name": name, "arguments": "{}"}}

    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [call("a", "ls"), call("b", "pwd"), call("c", "done")]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "call_x", "content": "Error: could not parse tool call"},
    ]
    out = one_call_per_message(messages)
    shape = [(m["role"], [c["id"] for c in m.get("tool_calls") or []] or m.get("tool_call_id")) for m in out]
    assert shape == [
        ("user", None),
        ("assistant", ["a"]),
        ("tool", "a"),
        ("assistant", ["b"]),
        ("tool", "b"),
        ("assistant", ["c"]),
        ("tool", "call_x"),
    ]
    assert render_text(messages, None, "llama3_json") == official("llama3_json", out, None)


def test_llama3_json_rollouts_refuse_parallel_calls(suite):
    """A served Llama conversation cannot continue after a message with two calls (its template refuses to
    render it), so the engine answers such a message with an error instead of running the calls."""
    from nemo_rcgrpo.envs.bfcl.config import BFCLSettings
    from nemo_rcgrpo.envs.config import EnvConfig
    from nemo_rcgrpo.envs.sources import make_opener
    from nemo_rcgrpo.generation.base import Completion, SamplingParams
    from nemo_rcgrpo.rollout.multi_turn import RolloutEngine, RolloutSpec

    tok = load_tokenizer("smollm2")
    ensure_format_tokens(tok, "llama3_json")
    renderer = ChatRenderer(tok, "llama3_json", tool_description="compact")

    class Two:
        version = 0

        def generate(self, prompts, params):
            text = '{"name": "ls", "parameters": {}}; {"name": "pwd", "parameters": {}}'
            ids = renderer.encode_text(text) + [params.stop_token_ids[0]]
            return [Completion(ids, [-0.1] * len(ids), "stop") for _ in prompts]

        def update_weights(self, weights, version):
            pass

    engine = RolloutEngine(
        Two(),
        renderer,
        make_opener(EnvConfig(settings=BFCLSettings(mode="merged")), suite),
        SamplingParams(max_new_tokens=64),
        max_turns=1,
    )
    (traj,) = engine.rollout([RolloutSpec(suite["multi_turn_base_0"], 0)])
    assert traj.calls[0] == [{"error": traj.calls[0][0]["error"], "raw": traj.calls[0][0]["raw"]}]
    assert "one tool call per assistant message" in traj.calls[0][0]["error"] and traj.reward == 0.0
