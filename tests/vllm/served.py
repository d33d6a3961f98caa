"""Checks of a served export (tests/vllm/test_served_agreement.py): the server stops at the format's stop token (the
export's generation config) and renders a conversation into the ids training rendered (its own chat template,
reward goal included: the server's /tokenize of its chat prompt)."""

import json
import urllib.request

from nemo_rcgrpo.data.chat_format import format_spec
from nemo_rcgrpo.data.reward_goal import RewardGoal
from nemo_rcgrpo.data.tokenize import ChatRenderer

TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List files.", "parameters": {
    "type": "object", "properties": {"folder": {"type": "string"}, "all": {"type": "boolean"}}, "required": []}}}]


def _post(url, path, body):
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


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
