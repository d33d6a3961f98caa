"""BFCL's own multi-turn function-calling pipeline (bfcl-eval 2026.3.23), with a safe executor in place of eval().

What `bfcl generate` does for an OpenAI-compatible FC model (``BaseHandler.inference_multi_turn_FC`` driving
``OpenAICompletionsHandler``), step for step, and what `bfcl evaluate` then checks:

- the entry is BFCL's: ``load_dataset_entry`` (the involved classes' docs, held-out docs moved to
  ``missed_function``, BFCL's Python-3 sentence on every other doc); the tools are ``convert_to_tool`` of it, and a
  held-out turn appends its docs to the end of the list, recompiles, and sends BFCL's plain user message;
- no system prompt; the request is ``{messages, model, temperature, store: false[, tools]}`` (BFCL's temperature
  is 0.001); the assistant message goes back into the history exactly as the server sent it, each execution
  result as ``{role: tool, content, tool_call_id}``;
- a message is decoded whole by BFCL's ``convert_to_function_call``: one undecodable call discards the message
  and ends the turn, as does a message without calls; at most ``MAXIMUM_STEP_LIMIT`` (20) steps per turn, after
  which the entry is force-quit; no limit per episode;
- an exception while querying is BFCL's inference error: the entry's result is ``"Error during inference: ..."``.

Pure pieces are BFCL's own functions, imported (`bfcl()`), never re-derived. Execution is not BFCL's: its
executor ``eval()``s the call text against instances kept in module globals. `SafeExecutor` reproduces what that
eval does with BFCL's own text (the same call string, the same ``_process_method_calls`` rewrite, Python's own
parser and error messages, any public method of the involved classes, BFCL's blocked names) on the rollout's
own instances, with every argument a literal; what it refuses instead of running is listed in
docs/evaluation.md (names that are not tools, non-literal arguments, resource bombs).
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import inspect
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from nemo_rcgrpo.envs.bfcl.apis import build_instances
from nemo_rcgrpo.envs.bfcl.executor import ExecutedCall, _resource_guard, format_result
from nemo_rcgrpo.envs.bfcl.isolation import isolated
from nemo_rcgrpo.envs.bfcl.reward import GoldReplay, OfficialChecker
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask
from nemo_rcgrpo.envs.calls import CallRejected
from nemo_rcgrpo.types import OfficialVerdict, valid_text

BFCL_VERSION = "2026.3.23"
BFCL_TEMPERATURE = 0.001  # `bfcl generate --temperature`'s default
# BFCL's executor refuses these names before its eval (multi_turn_utils.execute_multi_turn_func_call)
BLOCKED_NAMES = ("kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run")


@functools.cache
def bfcl() -> SimpleNamespace:
    """BFCL's pure functions and constants. Importing bfcl_eval creates folders under BFCL_PROJECT_ROOT (else
    inside site-packages): unless the user set it, it points into the temp directory."""
    os.environ.setdefault("BFCL_PROJECT_ROOT", str(Path(tempfile.gettempdir()) / "nemo_rcgrpo-bfcl"))
    from bfcl_eval import utils
    from bfcl_eval.constants import default_prompts
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.model_handler import utils as handler_utils

    return SimpleNamespace(
        load_dataset_entry=utils.load_dataset_entry,
        sort_key=utils.sort_key,
        convert_to_tool=functools.partial(
            handler_utils.convert_to_tool, mapping=GORILLA_TO_OPENAPI, model_style=ModelStyle.OPENAI_COMPLETIONS
        ),
        convert_to_function_call=handler_utils.convert_to_function_call,
        is_empty_execute_response=multi_turn_utils.is_empty_execute_response,
        process_method_calls=multi_turn_utils._process_method_calls,
        executor_globals=frozenset(vars(multi_turn_utils)),
        max_steps=default_prompts.MAXIMUM_STEP_LIMIT,
        holdout_message=default_prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC,
    )


@functools.cache
def _category_entries(category: str) -> dict[str, dict]:
    return {e["id"]: e for e in bfcl().load_dataset_entry(category)}


def bfcl_entry(task_id: str) -> dict:
    """BFCL's test entry for ``task_id``, as `bfcl generate` loads it (a private copy)."""
    return copy.deepcopy(_category_entries(task_id.rsplit("_", 1)[0])[task_id])


