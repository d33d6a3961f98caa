"""Checks of a served export (tests/vllm/test_served_agreement.py): the server stops at the format's stop token (the
export's generation config) and renders a conversation into the ids training rendered (its own chat template,
reward goal included: the server's /tokenize of its chat prompt)."""

import json
import urllib.request

from nemo_rcgrpo.data.chat_format import format_spec
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.tokenize import ChatRenderer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "List files.",
            "parameters": {
                "type": "object",
                "properties": {"folder": {"type": "string"}, "all": {"type": "boolean"}},
                "required": [],
            },
        },
    }
]


def _post(url, path, body):
    request = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


MESSAGES = RewardGoal().apply(
    [{"role": "system", "content": "You list files."}, {"role": "user", "content": "What is in the docs folder?"}], True
)


def check_rendering(url: str, tok, fmt: str) -> None:
    """The server's chat prompt is the project's rendering (compact tools), id for id, reward token included."""
    served = _post(
        url.removesuffix("/v1"),
        "/tokenize",
        {"model": "policy", "messages": MESSAGES, "tools": TOOLS, "add_generation_prompt": True},
    )["tokens"]
    renderer = ChatRenderer(tok, fmt, tool_description="compact")
    assert served == renderer.render(MESSAGES, TOOLS, add_generation_prompt=True).ids


def forced_stop(url: str, tok, fmt: str) -> tuple[str, int]:
    """(finish_reason, completion tokens) of a reply forced to write the format's stop token first (8 at most)."""
    stop = tok.convert_tokens_to_ids(format_spec(fmt).stop_tokens[0])
    body = {
        "model": "policy",
        "messages": MESSAGES,
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": 8,
        "logit_bias": {str(stop): 100},
    }
    reply = _post(url, "/chat/completions", body)
    return reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]


def check_served(url: str, tok, fmt: str) -> None:
    """A server at ``url`` (…/v1) of an export trained with ``fmt`` and compact tools renders a conversation into
    the training ids and stops at the format's stop token (the export's stop ids)."""
    check_rendering(url, tok, fmt)
    assert forced_stop(url, tok, fmt) == ("stop", 1)


REJECTED = "<tool_call>oops"  # hermes: a call block whose body is not JSON; vLLM's parser hands it back as content


def rejecting_export(source, target, message: str = REJECTED):
    """A copy of the hermes export ``source`` at ``target`` whose model writes ``message`` + <|im_end|> greedily
    at every assistant turn, whatever the conversation: a bigram model. Every layer's output projections are zero,
    so the residual stream is the last token's embedding alone; the embedding of each token of the chain
    (generation prompt's last token, the message's tokens) is a basis vector e_i, and the (untied) output row of the
    token after it is 10 e_i: after RMSNorm its logit is 10 sqrt(hidden), every other logit 0. Returns the ids the
    model writes per turn (the message and the stop token)."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_rcgrpo.models.hf import load_tokenizer

    shutil.copytree(source, target)
    tok = load_tokenizer(str(target))
    fmt = format_spec("hermes")
    reply = tok(message, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(fmt.stop_tokens[0])]
    chain = [ChatRenderer(tok, "hermes").generation_prompt_ids()[-1], *reply]
    config = AutoConfig.from_pretrained(target)
    assert len(set(chain)) == len(chain) <= config.hidden_size, chain  # a bigram repeats at a repeated token
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        emb.zero_()
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        for i, (a, b) in enumerate(zip(chain, chain[1:])):
            emb[a, i] = 1.0
            head[b, i] = 10.0
    with tempfile.TemporaryDirectory() as tmp:  # the weights and config only: the export's other files stay
        model.save_pretrained(tmp)
        for f in target.glob("*.safetensors*"):
            f.unlink()
        for f in Path(tmp).iterdir():
            if f.suffix == ".safetensors" or f.name in ("config.json", "model.safetensors.index.json"):
                shutil.copyfile(f, target / f.name)
    return reply
