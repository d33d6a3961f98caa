"""BFCL's local-model path (bfcl-eval 2026.3.23): how `bfcl generate` runs a self-hosted checkpoint.

For a model on a local path BFCL does not use chat completions. Its handler for the family builds the prompt
text itself (``_format_prompt``), sends it to ``/v1/completions`` with ``max_tokens = min(4096, context - prompt
tokens - 2)``, parses the text back with its own decoder, and plays BFCL's *prompting* loop
(``BaseHandler.inference_multi_turn_prompting``): the held-out docs of a miss_func turn are written into that
turn's user message (``DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING``) while the tool list in the prompt
stays the first turn's; an execution result goes back as ``{role: tool, name: <call text>, content}``.

Handlers (``HANDLERS``): ``llama3_1`` is BFCL's ``LlamaHandler_3_1`` (Llama-3.1-8B-Instruct-FC); ``qwen_fc`` its
``QwenFCHandler``, written for Qwen3: BFCL has no Qwen2.5 entry, so a Qwen2.5 checkpoint gets what BFCL runs with
``QwenFCHandler`` on a local path (the Qwen3 tools block, no default system line; docs/evaluation.md lists how
that differs from Qwen2.5's own template). The handler objects are BFCL's own classes, made without their server
or client (``object.__new__``): their prompt building, response parsing and history methods are pure and run as
they are. One piece is replaced: ``LlamaHandler_3_1.decode_execute`` ``eval()``s the model's text, and here the
same function reads it with ``ast.literal_eval`` (the same result on every literal text; an expression that eval
would compute is a decoding failure, which ends the turn as BFCL's failures do).
"""

from __future__ import annotations

import ast
import importlib
import json
import time
from types import SimpleNamespace
from typing import Callable

from nemo_rcgrpo.envs.bfcl.official import EntryRun, SafeExecutor, bfcl, bfcl_entry, inference_error
from nemo_rcgrpo.envs.bfcl.reward import GoldReplay, OfficialChecker
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask

_LOCAL = "bfcl_eval.model_handler.local_inference"
# name -> (module, class, the registry name of BFCL's model table that uses it)
HANDLERS = {
    "llama3_1": (f"{_LOCAL}.llama_3_1", "LlamaHandler_3_1", "meta-llama/Llama-3.1-8B-Instruct-FC"),
    "qwen_fc": (f"{_LOCAL}.qwen_fc", "QwenFCHandler", "Qwen/Qwen3-8B-FC"),
}
# the model_name of those entries in BFCL's model table: the handler's own name for the model, which BFCL's
# executor writes into its instance names (and so into rewritten call text); a local path never replaces it
BFCL_MODEL_NAMES = {"llama3_1": "meta-llama/Llama-3.1-8B-Instruct", "qwen_fc": "Qwen/Qwen3-8B"}
MAX_NEW_TOKENS = 4096  # BFCL's cap of max_tokens (base_oss_handler._query_prompting)
CHAT_FORMAT_HANDLERS = {"llama3_json": "llama3_1", "hermes": "qwen_fc"}  # the project's chat formats


def handler(name: str):
    """BFCL's handler object for ``name``, without its server or OpenAI client."""
    bfcl()  # BFCL_PROJECT_ROOT before any bfcl_eval import
    module, cls, _ = HANDLERS[name]
    return object.__new__(getattr(importlib.import_module(module), cls))


def llama_decode_execute(result: str) -> list[str]:
    """``LlamaHandler_3_1.decode_execute`` with ``ast.literal_eval`` where BFCL ``eval()``s the model's text."""
    result = result.replace("<|python_tag|>", "")
    if ";" in result:
        function_calls = [json.loads(func_call) for func_call in result.split(";")]
    else:
        function_calls = ast.literal_eval(result)
        if type(function_calls) == dict:  # noqa: E721 - BFCL's own test
            function_calls = [function_calls]
    execution_list = []
    for func_call in function_calls:
        name = func_call["name"]
        params = func_call["parameters"]
        execution_list.append(f"{name}({','.join([f'{k}={repr(v)}' for k, v in params.items()])})")
    return execution_list


def decode_execute(name: str, handler_object, text: str) -> list[str]:
    if name == "llama3_1":
        return llama_decode_execute(text)
    return handler_object.decode_execute(text, has_tool_call_tag=False)  # QwenFCHandler's: evals nothing it reads