def model_dir_name(model_name: str) -> str:
    """BaseHandler.model_name_underline_replaced: part of BFCL's instance names (and so of rewritten call text)."""
    return model_name.replace("/", "_").replace("-", "_").replace(".", "_")


class _NotRun(Exception):
    """A call the safe executor will not run; its text is the observation."""


_LITERAL_PARTS = (
    ast.Constant,
    ast.List,
    ast.Tuple,
    ast.Set,
    ast.Dict,
    ast.UnaryOp,
    ast.Load,
    ast.USub,
    ast.UAdd,
    ast.BinOp,
    ast.Add,
    ast.Sub,
)


def _first_name(node: ast.AST) -> str | None:
    """The first bare name eval would look up in a literal-shaped argument (``[1, inf]``: ``inf``), in evaluation
    order; None when the argument holds something other than literals and names."""
    if isinstance(node, ast.Name):
        return node.id
    if not isinstance(node, _LITERAL_PARTS):
        return None
    children = (
        [x for k, v in zip(node.keys, node.values) for x in (k, v)]
        if isinstance(node, ast.Dict)
        else list(ast.iter_child_nodes(node))
    )
    for child in children:
        if child is None or isinstance(child, (ast.Load, ast.USub, ast.UAdd, ast.Add, ast.Sub)):
            continue
        if not isinstance(child, (ast.Name, *_LITERAL_PARTS)):
            return None
        found = _first_name(child)
        if found is not None:
            return found
    return None


