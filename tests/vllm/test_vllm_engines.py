"""Two real vLLM engines behind one generator (``generation.vllm.engines=2``), each bound to a core of its own: the
same greedy tokens as HF (so as one engine), a group never spans engines, one weight update through one gloo group of
the trainer and both engines' workers serves the new weights on each (the bytes sent as for one engine), and an engine
killed mid-run: the run finishes its steps on the other, saying so in one line."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.config_schema import VLLMConfig
from nemo_rcgrpo.generation.base import SamplingParams
from nemo_rcgrpo.generation.hf_local import HFGenerator
from nemo_rcgrpo.models.hf import load_model, load_tokenizer

pytestmark = pytest.mark.vllm
PROMPTS = [
    "<|im_start|>user\nList the files in the current folder.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou call tools.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smol():
    tok, model = load_tokenizer("smollm2"), load_model("smollm2").eval()
    return tok, model, [tok.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def two(smol, tmp_path_factory):
    from nemo_rcgrpo.generation.vllm_generator import VLLMGenerator

    tok, model, _ = smol
    g = VLLMGenerator(
        VLLMConfig(enforce_eager=True, kv_cache_gib=1, max_model_len=1024, engines=2),
        model=model,
        tokenizer=tok,
        weight_dir=tmp_path_factory.mktemp("engines"),
        dtype="float32",
    )
    g.start()
    g.sync.verify = True
    yield g
    g.close()
    assert not g.servers


def _greedy(tok, n=12):
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),))


def test_two_engines_each_on_a_core_give_hfs_greedy_tokens(two, smol):
    tok, model, prompts = smol
    assert [s.spec.cpu_bind for s in two.servers] == ["0", "1"] and len({s.url for s in two.servers}) == 2
    hf = [c.token_ids for c in HFGenerator(model, tok.pad_token_id or 0).generate(prompts, _greedy(tok))]
    assert [c.token_ids for c in two.generate(prompts, _greedy(tok))] == hf  # each prompt its own: both engines
    for client in two.pool.live:  # and each engine alone
        assert [c.token_ids for c in client.generate(prompts, _greedy(tok))] == hf


def test_a_group_never_spans_engines(two, smol, monkeypatch):
    tok, _, prompts = smol
    served: dict[int, list[int]] = {0: [], 1: []}
    for e, client in enumerate(two.pool.clients):
        original = client.generate
        monkeypatch.setattr(
            client,
            "generate",
            lambda p, params, indices=None, e=e, f=original: served[e].extend(indices) or f(p, params, indices),
        )
    groups = [("t", 0), ("t", 0), ("t", 1), ("t", 1), ("t", 2), ("t", 2), ("t", 3), ("t", 3)]
    for _turn in range(2):  # a second turn of the same groups goes where the first went
        two.generate([prompts[i // 2] for i in range(8)], _greedy(tok, 4), groups)
    where = {g: {e for e, idx in served.items() for i in idx if groups[i] == g} for g in set(groups)}
    assert all(len(engines) == 1 for engines in where.values()), where
    assert {next(iter(e)) for e in where.values()} == {0, 1}  # and both engines served groups


def test_one_update_reaches_both_engines_through_one_group(two, smol):
    tok, model, prompts = smol
    new = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    two.update_weights(new.state_dict().items(), 1)
    hf = [c.token_ids for c in HFGenerator(new, tok.pad_token_id or 0).generate(prompts, _greedy(tok))]
    for client in two.pool.live:
        assert [c.token_ids for c in client.generate(prompts, _greedy(tok))] == hf
        assert client.weight_version() == "1"
    from nemo_rcgrpo.generation.vllm_sync import _with_lm_head

    stats = two.sync.stats
    assert two.sync.world_size == 3 and (stats["syncs"], stats["fallbacks"]) == (1, 0)  # trainer + 2 workers
    # each bucket broadcast once to both engines: the bytes of one copy of the model, as with one engine
    assert stats["bytes"] == sum(t.numel() * 4 for t in _with_lm_head(new.state_dict().items(), two.tied).values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_engine_killed_mid_run_leaves_the_run_to_the_other(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    args = [
        "--config-name=rcgrpo_smollm_cpu",
        "model.path=tiny-llama",
        "rl.stage1_recipe=null",
        f"data.dir={data_dir}",
        f"run_dir={run_dir}",
        "rl.group_size=2",
        "rl.tasks_per_step=2",
        "rl.max_turns=2",
        "rl.sampling.max_new_tokens=16",
        "rl.max_total_tokens=1536",
        "trainer.max_steps=3",
        "trainer.save_every=1",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        "generation=vllm",
        "generation.vllm.engines=2",
        "generation.vllm.enforce_eager=true",
        "generation.vllm.kv_cache_gib=1",
        "generation.vllm.max_retries=1",
    ]
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "nemo_rcgrpo.cli", "train", *args], env=env, stderr=subprocess.PIPE, text=True
    )
    metrics, pid_file = run_dir / "metrics.jsonl", run_dir / "generator" / "server1.pid"
    deadline = time.monotonic() + 600
    while (
        not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline
    ):
        time.sleep(1)
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    engine1 = int(pid_file.read_text())
    os.killpg(engine1, signal.SIGKILL)  # engine 1 and its workers, after step 1
    err = proc.communicate(timeout=900)[1]
    assert proc.returncode == 0, err[-3000:]
    assert [json.loads(l)["step"] for l in metrics.read_text().splitlines()] == [1, 2, 3]
    lost = [l for l in err.splitlines() if "vLLM engine 1" in l]
    assert len(lost) == 1 and "is gone" in lost[0] and "going on with 1 engine(s)" in lost[0], err[-3000:]
    engine0 = int((run_dir / "generator" / "server.pid").read_text())
    assert not _alive(engine0) and not _alive(engine1)  # both went with the run
