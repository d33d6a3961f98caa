"""BFCL's own code, run as BFCL runs it, for the oracle tests (a process of its own: BFCL keeps API instances in
module globals and evals the call text, so none of it runs inside the test process).

    python bfcl_reference.py infer SPEC OUT     # `bfcl generate`'s loop per (model, entry) against SPEC's server
    python bfcl_reference.py evaluate SPEC OUT  # `bfcl evaluate`'s runner over SPEC's result folder
    python bfcl_reference.py execute SPEC OUT   # BFCL's executor on call strings (safe ones only: it evals them)
    python bfcl_reference.py infer_local SPEC OUT  # a local handler's loop (LlamaHandler_3_1 | QwenFCHandler)

SPEC is JSON. infer: {"base_url", "runs": [[model, entry_id], ...]} -> OUT: [{model, id, result, verdict}];
evaluate: {"result_dir", "score_dir", "models": [registry name], "handlers": {registry name: local handler},
"categories": [...]} -> OUT: the rows of BFCL's
data_multi_turn.csv; execute: {"model", "steps": [[entry_id, [call, ...]], ...]} -> OUT: per step, the results
and the public state of every instance after it (steps of one entry share its instances, as in BFCL);
infer_local: {"base_url", "handlers": {model folder: handler}, "runs": [[model folder, entry_id], ...]}: each
folder's handler on that local model path (`bfcl generate --local-model-path --skip-server-setup`) -> OUT as infer.
BFCL's model table imports every vendor SDK, so it is replaced by one naming these models with BFCL's
OpenAI-compatible FC handler or the local handler named; and each run starts with BFCL's executor globals
emptied, as in a fresh process. Nothing else of BFCL's is replaced.
"""

import copy
import csv
import dataclasses
import io
import json
import os
import sys
import types
from contextlib import redirect_stdout
from pathlib import Path
from typing import Optional


@dataclasses.dataclass
class ModelConfig:  # the fields of bfcl_eval.constants.model_config.ModelConfig
    model_name: str
    display_name: str
    url: str
    org: str
    license: str
    model_handler: type
    input_price: Optional[float] = None
    output_price: Optional[float] = None
    is_fc_model: bool = True
    underscore_to_dot: bool = False


def _model_table(models, handlers):
    """BFCL's model table for ``models``: BFCL's OpenAI-compatible FC handler, or the local handler named."""
    import importlib

    from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

    def handler_class(model):
        if model not in handlers:
            return OpenAICompletionsHandler
        module, cls, _ = LOCAL[handlers[model]]
        return getattr(importlib.import_module(module), cls)

    table = types.ModuleType("bfcl_eval.constants.model_config")
    table.MODEL_CONFIG_MAPPING = {m: ModelConfig(m, m, "", "", "", handler_class(m)) for m in models}
    sys.modules[table.__name__] = table


# handler -> (module, class, the model_name of its entry in BFCL's model table)
LOCAL = {"llama3_1": ("bfcl_eval.model_handler.local_inference.llama_3_1", "LlamaHandler_3_1",
                      "meta-llama/Llama-3.1-8B-Instruct"),
         "qwen_fc": ("bfcl_eval.model_handler.local_inference.qwen_fc", "QwenFCHandler", "Qwen/Qwen3-8B")}


def _openai_handler(model):
    from bfcl_eval.model_handler.api_inference.openai_completion import OpenAICompletionsHandler

    return OpenAICompletionsHandler(model_name=model, temperature=0.001, registry_name=model, is_fc_model=True)


def _local_handler(names):
    import importlib

    def make(folder):  # as _llm_response_generation.build_handler: the table's model_name, not the path
        module, cls, model_name = LOCAL[names[folder]]
        handler_class = getattr(importlib.import_module(module), cls)
        handler = handler_class(model_name=model_name, temperature=0.001, registry_name=model_name + "-FC",
                                is_fc_model=True)
        with redirect_stdout(io.StringIO()):  # as `bfcl generate --skip-server-setup --local-model-path`
            handler.spin_up_local_server(num_gpus=1, gpu_memory_utilization=0.9, backend="vllm",
                                         skip_server_setup=True, local_model_path=folder)
        return handler
    return make