def _arg_value(node: ast.AST) -> Any:
    """What eval makes of one argument of a rewritten call: a literal, or the NameError of the first bare name in
    it (``nan``, ``inf``: what repr writes for JSON's NaN and Infinity, also inside lists); else it is not run."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    name = _first_name(node)
    if name is not None and name not in bfcl().executor_globals and not hasattr(builtins, name):
        raise NameError(f"name '{name}' is not defined")
    raise _NotRun("Error: only literal arguments are run (no expressions, names or nested calls)")


class SafeExecutor:
    """The involved classes' instances of one entry, private to it, called as BFCL's eval would call them."""

    def __init__(self, task: BFCLTask, model_name: str):
        self.instances = build_instances(task)
        self.by_name: dict[str, object] = {}  # BFCL's instance name -> instance
        self.methods: dict[str, str] = {}  # public method -> instance name (the last involved class wins, as BFCL)
        for class_name, instance in self.instances.items():
            name = re.sub(r"[-./:]", "_", f"{model_dir_name(model_name)}_{task.id}_{class_name}_instance")
            self.by_name[name] = instance
            for method, _ in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not method.startswith("_"):
                    self.methods[method] = name
        self.executed: list[ExecutedCall] = []

    def execute(self, calls: list[str]) -> list[str]:
        return [valid_text(self._run(call)) for call in calls]

    def _run(self, call: str) -> str:
        head = call.split("(")[0] if "(" in call else call
        if "." in head:
            head = head.split(".")[1]
        if head in BLOCKED_NAMES:
            return f"Error during execution: Function call {head} is not allowed."
        text = bfcl().process_method_calls(call, self.methods)
        try:
            node = ast.parse(text, "<string>", mode="eval").body  # eval's own parser and messages
            if not isinstance(node, ast.Call):  # a name that makes the text a plain literal: eval gives it back
                return format_result(_arg_value(node))
            method, name = self._resolve(node)
            args, kwargs = self._arguments(node, method)
            try:  # the guard reads arguments by name; a call that does not bind fails in Python's own call below
                named = inspect.signature(method).bind(*args, **kwargs).arguments
            except TypeError:
                named = {}
            _resource_guard(name, named, method.__self__)
        except _NotRun as e:
            return str(e)
        except CallRejected as e:
            return f"Error: {e}"
        except (SyntaxError, ValueError, NameError, TypeError) as e:
            return f"Error during execution: {e}"
        except (RecursionError, MemoryError) as e:  # text nested past the parser's limits: never run
            return f"Error: the call text is too deeply nested to read ({type(e).__name__})"
        return self._call(method, name, args, kwargs)

    @staticmethod
    def _arguments(node: ast.Call, method: Callable) -> tuple[list, dict]:
        """The literal arguments, unpacked as Python unpacks ``*[...]`` and ``**{...}`` (a JSON key can write them)."""
        args: list = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                value = _arg_value(a.value)
                if not isinstance(value, (list, tuple, str, dict)):
                    raise _NotRun("Error: *args unpacking of a value that is not a list is not run")
                args.extend(value)
            else:
                args.append(_arg_value(a))
        kwargs: dict = {}
        for kw in node.keywords:
            value = _arg_value(kw.value)
            if kw.arg is not None:
                if kw.arg in kwargs:  # a keyword after **{...} that named it already
                    raise TypeError(
                        f"{method.__module__}.{method.__qualname__}() got multiple values for keyword "
                        f"argument '{kw.arg}'"
                    )
                kwargs[kw.arg] = value
                continue
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise _NotRun("Error: **kwargs unpacking of a value that is not a mapping of names is not run")
            for key, item in value.items():
                if key in kwargs:
                    raise TypeError(
                        f"{method.__module__}.{method.__qualname__}() got multiple values for keyword argument '{key}'"
                    )
                kwargs[key] = item
        return args, kwargs

    def _resolve(self, node: ast.Call) -> tuple[Callable, str]:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in self.by_name
            and self.methods.get(func.attr) == func.value.id
        ):
            return getattr(self.by_name[func.value.id], func.attr), func.attr
        root = func
        while isinstance(root, ast.Attribute):  # functions.ls(): eval looks up `functions` first
            root = root.value
        if isinstance(root, ast.Name) and root.id not in self.by_name:
            if root.id in self.methods or root.id in bfcl().executor_globals or hasattr(builtins, root.id):
                raise _NotRun(f"Error: {root.id} is not a tool of this conversation")
            raise NameError(f"name '{root.id}' is not defined")
        raise _NotRun("Error: the called function must be a plain tool name")

    def _call(self, method: Callable, name: str, args: list, kwargs: dict) -> str:
        # private copies of mutable defaults: BFCL's TwitterAPI.post_tweet(mentions=[]) shares one list per process
        try:
            bound = inspect.signature(method).bind(*args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            for param in inspect.signature(method).parameters.values():
                if param.name not in bound.arguments and isinstance(param.default, (list, dict, set)):
                    kwargs[param.name] = copy.deepcopy(param.default)
        with isolated(method.__self__, method.__name__):  # BFCL's module-level objects: this entry's own
            try:
                result, ok = format_result(method(*copy.deepcopy(args), **copy.deepcopy(kwargs))), True
            except Exception as e:  # noqa: BLE001 - the API's own errors (and Python's call errors) are observations
                result, ok = f"Error during execution: {e}", False
        if bound is not None:
            explicit = {k: v for k, v in bound.arguments.items()}
            bound.apply_defaults()
            self.executed.append(ExecutedCall(name, explicit, dict(bound.arguments), result, ok))
        return result


class InferenceError(RuntimeError):
    """What BFCL's handler raises out of an entry (a refused request, a reply without choices or usage)."""


@dataclass
class Reply:
    """BFCL's ``_parse_query_response_FC`` of one chat completion."""

    model_responses: Any  # [{name: arguments}] with tool calls, else the message's content
    echo: dict  # the assistant message as it goes back into the history
    tool_call_ids: list
    input_token: Any
    output_token: Any


