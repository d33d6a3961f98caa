"""BFCL's local-model pieces (envs/bfcl/local.py): the Llama decoder without eval against BFCL's own on text that
is safe to eval, BFCL's max_tokens by hand, and the handlers being BFCL's classes."""

import pytest

from nemo_rcgrpo.envs.bfcl.local import HANDLERS, decode_execute, handler, llama_decode_execute, max_tokens

# what a Llama model writes (the test's own constant strings: BFCL's decoder evals them)
TEXTS = [
    '[{"name": "cd", "parameters": {"folder": "document"}}, {"name": "ls", "parameters": {}}]',
    '{"name": "mkdir", "parameters": {"dir_name": "temp"}}',
    '<|python_tag|>{"name": "cd", "parameters": {"folder": "a"}}; {"name": "ls", "parameters": {"a": true}}',
    "[{'name': 'echo', 'parameters': {'content': 'x;y', 'file_name': 'a'}}]",  # ';' makes BFCL split: fails
    '[{"name": "ls", "parameters": {"a": true}}]',  # JSON true is no Python name: BFCL's eval fails
    "[]",
    "None",
    "I have completed the request.",
    '{"name": "ls"}',
    "[1, 2]",
    '[{"name": "mean", "parameters": {"numbers": [1, 2.5, -3]}}]',
]


def _bfcl(text):
    bfcl_handler = handler("llama3_1")
    try:
        return bfcl_handler.decode_execute(text, has_tool_call_tag=False)
    except Exception as e:  # noqa: BLE001
        return type(e)


def _ours(text):
    try:
        return llama_decode_execute(text)
    except Exception as e:  # noqa: BLE001
        return type(e)


@pytest.mark.parametrize("text", TEXTS)
def test_the_llama_decoder_decodes_what_bfcls_decodes(text):
    theirs, ours = _bfcl(text), _ours(text)
    if isinstance(theirs, type):  # BFCL failed: so do we (the turn ends either way); the exception may differ
        assert isinstance(ours, type), (text, ours)
    else:
        assert ours == theirs


def test_text_that_eval_would_compute_is_a_decoding_failure():
    with pytest.raises(ValueError):
        llama_decode_execute("[{'name': 'ls', 'parameters': dict(a=__import__('os').getpid())}]")


def test_qwen_decoding_is_bfcls_own():
    text = '<tool_call>\n{"name": "cd", "arguments": {"folder": "a"}}\n</tool_call>\n<tool_call>\n{bad}\n</tool_call>'
    assert decode_execute("qwen_fc", handler("qwen_fc"), text) == ["cd(folder='a')"]  # the bad one is skipped
    assert decode_execute("qwen_fc", handler("qwen_fc"), "no calls") == []


def test_max_tokens_is_bfcls():
    assert max_tokens(1000, 8192) == 4096  # capped at 4096
    assert max_tokens(6000, 8192) == 8192 - 6000 - 2  # what is left of the context
    assert max_tokens(8191, 8192) == 1000  # no room: BFCL asks 1000 and the server refuses


def test_the_handlers_are_bfcls_classes():
    assert {name: type(handler(name)).__name__ for name in HANDLERS} == {
        "llama3_1": "LlamaHandler_3_1",
        "qwen_fc": "QwenFCHandler",
    }


def _play(suite, replies, handler_name="qwen_fc", task_id="multi_turn_base_0"):
    from nemo_rcgrpo.envs.bfcl.local import play_entry_local

    task = suite[task_id]
    return play_entry_local(
        task,
        suite.gold(task),
        lambda prompt, n, turn, step: (replies(turn, step), 1, 1),
        handler_name=handler_name,
        model_name="Qwen/Qwen3-8B",
        count_tokens=len,
        context=10_000_000,
    )


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n5\n</tool_call>",
        '<tool_call>\n{"name": 1, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "ls"}\n</tool_call>',
    ],
)
def test_a_reply_bfcls_handler_cannot_format_back_is_the_entrys_inference_error(suite, bad):
    """QwenFCHandler keeps any JSON inside <tool_call> in the history, and its prompt builder raises on it at the
    next request: in BFCL that is the entry's inference error, and here too, never a crash of the run."""
    run = _play(suite, lambda turn, step: bad if (turn, step) == (0, 0) else "Done.")
    assert run.result.startswith("Error during inference: ") and run.verdict.error_type == "multi_turn:inference_error"


def test_more_than_twenty_steps_in_a_turn_force_quit_the_entry(suite):
    call = '<tool_call>\n{"name": "pwd", "arguments": {}}\n</tool_call>'
    run = _play(suite, lambda turn, step: call)
    assert run.force_quit and len(run.result) == 1 and len(run.result[0]) == 21  # BFCL: count > 20 after step 21
    assert run.verdict.error_type == "multi_turn:force_terminated"
