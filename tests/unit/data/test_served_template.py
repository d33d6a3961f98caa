"""Every export is served as trained: its own chat template, rendered with transformers' Jinja (the one vLLM's chat
endpoint uses), writes what the project rendered in training, byte for byte, for both formats and both tool
descriptions with the reward goal; its bos, eos and generation config stop where training's format stops; the
7B/8B recipes' exports carry the official templates unchanged."""

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.utils.chat_template_utils import render_jinja_template

from nemo_rcgrpo.config_schema import ChatConfig
from nemo_rcgrpo.data.chat_format import format_spec, render_text
from nemo_rcgrpo.data.served_template import OFFICIAL, ServedTemplateError, served_template
from nemo_rcgrpo.data.tokenize import ChatRenderer, ensure_format_tokens
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.models.setup import export_hf
from tests.unit.data.test_official_templates import _conversations

ROOT = Path(__file__).resolve().parents[3]


def _served(messages):
    """The conversation as vLLM hands it to the template (arguments parsed, no empty tool_calls, content '')."""
    out = []
    for m in copy.deepcopy(messages):
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str):
                call["function"]["arguments"] = json.loads(args) if args.strip() else {}
        if not m.get("tool_calls"):
            m.pop("tool_calls", None)
        m["content"] = m.get("content") or ""
        out.append(m)
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(format, tool description): export folder}: a tiny random model on SmolLM2's tokenizer, exported."""
    out = {}
    for fmt in OFFICIAL:
        for description in ("full", "compact"):
            tok = load_tokenizer("smollm2")
            tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
            ensure_format_tokens(tok, fmt)
            model = LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=len(tok),
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                )
            )
            model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
            before = (tok.chat_template, tok.eos_token, copy.deepcopy(model.generation_config.to_dict()))
            folder = tmp_path_factory.mktemp(f"{fmt}_{description}") / "hf"
            export_hf(model, tok, folder, None, chat=ChatConfig(format=fmt, tool_description=description))
            # the run's own tokenizer and model are left as they were (training may go on after an export)
            assert (tok.chat_template, tok.eos_token, model.generation_config.to_dict()) == before
            out[fmt, description] = folder
    return out


@pytest.mark.parametrize("fmt", list(OFFICIAL))
@pytest.mark.parametrize("description", ["full", "compact"])
def test_the_exports_template_renders_what_training_rendered(suite, exports, fmt, description):
    folder = exports[fmt, description]
    tok = AutoTokenizer.from_pretrained(folder)
    template = tok.chat_template
    assert template == served_template(fmt, description)
    prompts = 0
    goals = 0
    for task_id, mode, messages, tools in _conversations(suite, step=80):  # the reward goal applied
        goals += "[Reward Goal: <|" in render_text(messages, tools, fmt, description)
        served = _served(messages)
        if format_spec(fmt).one_call_per_message:
            from nemo_rcgrpo.data.chat_format import one_call_per_message

            served = _served(one_call_per_message(messages))
        rendered, _ = render_jinja_template([served], tools=tools, chat_template=template, bos_token=tok.bos_token)
        assert rendered[0] == render_text(messages, tools, fmt, description), (task_id, mode)
        for k in range(1, len(served)):  # every prompt a served turn is generated from
            if served[k]["role"] == "assistant":
                prompt, _ = render_jinja_template(
                    [served[:k]],
                    tools=tools,
                    chat_template=template,
                    bos_token=tok.bos_token,
                    add_generation_prompt=True,
                )
                expected = render_text(served[:k], tools, fmt, description) + "".join(
                    p.text for p in format_spec(fmt).generation_prompt()
                )
                assert prompt[0] == expected, (task_id, mode, k)
                prompts += 1
    assert prompts > 20 and goals > 10
    if description == "compact":  # the compact list is what the template wrote, not the JSON schemas
        assert '"type": "function"' not in rendered[0] and '"type": "function"' in json.dumps(tools)


@pytest.mark.parametrize("fmt", list(OFFICIAL))
def test_the_export_stops_and_starts_where_the_format_does(exports, fmt):
    folder = exports[fmt, "compact"]
    tok = AutoTokenizer.from_pretrained(folder)
    spec = format_spec(fmt)
    stops = [tok.convert_tokens_to_ids(t) for t in spec.stop_tokens]
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == (stops if len(stops) > 1 else stops[0])
    assert tok.eos_token == spec.stop_tokens[0]
    if fmt == "llama3_json":
        assert tok.bos_token == "<|begin_of_text|>" and generation["bos_token_id"] == tok.bos_token_id
        assert "<|python_tag|>" in tok.get_vocab()  # vLLM's llama3_json parser refuses to start without it
    # the project's renderer over the export is the project's (its template is one the project ships)
    assert ChatRenderer(tok, fmt, tool_description="compact").renderer == "project"


def test_the_full_templates_are_the_official_ones_unchanged():
    """What a 7B/8B recipe's export carries (tool_description=full: test_official_templates checks the recipes)
    is the published template, the test copy of which the official renderings are checked against."""
    for fmt, name in OFFICIAL.items():
        official = (ROOT / "tests" / "data" / "chat_templates" / name).read_text()
        assert served_template(fmt, "full") == official
        assert served_template(fmt, "compact") != official
    with pytest.raises(ServedTemplateError):
        served_template("hermes", "terse")


def test_a_plugin_format_keeps_its_tokenizers_template(tmp_path):
    tok = load_tokenizer("smollm2")
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    export_hf(model, tok, tmp_path / "hf", None, chat=ChatConfig(format="a_plugin_format"))
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == tok.chat_template
    assert torch.equal(LlamaForCausalLM.from_pretrained(tmp_path / "hf").lm_head.weight, model.lm_head.weight)


def test_hermes_history_is_the_servers_retokenisation_across_mask_boundaries(suite):
    """A server re-tokenises a whole conversation's text: for hermes the training ids of real BFCL conversations
    (gold trajectories, reward goal applied) equal that, across the boundaries between trained and untrained runs
    too (an assistant message, its <|im_end|>, the "\\n" and the next header). llama3_json does not hold this with
    SmolLM2's tokenizer (the assistant header's "\\n\\n" is one token when generating, two before a call in history:
    docs/vllm.md), so it is not asserted here."""
    from nemo_rcgrpo.data.chat_format import render_text

    for description in ("full", "compact"):
        tok = load_tokenizer("smollm2")
        tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
        renderer = ChatRenderer(tok, "hermes", tool_description=description, renderer="project")
        checked = 0
        for task_id, mode, messages, tools in _conversations(suite, step=40):
            text = render_text(messages, tools, "hermes", description)
            assert renderer.render(messages, tools).ids == tok(text, add_special_tokens=False)["input_ids"], task_id
            checked += 1
        assert checked == 40