def parse_reply(reply: Any) -> Reply:
    try:
        message = reply["choices"][0]["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
    except (KeyError, IndexError, TypeError) as e:
        raise InferenceError(f"the reply has no choices[0].message ({type(e).__name__}: {e})") from None
    try:
        calls = message["tool_calls"]
        responses = [{c["function"]["name"]: c["function"]["arguments"]} for c in calls]
        ids = [c["id"] for c in calls]
    except Exception:  # noqa: BLE001 - as BFCL: no (well-formed) tool calls means the content is the response
        responses, ids = message.get("content"), []
    try:
        usage = reply["usage"]
        tokens = usage["prompt_tokens"], usage["completion_tokens"]
    except (KeyError, TypeError) as e:
        raise InferenceError(f"the reply has no usage.prompt_tokens / completion_tokens ({e})") from None
    return Reply(responses, message, ids, *tokens)


# respond(request body, turn, step) -> the chat completion JSON; raises InferenceError for a refused request
Respond = Callable[[dict, int, int], Any]


@dataclass
class EntryRun:
    """One entry played through BFCL's loop: what BFCL writes (``result`` and its metadata) and its verdict."""

    result: list | str
    input_token_count: list = field(default_factory=list)
    output_token_count: list = field(default_factory=list)
    latency: list = field(default_factory=list)
    messages: list = field(default_factory=list)
    requests: int = 0
    force_quit: bool = False
    inference_error: str | None = None
    verdict: OfficialVerdict = field(default_factory=lambda: OfficialVerdict(False))
    observations: list = field(default_factory=list)  # execution results per step
    executor: SafeExecutor | None = None
    prompts: list = field(default_factory=list)  # the prompt text of each request (BFCL's local-model path)

    def result_line(self, task_id: str) -> dict:
        """The line BFCL's handler writes to its result file."""
        if self.inference_error is not None:
            return {"id": task_id, "result": self.result, "traceback": self.inference_error}
        return {
            "id": task_id,
            "result": self.result,
            "input_token_count": self.input_token_count,
            "output_token_count": self.output_token_count,
            "latency": self.latency,
        }


def inference_error(run: EntryRun, error: Exception) -> EntryRun:
    """BFCL's label for an entry whose inference raised (`_llm_response_generation.multi_threaded_inference`)."""
    text = str(error)  # BFCL writes f"Error during inference: {str(e)}", whatever e is
    run.inference_error = text
    run.result = f"Error during inference: {text}"
    run.verdict = OfficialVerdict(
        False,
        "multi_turn:inference_error",
        "Error during inference phase. Model did not output a list of model responses.",
    )
    return run


def play_entry(
    task: BFCLTask,
    gold: GoldReplay,
    respond: Respond,
    *,
    model_name: str,
    temperature: float = BFCL_TEMPERATURE,
    max_steps: int | None = None,
    edit_first_turn: Callable[[list], list] | None = None,
    fatal: tuple[type, ...] = (),
) -> EntryRun:
    """``task`` through BFCL's multi-turn FC loop; ``respond`` answers each request. ``edit_first_turn`` (the
    reward goal of a conditioned model) changes the first user turn, and only it. Whatever an entry raises is
    BFCL's inference error for that entry, as in BFCL, except the ``fatal`` exceptions (a dead server)."""
    b = bfcl()
    max_steps = b.max_steps if max_steps is None else max_steps
    entry = bfcl_entry(task.id)
    holdout = entry.get("missed_function", {})
    executor = SafeExecutor(task, model_name)
    checker = OfficialChecker(gold)
    run = EntryRun(result=[], executor=executor)
    tools = b.convert_to_tool(entry["function"])
    messages = run.messages
    try:
        for turn, turn_messages in enumerate(entry["question"]):
            if str(turn) in holdout:
                entry["function"].extend(holdout[str(turn)])
                tools = b.convert_to_tool(entry["function"])
                turn_messages = [{"role": "user", "content": b.holdout_message}]
            if turn == 0 and edit_first_turn is not None:
                turn_messages = edit_first_turn(turn_messages)
            messages.extend(turn_messages)
            responses, inputs, outputs, latencies, results, decoded_steps = [], [], [], [], [], 0
            step = 0
            while True:
                body = {"messages": messages, "model": model_name, "temperature": temperature, "store": False}
                if tools:
                    body["tools"] = tools
                started = time.perf_counter()
                reply = parse_reply(respond(json.loads(json.dumps(body)), turn, step))
                run.requests += 1
                latencies.append(time.perf_counter() - started)
                messages.append(reply.echo)
                responses.append(reply.model_responses)
                inputs.append(reply.input_token)
                outputs.append(reply.output_token)
                try:
                    decoded = b.convert_to_function_call(reply.model_responses)
                except Exception:  # noqa: BLE001 - as BFCL: an undecodable message ends the turn, unexecuted
                    break
                if b.is_empty_execute_response(decoded):
                    break
                observed = executor.execute(decoded)
                decoded_steps += 1
                results += observed
                run.observations.append(observed)
                messages += [
                    {"role": "tool", "content": r, "tool_call_id": i} for r, i in zip(observed, reply.tool_call_ids)
                ]
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
        return inference_error(run, e)
    run.verdict = checker.verdict(
        f"Model was force-terminated during inference phase after {max_steps} steps" if run.force_quit else None
    )
    return run