def infer(spec, make_handler=_openai_handler):
    from bfcl_eval.eval_checker.eval_runner import _evaluate_single_multi_turn_entry
    from bfcl_eval.utils import load_dataset_entry, load_ground_truth_entry

    os.environ["OPENAI_BASE_URL"] = spec["base_url"]
    entries, answers, handlers, out = {}, {}, {}, []
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    for model, entry_id in spec["runs"]:
        # BFCL keeps an entry's instances in its executor's globals under the handler's model name; a local
        # handler's name is its table's, the same for every run here: each run starts as in a fresh process
        for name in [n for n in vars(multi_turn_utils) if n.endswith("_instance")]:
            delattr(multi_turn_utils, name)
        category = entry_id.rsplit("_", 1)[0]
        if category not in entries:
            entries[category] = {e["id"]: e for e in load_dataset_entry(category)}
            raw = load_dataset_entry(category, include_prereq=False, include_language_specific_hint=False)
            answers[category] = ({e["id"]: e for e in raw},
                                 {a["id"]: a["ground_truth"] for a in load_ground_truth_entry(category)})
        if model not in handlers:  # one handler per model, as `bfcl generate` builds one for all its entries
            handlers[model] = make_handler(model)
        handler = handlers[model]
        try:  # as _llm_response_generation.multi_threaded_inference
            with redirect_stdout(io.StringIO()):
                result, _ = handler.inference(copy.deepcopy(entries[category][entry_id]), False, True)
        except Exception as e:  # noqa: BLE001 - BFCL's own label
            result = f"Error during inference: {e}"
        prompt, truth = answers[category]
        with redirect_stdout(io.StringIO()):
            verdict = _evaluate_single_multi_turn_entry(handler, entry_id, result, truth[entry_id],
                                                        copy.deepcopy(prompt[entry_id]), model, category)
        out.append({"model": model, "id": entry_id, "result": result, "valid": verdict["valid"],
                    "error_type": None if verdict["valid"] else verdict["error"]["error_type"]})
    return out


def execute(spec):
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import execute_multi_turn_func_call
    from bfcl_eval.utils import load_dataset_entry

    entries, out = {}, []
    for entry_id, calls in spec["steps"]:
        category = entry_id.rsplit("_", 1)[0]
        if category not in entries:
            entries[category] = {e["id"]: e for e in load_dataset_entry(category)}
        entry = entries[category][entry_id]
        results, instances = execute_multi_turn_func_call(calls, entry["initial_config"], entry["involved_classes"],
                                                          spec["model"], entry_id, long_context="long" in category)
        state = {c: {k: repr(v) for k, v in vars(i).items() if not k.startswith("_")} for c, i in instances.items()}
        out.append({"results": results, "state": state})
    return out


def evaluate(spec):
    from bfcl_eval.eval_checker import eval_runner
    from bfcl_eval.utils import parse_test_category_argument

    with redirect_stdout(io.StringIO()):  # as eval_runner.main with --partial-eval
        eval_runner.runner([m.replace("/", "_") for m in spec["models"]],
                           parse_test_category_argument(spec["categories"]),
                           Path(spec["result_dir"]), Path(spec["score_dir"]), allow_missing=True)
    with open(Path(spec["score_dir"]) / "data_multi_turn.csv") as f:
        return list(csv.DictReader(f))


if __name__ == "__main__":
    mode, spec_path, out_path = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    os.environ.setdefault("OPENAI_API_KEY", "stand-in")  # BFCL's handler builds an OpenAI client
    _model_table(spec.get("models", ()), spec.get("handlers", {}))
    if mode == "infer_local":
        os.environ["REMOTE_OPENAI_BASE_URL"] = spec["base_url"]
        result = infer(spec, _local_handler(spec["handlers"]))
    else:
        result = {"infer": infer, "evaluate": evaluate, "execute": execute}[mode](spec)
    Path(out_path).write_text(json.dumps(result))
