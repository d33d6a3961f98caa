"""A stage-1 checkpoint of the CPU pipeline evaluated through the vLLM server generator: the same greedy
episodes as through the in-process HF generator."""

import json

import pytest

from nemo_rcgrpo.evaluation.run import main as eval_main

pytestmark = pytest.mark.vllm


def test_checkpoint_eval_through_vllm_equals_hf(tmp_path):
    common = [
        "policy=checkpoint",
        "checkpoint.path=smollm2",
        "protocol=bfcl",
        "limit=1",
        "categories=[base,miss_param]",
        "max_new_tokens=16",
        "max_turns=2",
        "max_total_tokens=2048",
        "chat.tool_description=compact",
        "reward_token=high",
        "progress=false",
        "bfcl_handler=project",
    ]
    results = {}
    for backend in ("hf", "vllm"):
        extra = (
            [
                "generation=vllm",
                "generation.vllm.enforce_eager=true",
                "generation.vllm.kv_cache_gib=1",
                "generation.vllm.max_model_len=2048",
            ]
            if backend == "vllm"
            else []
        )
        out = tmp_path / backend
        assert eval_main([*common, *extra, f"out_dir={out}"]) == 0
        r = json.loads((out / "results.json").read_text())
        assert r["complete"] and r["tasks"] == 2 and r["policy"]["generator"] == backend
        results[backend] = [json.loads(l) for l in (out / "trajectories.jsonl").read_text().splitlines()]
    for h, v in zip(results["hf"], results["vllm"]):
        assert (h["task_id"], h["text"], h["success"], h["failure_reason"]) == (
            v["task_id"],
            v["text"],
            v["success"],
            v["failure_reason"],
        )
        assert h["generated_tokens"] > 0