def max_tokens(prompt_tokens: int, context: int) -> int:
    """BFCL's max_tokens for a prompt of ``prompt_tokens`` (``len(tokenizer.tokenize(prompt))``)."""
    if context < prompt_tokens + 2:
        return 1000  # BFCL asks for 1000 tokens and lets the server refuse
    return min(MAX_NEW_TOKENS, context - prompt_tokens - 2)


# complete(prompt text, max_tokens, turn, step) -> (text, prompt_tokens, completion_tokens); raises InferenceError
Complete = Callable[[str, int, int, int], tuple]


def play_entry_local(
    task: BFCLTask,
    gold: GoldReplay,
    complete: Complete,
    *,
    handler_name: str,
    model_name: str,
    count_tokens: Callable[[str], int],
    context: int,
    max_steps: int | None = None,
    edit_first_turn: Callable[[list], list] | None = None,
    fatal: tuple[type, ...] = (),
) -> EntryRun:
    """``task`` through BFCL's prompting loop with its ``handler_name`` handler; ``complete`` answers each prompt.
    Whatever an entry raises (BFCL's handler too, on a reply it cannot format back) is BFCL's inference error
    for that entry, except the ``fatal`` exceptions (a dead server)."""
    b = bfcl()
    from bfcl_eval.constants.default_prompts import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING as HOLDOUT

    max_steps = b.max_steps if max_steps is None else max_steps
    h = handler(handler_name)
    entry = bfcl_entry(task.id)
    holdout = entry.get("missed_function", {})
    executor = SafeExecutor(task, model_name)
    checker = OfficialChecker(gold)
    run = EntryRun(result=[], executor=executor)
    data = h._pre_query_processing_prompting(entry)
    try:
        for turn, turn_messages in enumerate(entry["question"]):
            if str(turn) in holdout:
                turn_messages = [{"role": "user", "content": HOLDOUT.format(functions=holdout[str(turn)])}]
            if turn == 0 and edit_first_turn is not None:
                turn_messages = edit_first_turn(turn_messages)
            data = (h.add_first_turn_message_prompting if turn == 0 else h._add_next_turn_user_message_prompting)(
                data, turn_messages
            )
            responses, inputs, outputs, latencies, results, decoded_steps, step = [], [], [], [], [], 0, 0
            while True:
                prompt = h._format_prompt(data["message"], data["function"])
                if not run.prompts:  # the first prompt, for the record (later ones extend it)
                    run.prompts.append(prompt)
                started = time.perf_counter()
                text, prompt_tokens, completion_tokens = complete(
                    prompt, max_tokens(count_tokens(prompt), context), turn, step
                )
                run.requests += 1
                latencies.append(time.perf_counter() - started)
                reply = h._parse_query_response_prompting(
                    SimpleNamespace(
                        choices=[SimpleNamespace(text=text)],
                        usage=SimpleNamespace(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
                    )
                )
                data = h._add_assistant_message_prompting(data, reply)
                responses.append(reply["model_responses"])
                inputs.append(reply["input_token"])
                outputs.append(reply["output_token"])
                try:
                    decoded = decode_execute(handler_name, h, reply["model_responses"])
                except Exception:  # noqa: BLE001 - as BFCL: an undecodable response ends the turn, unexecuted
                    break
                reply["model_responses_decoded"] = decoded
                if b.is_empty_execute_response(decoded):
                    break
                observed = executor.execute(decoded)
                decoded_steps += 1
                results += observed
                run.observations.append(observed)
                data = h._add_execution_results_prompting(data, observed, reply)
                step += 1
                if step > max_steps:
                    run.force_quit = True
                    break
            run.result.append(responses)
            run.input_token_count.append(inputs)
            run.output_token_count.append(outputs)
            run.latency.append(latencies)
            checker.end_turn(turn, executor.instances, results, decoded_steps)
            if run.force_quit:
                break
    except fatal:
        raise
    except Exception as e:  # noqa: BLE001 - as BFCL: the entry's inference error, the run goes on
        run.messages = data["message"]
        return inference_error(run, e)
    run.messages = data["message"]
    run.verdict = checker.verdict(
        f"Model was force-terminated during inference phase after {max_steps} steps" if run.force_quit else None
    )
    return run
