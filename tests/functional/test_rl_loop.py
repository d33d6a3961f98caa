"""The RL loop end to end with known, mixed rewards (generation=scripted): the path from rewards to advantages,
loss, gradient and weights is checked against hand-built values; dumps re-score; resume and kill-resume reproduce
an uninterrupted run, optimizer state included.

A random tiny policy scores 0 on every rollout (every group zero-variance: advantages, loss and gradient all 0),
so these tests let the scripted generator play the ground truth or a verified failure per rollout instead: with
stratified tokens (2 high, 2 low per group), P(success | high) = 0.8 and P(success | low) = 0.2.
"""

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nemo_rcgrpo.envs.bfcl import BFCLEnv
from nemo_rcgrpo.train import main
from nemo_rcgrpo.utils.logging import read_metrics

from ..conftest import hand_advantages, rl_batch

REPO = Path(__file__).resolve().parents[2]


def _args(data_dir, run_dir, *extra):
    return [
        "--config-name=rcgrpo_smollm_cpu",
        "model.path=tiny-llama",
        "rl.stage1_recipe=null",
        f"data.dir={data_dir}",
        f"run_dir={run_dir}",
        "rl.group_size=4",
        "rl.tasks_per_step=2",
        "rl.max_turns=8",
        "rl.sampling.max_new_tokens=256",
        "rl.max_total_tokens=4096",
        "trainer.lr=1e-3",
        "trainer.max_steps=3",
        "trainer.micro_batch_size=2",
        "trainer.micro_batch_tokens=null",  # two rollouts a micro-batch, as recorded (the default fills whole groups)
        "trainer.save_every=1",
        "trainer.export_hf=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        "generation=scripted",
        "generation.scripted.success_high=0.8",
        "generation.scripted.success_low=0.2",
        *extra,
    ]


def _dump(run_dir, step):
    return [json.loads(l) for l in (Path(run_dir) / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def _rescore(suite, record):
    env = BFCLEnv(mode="merged")
    env.reset(suite[record["task_id"]])
    for calls in record["turns"]:
        if env.done:
            break
        env.step([{"name": c["name"], "arguments": c["arguments"]} if "name" in c else "<unparsable>" for c in calls])
    if record["truncated"]:
        env.truncate(record["truncated"])
    return env.reward()


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    """Three RC-GRPO steps in one go: the run every other run here is compared with."""
    run_dir = tmp_path_factory.mktemp("rl") / "a"
    assert main(_args(data_dir, run_dir)) == 0
    return run_dir


def test_rewards_advantages_and_loss_of_a_run(uninterrupted, suite):
    from nemo_rcgrpo.models.hf import load_model

    metrics = read_metrics(uninterrupted)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    mixed_groups = 0
    for step, m in zip((1, 2, 3), metrics):
        records = _dump(uninterrupted, step)
        assert all(r["step"] == step == m["step"] for r in records)  # one step number for dumps and metrics
        assert all(r["weight_version"] == step - 1 for r in records)  # drawn from the weights after step - 1 updates
        assert len(records) == 8 and m["rollouts"] == 8
        for g in (0, 1):
            group = [r for r in records if r["group"] == g]
            assert sorted(r["reward_token"] for r in group) == ["high", "high", "low", "low"]  # stratified, p = 0.5
            rewards = [r["reward"] for r in group]
            mixed_groups += len(set(rewards)) > 1
            expected = hand_advantages(rewards)
            assert [r["advantage"] for r in group] == pytest.approx(expected, abs=1e-6), (step, g, rewards)
        zero = sum(len({r["reward"] for r in records if r["group"] == g}) == 1 for g in (0, 1)) / 2
        assert m["zero_variance_fraction"] == zero
        assert m["reward_mean"] == pytest.approx(sum(r["reward"] for r in records) / 8)
        assert m["tokens"] == sum(r["generated_tokens"] for r in records)
        for r in records:
            rescored = _rescore(suite, r)
            assert (rescored.value, rescored.state_ok, rescored.actions_ok) == (
                r["reward"],
                r["state_ok"],
                r["actions_ok"],
            )
    assert mixed_groups >= 3  # of 6: the reward signal is there
    # step 1 trains from the reference weights: ratio 1 and KL 0, so with token aggregation
    #   loss = sum_b sum_t -A_b / N = -sum_b A_b n_b / N       (n_b generated tokens of rollout b, N = sum_b n_b)
    records = _dump(uninterrupted, 1)
    n = sum(r["generated_tokens"] for r in records)
    expected = -sum(r["advantage"] * r["generated_tokens"] for r in records) / n
    assert abs(expected) > 1e-4  # successes and failures differ in length: the sign of the loss is visible (7.8e-4)
    assert metrics[0]["loss"] == pytest.approx(expected, abs=1e-6) and metrics[0]["kl"] == pytest.approx(0, abs=1e-9)
    assert metrics[0]["grad_norm"] > 0 and metrics[1]["kl"] > 0
    # every weight tensor of the initial shape moved (the embeddings grew by the two reward-token rows)
    initial = load_model("tiny-llama").state_dict()
    final = torch.load(uninterrupted / "checkpoints" / "step_3" / "model.pt", weights_only=True)
    same = [k for k in initial if k in final and initial[k].shape == final[k].shape]
    assert len(same) >= len(initial) - 2
    unchanged = [k for k in same if torch.equal(initial[k], final[k])]
    assert not unchanged, unchanged
    assert metrics[0]["reward_mean_high"] > metrics[0]["reward_mean_low"] or metrics[1]["reward_mean_high"] > 0


def test_one_step_equals_a_hand_built_batch(data_dir, tmp_path):
    """The trainer's first step against the same rollouts as one hand-built batch: hand advantages, one forward
    and backward through GRPOLoss, gradient clipping and one AdamW step. Same loss, gradient norm and weights."""
    from nemo_rcgrpo.algorithms.losses import GRPOLoss
    from nemo_rcgrpo.config import TrainConfig
    from nemo_rcgrpo.data.sft_data import Example, collate
    from nemo_rcgrpo.models.torch_policy import token_logprobs
    from nemo_rcgrpo.recipes.rl import RLTrainer
    from nemo_rcgrpo.utils.config import compose, split_argv
    from nemo_rcgrpo.utils.dist import init_distributed

    name, overrides = split_argv(_args(data_dir, tmp_path / "h", "rl.loss.kl_beta=0.3"), "")
    cfg = TrainConfig.from_dict(compose(name, overrides))
    trainer = RLTrainer.from_config(cfg, init_distributed())
    rollouts = trainer.collect(1, 0)
    groups = rollouts.groups
    assert rollouts.cursor == cfg.rl.tasks_per_step  # the cursor after the tasks drawn, handed back
    model = copy.deepcopy(trainer.policy.module)  # the weights before the step
    rewards, adv = trainer.advantages(groups)
    metrics = trainer.update(groups, rewards, adv, rollouts.stats)

    trajs = [t for g in groups for t in g]
    hand_adv = [a for g in groups for a in hand_advantages([t.reward for t in g])]
    assert adv.reshape(-1).tolist() == pytest.approx(hand_adv, abs=1e-6)
    assert any(a != 0 for a in hand_adv)
    batch = collate([Example(t.token_ids, t.loss_mask, t.task_id) for t in trajs], trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        old = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    batch = rl_batch(
        batch.loss_mask,
        torch.tensor(hand_adv),
        old,
        old_logprobs=old,
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
    )
    n = float(batch.loss_mask.sum())
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    loss, _ = GRPOLoss(kl_beta=0.3, num_sequences=float(len(trajs)))(lp, batch, n)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr, betas=tuple(cfg.trainer.betas), weight_decay=0.0).step()

    assert metrics["loss"] == pytest.approx(loss.item(), abs=1e-6) and abs(loss.item()) > 1e-4  # 8e-4 here
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-4) and float(norm) > 0
    # Adam's first step moves each weight by lr * g / (|g| + 1e-8): about lr * sign(g). Where |g| is near 1e-8 (the
    # vocabulary rows of the tied embedding that no target touches) float noise between micro-batched and whole-batch
    # gradients changes that step, so the weights are compared where |g| > 1e-6
    trained = dict(trainer.policy.module.named_parameters())
    for key, value in model.named_parameters():
        sure = grads[key].abs() > 1e-6
        assert "embed" in key or sure.float().mean() > 0.5, key  # most of every layer's weights are compared
        assert torch.allclose(trained[key].detach()[sure], value.detach()[sure], atol=1e-6, rtol=0), key
        assert (trained[key].detach() - value.detach()).abs().max() <= 2.1 * cfg.trainer.lr, key


def test_resume_reproduces_the_uninterrupted_run(data_dir, tmp_path, uninterrupted):
    """Stop after step 1, resume: steps 2 and 3 (and the weights after them) equal the uninterrupted run's. Step 3's
    loss and the final weights depend on the Adam moments saved at step 1, not only on the weights."""
    assert main(_args(data_dir, tmp_path / "b", "trainer.stop_after=1")) == 0
    assert [m["step"] for m in read_metrics(tmp_path / "b")] == [1]
    assert main(_args(data_dir, tmp_path / "b")) == 0
    _same_as_uninterrupted(tmp_path / "b", uninterrupted)


def test_a_run_saved_with_the_group_filters_former_names_resumes(data_dir, tmp_path, uninterrupted):
    """A run folder whose config.yaml was saved when rl.group_filter_refills / rl.group_filter_shortfall were
    rl.dapo_max_rounds / rl.dapo_shortfall resumes under the new names and continues as the uninterrupted run."""
    import yaml

    run_dir = tmp_path / "o"
    assert main(_args(data_dir, run_dir, "trainer.stop_after=1")) == 0
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    rl = saved["rl"]
    saved["rl"] = {
        {"group_filter_refills": "dapo_max_rounds", "group_filter_shortfall": "dapo_shortfall"}.get(k, k): v
        for k, v in rl.items()
    }
    assert saved["rl"]["dapo_max_rounds"] == rl["group_filter_refills"] and "group_filter_refills" not in saved["rl"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    assert main(_args(data_dir, run_dir)) == 0
    _same_as_uninterrupted(run_dir, uninterrupted)


def _same_as_uninterrupted(run_dir, uninterrupted):
    a, b = read_metrics(uninterrupted), read_metrics(run_dir)
    assert [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] != 0
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7) and y["grad_norm"] == pytest.approx(
            x["grad_norm"], rel=1e-4
        )
    for step in (1, 2, 3):
        assert _dump(uninterrupted, step) == _dump(run_dir, step)
    wa = torch.load(uninterrupted / "checkpoints" / "step_3" / "model.pt", weights_only=True)
    wb = torch.load(run_dir / "checkpoints" / "step_3" / "model.pt", weights_only=True)
    for key in wa:
        assert torch.allclose(wa[key], wb[key], atol=1e-6, rtol=0), key
    oa = torch.load(uninterrupted / "checkpoints" / "step_3" / "optimizer.pt", weights_only=True)["state"]
    ob = torch.load(run_dir / "checkpoints" / "step_3" / "optimizer.pt", weights_only=True)["state"]
    assert oa.keys() == ob.keys() and all(float(oa[k]["step"]) == float(ob[k]["step"]) == 3.0 for k in oa)
    assert all(torch.allclose(oa[k]["exp_avg_sq"], ob[k]["exp_avg_sq"], atol=1e-9, rtol=1e-4) for k in oa)


def test_kill_mid_run_then_resume(data_dir, tmp_path, uninterrupted):
    run_dir = tmp_path / "k"
    args = _args(data_dir, run_dir)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "nemo_rcgrpo" / "train.py"), *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    first = run_dir / "checkpoints" / "step_1" / "trainer_state.json"
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)  # somewhere inside step 2
    proc.wait()
    # the kill landed mid-run: the process died of it, before step 3 was logged or checkpointed
    assert proc.returncode == -signal.SIGKILL and first.exists()
    assert len(read_metrics(run_dir)) < 3 and not (run_dir / "checkpoints" / "step_3").exists()
    assert main(args) == 0
    assert sorted(p.name for p in (run_dir / "rollouts").iterdir()) == ["step_1.jsonl", "step_2.jsonl", "step_3.jsonl"]
    _same_as_uninterrupted(run_dir, uninterrupted)


def test_the_old_logprob_pass_changes_nothing_but_time(data_dir, tmp_path, uninterrupted):
    """rl.old_logprobs=recompute (a no-grad pass for old logprobs and entropies before the update) and the default
    (both from the update's own pass) train the same first step."""
    assert main(_args(data_dir, tmp_path / "r", "trainer.max_steps=1", "rl.old_logprobs=recompute")) == 0
    a, b = read_metrics(uninterrupted)[0], read_metrics(tmp_path / "r")[0]
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-7) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-6) and b["entropy_seq_mean"] == pytest.approx(
        a["entropy_seq_mean"], rel=1e-6
    )
    # the scripted generator reports logprob 0 for the tokens it plays: the gap is the trainer's own mean -logprob
    assert b["sampler_logprob_abs_diff"] == pytest.approx(a["sampler_logprob_abs_diff"], rel=1e-6)
    assert a["sampler_logprob_abs_diff"] > 1.0


def test_the_loop_asks_the_policy_whether_it_fuses_the_old_logprob_pass(data_dir, tmp_path, uninterrupted):
    """A backend that declares no fused pass (``fuses_old_logprobs = False``, as megatron's) gets a separate no-grad
    pass for old logprobs and entropies: the loop asks the policy, not the backend's name; the step is the same."""
    from nemo_rcgrpo import registry
    from nemo_rcgrpo.models.torch_policy import TorchPolicy

    passes = []

    class Unfused(TorchPolicy):
        fuses_old_logprobs = False

        def logprobs(self, batch, with_entropy=False):
            passes.append(with_entropy)
            return super().logprobs(batch, with_entropy)

    shipped = registry.lookup("policy_backend", "torch")
    # under the name "torch" itself: a loop that went by the name would fuse the pass and never call logprobs
    registry.register("policy_backend", "torch", replace=True)(
        lambda build, model, dist, total: Unfused(model, build.trainer, dist, total)
    )
    try:
        assert main(_args(data_dir, tmp_path / "u", "trainer.max_steps=1", "policy.backend=torch")) == 0
    finally:
        registry.register("policy_backend", "torch", replace=True)(shipped)
    assert passes and all(passes)  # one pass per micro-batch, with the entropies
    a, b = read_metrics(uninterrupted)[0], read_metrics(tmp_path / "u")[0]
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-7) and b["entropy"] == pytest.approx(a["entropy"], rel=1e-6)


def test_a_step_is_the_same_with_shared_prefixes_packing_and_a_token_budget(data_dir, tmp_path, uninterrupted):
    """The scripted generator's mixed-reward groups, two rollouts a micro-batch: the run computes each pair's
    shared prompt once (trainer.share_prefix, the default) and logs what that saved. With sharing and packing off
    every row runs padded, in full; with micro-batches filled to trainer.micro_batch_tokens whole groups of 4 run
    together. The rollouts are the same and the update equals the default's (float32 rounding)."""
    assert (
        main(
            _args(
                data_dir,
                tmp_path / "full",
                "trainer.max_steps=1",
                "trainer.share_prefix=false",
                "trainer.pack_sequences=false",
            )
        )
        == 0
    )
    assert main(_args(data_dir, tmp_path / "budget", "trainer.max_steps=1", "trainer.micro_batch_tokens=8192")) == 0
    a, b, c = (read_metrics(d)[0] for d in (uninterrupted, tmp_path / "full", tmp_path / "budget"))
    assert a["prefix_tokens_saved"] > 0 and 0.1 < a["forward_flops_saved"] < 1.0
    assert b["prefix_tokens_saved"] == 0.0 and b["forward_flops_saved"] == 0.0 and b["forward_positions_saved"] == 0.0
    assert a["micro_batches"] == 4.0 and c["micro_batches"] == 2.0  # a group of 4 shares its prompt in 8192
    assert c["forward_flops_saved"] > a["forward_flops_saved"] and c["prefix_tokens_saved"] > a["prefix_tokens_saved"]
    assert _dump(uninterrupted, 1) == _dump(tmp_path / "full", 1) == _dump(tmp_path / "budget", 1)
    assert 0.0 < a["reward_mean"] < 1.0
    for key in ("loss", "kl", "grad_norm", "entropy", "entropy_seq_mean", "clip_fraction", "sampler_logprob_abs_diff"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert c[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_epochs_and_mini_batches(data_dir, tmp_path, capsys):
    """rl.ppo_epochs=2 x rl.mini_batches=2: four optimizer steps per RL step, the LR schedule counts all four, and
    the start banner says both units."""
    assert main(_args(data_dir, tmp_path / "p", "trainer.max_steps=1", "rl.ppo_epochs=2", "rl.mini_batches=2")) == 0
    assert "steps   1 RL steps (= 4 optimizer steps) of 2 tasks x G=4" in capsys.readouterr().err
    m = read_metrics(tmp_path / "p")[0]
    assert m["updates"] == 4.0 and math.isfinite(m["loss"]) and m["kl"] > 0  # later updates move off the reference
    extra = torch.load(tmp_path / "p" / "checkpoints" / "step_1" / "extra.pt", weights_only=True)
    assert extra["scheduler"]["last_epoch"] == 4
    opt = torch.load(tmp_path / "p" / "checkpoints" / "step_1" / "optimizer.pt", weights_only=True)["state"]
    assert {float(v["step"]) for v in opt.values()} == {4.0}


def test_pipeline_runs_stage1_first_and_evaluates_with_the_high_token(data_dir, tmp_path):
    """rl.stage1_recipe trains the initial model first; in-training evaluation conditions on the high token: the
    scripted policy succeeds only with it (success_rate=0 without a token, success_low=0)."""
    stage1 = tmp_path / "s1"
    args = _args(
        data_dir,
        tmp_path / "rl",
        "trainer.max_steps=1",
        f"model.path={stage1}/hf",
        "rl.stage1_recipe=rctp_smollm_cpu",
        "generation.scripted.success_high=1.0",
        "generation.scripted.success_low=0.0",
        "generation.scripted.success_rate=0.0",
        "rl.stage1_overrides=['model.path=tiny-llama','trainer.max_steps=1','data.max_examples=4',"
        "'chat.max_length=900','trainer.global_batch_size=2','logging.progress=false']",
        "rl.eval_every=1",
        "rl.eval_tasks=2",
    )
    args = [a for a in args if a != "rl.stage1_recipe=null"]
    assert main(args) == 0
    assert (stage1 / "hf" / "config.json").is_file() and len(read_metrics(stage1)) == 1
    from nemo_rcgrpo.utils.provenance import read_record

    record = read_record(tmp_path / "rl" / "checkpoints" / "step_1" / "tokenizer")
    assert (record["stage"], record["reward_conditioned"], record["init_stage"]) == ("rcgrpo", True, "rctp")
    m = read_metrics(tmp_path / "rl")[0]
    episodes = [json.loads(l) for l in (tmp_path / "rl" / "eval" / "step_1.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 and all(e["reward_token"] == "high" for e in episodes)
    assert all(e["weight_version"] == 1 for e in episodes)  # evaluated on the weights after step 1's update
    assert all(r["weight_version"] == 0 for r in _dump(tmp_path / "rl", 1))
    assert m["eval_reward"] == 1.0 and m["eval_accuracy"] == 100.0 and m["eval_accuracy_base"] == 100.0
    assert "eval_seconds" in m and m["reward_seconds"] >= 0
    # training rollouts: exactly the high-token ones succeed (P = 1 and 0)
    assert all(r["reward"] == (1.0 if r["reward_token"] == "high" else 0.0) for r in _dump(tmp_path / "rl", 1))


def test_dapo_filter_never_trains_on_a_zero_variance_group(data_dir, tmp_path):
    """DAPO's dynamic sampling: zero-variance groups are dropped in every round, the last included, and replaced by
    new tasks; the zero-variance share before filtering is logged too. No reward tokens outside rcgrpo."""
    assert (
        main(
            _args(
                data_dir,
                tmp_path / "d",
                "stage=dapo_filter",
                "rl.group_filter_refills=4",
                "trainer.max_steps=2",
                "generation.scripted.success_rate=0.8",
            )
        )
        == 0
    )  # P(zero variance) = 0.8^4 + 0.2^4 = 0.41
    metrics = read_metrics(tmp_path / "d")
    assert sum(m["dropped_zero_variance_groups"] for m in metrics) > 0  # the filter acted
    for step, m in enumerate(metrics, start=1):
        records = _dump(tmp_path / "d", step)
        assert all(r["reward_token"] is None for r in records) and len(records) == 4 * m["groups"]
        assert all(len({r["reward"] for r in records if r["group"] == g}) == 2 for g in range(int(m["groups"])))
        assert m["zero_variance_fraction"] == 0.0 and m["groups"] == 2.0
        assert m["sampled_groups"] == m["groups"] + m["dropped_zero_variance_groups"]
        assert m["zero_variance_fraction_sampled"] == m["dropped_zero_variance_groups"] / m["sampled_groups"]


def test_dapo_filter_stops_when_no_group_has_variance(data_dir, tmp_path, capsys):
    # the scripted policy always fails: no group ever has variance, and none may be trained on
    args = _args(
        data_dir,
        tmp_path / "e",
        "stage=dapo_filter",
        "rl.group_filter_refills=1",
        "trainer.max_steps=1",
        "generation.scripted.success_rate=0.0",
    )
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(
        "error: dapo_filter: 0 of rl.tasks_per_step=2 groups have reward variance after 2 rounds "
        "(4 zero-variance groups dropped"
    ), err
    assert not (tmp_path / "e" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "e")


def test_a_users_advantage_baseline_loaded_by_name(data_dir, tmp_path, monkeypatch):
    """plugins=[module] (outside the package) registers a baseline; the run trains with it: the dumped advantages
    are the plugin's formula of the dumped rewards, not the shipped mean baseline's."""

    monkeypatch.syspath_prepend(str(REPO / "tests" / "data" / "plugins"))
    try:
        assert (
            main(
                _args(
                    data_dir,
                    tmp_path / "p",
                    "trainer.max_steps=1",
                    "plugins=[rc_plugin_example]",
                    "rl.advantage.baseline=median_example",
                )
            )
            == 0
        )
        records = _dump(tmp_path / "p", 1)
        differs = 0
        for g in (0, 1):
            r = torch.tensor([x["reward"] for x in records if x["group"] == g], dtype=torch.float64)
            expected = ((r - r.median()) / (r.std() + 1e-6)).tolist()
            assert [x["advantage"] for x in records if x["group"] == g] == pytest.approx(expected, abs=1e-6)
            differs += expected != pytest.approx(hand_advantages(r.tolist()), abs=1e-6)
        assert differs  # the plugin's baseline is not the mean one on these rewards
    finally:
        _unload_example_plugin()


def _unload_example_plugin():
    import nemo_rcgrpo.registry as registry

    registry.table("advantage_baseline").pop("median_example", None)
    registry.table("kl_estimator").pop("zero_example", None)
    registry.table("stage").pop("rcgrpo_no_all_fail_example", None)
    registry._loaded.discard("rc_plugin_example")
    sys.modules.pop("rc_plugin_example", None)


def test_a_users_stage_loaded_by_name(data_dir, tmp_path, monkeypatch):
    """A registered stage of the RL loop (plugins=[module]): it conditions on reward tokens (conditioned=True) and
    trains only on the groups its keep_group keeps (here: not all failed), with replacements rolled out; the
    models it trains are recorded as reward-conditioned. A wrong stage name is one line listing the stages."""
    from nemo_rcgrpo.utils.provenance import read_record

    monkeypatch.syspath_prepend(str(REPO / "tests" / "data" / "plugins"))
    try:
        args = _args(
            data_dir,
            tmp_path / "s",
            "plugins=[rc_plugin_example]",
            "stage=rcgrpo_no_all_fail_example",
            "rl.group_filter_refills=4",
            "trainer.max_steps=2",
            "trainer.export_hf=true",
            "generation.scripted.success_high=0.3",
            "generation.scripted.success_low=0.0",
        )
        assert main(args) == 0  # P(a group fails in all 4 rollouts) = 0.7^2 = 0.49
        metrics = read_metrics(tmp_path / "s")
        assert sum(m["dropped_groups"] for m in metrics) > 0  # the user's filter acted
        for step, m in enumerate(metrics, start=1):
            records = _dump(tmp_path / "s", step)
            assert sorted({r["reward_token"] for r in records}) == ["high", "low"]  # conditioned: tokens drawn
            assert all(any(r["reward"] > 0 for r in records if r["group"] == g) for g in range(int(m["groups"])))
            assert m["groups"] == 2.0 and m["sampled_groups"] == m["groups"] + m["dropped_groups"]
        assert read_record(tmp_path / "s" / "hf")["reward_conditioned"] is True
    finally:
        _unload_example_plugin()
    assert main(_args(data_dir, tmp_path / "t", "stage=rcgrpo_no_all_fail_example")) == 2  # not loaded: refused


def test_the_engine_owns_truncation_and_a_step_whose_rollouts_all_fail_stops(data_dir, tmp_path, monkeypatch, capsys):
    """Deliberately misbehaving envs through the CLI's RL loop (tests/data/plugins/misbehaving_env_example.py): one
    whose reward() pays 1.0 even for a truncated episode is paid 0 for it, the reason recorded; one whose step()
    raises fails every rollout, and the run stops with one line (exit 2) instead of training on zero advantages,
    every rollout's error in the step's dump."""
    import nemo_rcgrpo.registry as registry

    monkeypatch.syspath_prepend(str(REPO / "tests" / "data" / "plugins"))
    small = [
        "plugins=[misbehaving_env_example]",
        "trainer.max_steps=1",
        "rl.tasks_per_step=1",
        "rl.group_size=2",
        "rl.max_turns=1",
        "generation.scripted.success_high=1.0",
        "generation.scripted.success_low=1.0",
    ]
    try:
        assert main(_args(data_dir, tmp_path / "a", *small, "env.name=always_paid_example")) == 0
        records = _dump(tmp_path / "a", 1)
        assert len(records) == 2 and all(r["error"] is None for r in records)
        for r in records:  # the gold plan needs more than one message: cut by rl.max_turns=1, paid 0 not 1.0
            assert (r["truncated"], r["reward"]) == ("more than 1 assistant messages", 0.0), r
            assert r["reward_details"] == {"paid": "always", "truncated": "more than 1 assistant messages"}
        capsys.readouterr()
        assert main(_args(data_dir, tmp_path / "b", *small, "env.name=step_raises_example")) == 2
        console = capsys.readouterr().err
        err = console.strip().splitlines()[-1]
        assert err.startswith("error: rcgrpo step 1: all 2 rollouts failed, nothing to train on (first: task "), err
        assert "KeyError: 'function' (at " in err and "misbehaving_env_example.py:" in err and " in step)" in err
        assert err.endswith("every rollout's error is in rollouts/step_1.jsonl")
        records = _dump(tmp_path / "b", 1)
        assert len(records) == 2 and all(r["error"].startswith("KeyError: 'function'") for r in records)
        assert all(r["reward"] == 0.0 and r["truncated"] == "rollout error" for r in records)
        assert not (tmp_path / "b" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "b")
        # the run's log file has each rollout's full traceback, down to the plugin's raising line, and the stop
        log = (tmp_path / "b" / "run.log").read_text()
        raising = next(
            i
            for i, l in enumerate(
                (REPO / "tests" / "data" / "plugins" / "misbehaving_env_example.py").read_text().splitlines(), 1
            )
            if 'raise KeyError("function")' in l
        )
        assert log.count("Traceback (most recent call last):") == 3, log[-3000:]  # 2 rollouts, then the run's stop
        assert log.count(f'misbehaving_env_example.py", line {raising}, in step') == 2 and "the run stopped: " in log
        assert "Traceback" not in console  # the console: one line per rollout, one for the stop
    finally:
        for name in ("always_paid_example", "step_raises_example"):
            registry.table("env").pop(name, None)
            registry.table("env_settings").pop(name, None)
        registry._loaded.discard("misbehaving_env_example")
        sys.modules.pop("misbehaving_env_example", None)


GOLDEN = REPO / "tests" / "data" / "golden" / "rl_steps.json"
VARIANT = (
    "trainer.max_steps=2",
    "rl.ppo_epochs=2",
    "rl.mini_batches=2",
    "rl.loss.aggregation=sequence",
    "rl.loss.correction=token_tis",
    "rl.loss.correction_cap=2.0",
    "rl.loss.kl_estimator=k1",
)


def _recorded(run_dir) -> dict:
    """A run's metrics (timings left out) and the sha256 of each rollout dump."""
    import hashlib

    timed = ("_seconds", "tokens_per_s")
    metrics = [
        {k: v for k, v in m.items() if not k.endswith(timed) and k not in ("time", "wall_time")}
        for m in read_metrics(run_dir)
    ]
    dumps = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((Path(run_dir) / "rollouts").iterdir())}
    return {"metrics": metrics, "dumps": dumps}


def _agrees(metric: str, got: float, want: float, step: int) -> bool:
    """Step 1's metrics to float rounding (1e-6); later steps' to 1e-4. Adam's first step moves every weight by
    about lr * sign(g), also where |g| is near 1e-8 and its sign is rounding: a fresh install of the same pinned
    packages gave step 2's and 3's grad_norm and kl 1e-5 apart (relative) from the recorded run, with step 1 and
    every rollout dump the same. The entropy-reward correlations are only checked to lie in [-1, 1]: over 8 rollouts of a tiny
    random model whose mean entropies all lie close to 10.777, the log of its vocabulary (the token mean and the
    mean of per-rollout means agree to 2e-5), they are ill-conditioned (two fresh installs gave values 0.05 apart
    while every other metric agreed to 1e-6). Their arithmetic is tested by hand in test_rl_batch.py."""
    if metric.startswith("entropy_reward_corr"):
        return -1.0 <= got <= 1.0
    return got == pytest.approx(want, rel=1e-6 if step == 1 else 1e-4, abs=1e-9)


def test_the_step_matches_its_recorded_run(data_dir, tmp_path, uninterrupted):
    """The CPU RL step as recorded in tests/data/golden/rl_steps.json: the default run (one fused update per step)
    and a variant with old logprobs recomputed, two epochs x two mini-batches, sequence aggregation, truncated IS
    and k1. A restructuring of the step keeps every metric (to float rounding) and every rollout dump byte for byte.
    RCGRPO_WRITE_GOLDEN=1 records it anew (only where the step is meant to change)."""
    assert main(_args(data_dir, tmp_path / "v", *VARIANT)) == 0
    got = {"default": _recorded(uninterrupted), "variant": _recorded(tmp_path / "v")}
    if os.environ.get("RCGRPO_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    for run in ("default", "variant"):
        assert got[run]["dumps"] == want[run]["dumps"], run
        assert len(got[run]["metrics"]) == len(want[run]["metrics"])
        off = []  # every metric off, so a failure shows the whole difference at once
        for step, (g, w) in enumerate(zip(got[run]["metrics"], want[run]["metrics"]), 1):
            off += [(step, k, g[k], w[k]) for k in w if k in g and not _agrees(k, g[k], w[k], step)]
            off += [(step, k, "only one side has it") for k in set(g) ^ set(w)]
        assert not off, (run, off)


def _without_versions(records):
    return [{k: v for k, v in r.items() if k not in ("weight_version", "turn_versions")} for r in records]


def test_rollouts_generated_ahead_change_nothing_but_versions(data_dir, tmp_path, uninterrupted, monkeypatch):
    """rl.max_staleness=1 with a generator that holds its own weights (the scripted one: its rollouts do not depend
    on them): a thread generates the next step's rollouts while a step trains, from the same tasks, seeded rng and
    filters, so every rollout, loss and update is the synchronous run's. Each rollout starts at most one version
    behind the weights that train on it. The run stops after step 2 (a stop drops whatever was generated ahead;
    trainer.stop_after collects nothing past its last step), and the resumed run draws the same tasks again. An
    evaluation after every step calls the generator between the rollout thread's
    calls and changes none of its rollouts (the synchronous run has none).

    Forced: step 2's collection (generated ahead while step 1 trains) holds its second generator call back until
    step 1's update has landed, so its rollouts' first turns ran on version 0 and their later turns on version 1.
    Each such rollout is kept whole, records both versions, and counts its staleness from its first turn (1, not
    0); the run stops right after that step, and its checkpoint resumes into the synchronous run. (What a stop
    drops when it comes while rollouts are generated ahead: the SIGTERM and dying-generator tests at k = 1.)"""
    import threading

    from nemo_rcgrpo.generation.gated import GatedGenerator
    from nemo_rcgrpo.recipes import rl as rl_recipe

    collecting, calls, held = threading.local(), {}, {}

    class Marking(rl_recipe.AheadCollector):
        def __init__(self, collect, first_step, *args, **kwargs):
            held["step"] = first_step + 1  # collected while step first_step trains

            def marked(step, cursor):
                collecting.step = step
                return collect(step, cursor)

            super().__init__(marked, first_step, *args, **kwargs)

    original = GatedGenerator.generate

    def hold(self, prompts, params):
        step = getattr(collecting, "step", None)
        if step is not None:
            calls[step] = calls.get(step, 0) + 1
            if step == held.get("step") and calls[step] == 2:  # outside the gate's lock: the update can land
                deadline = time.monotonic() + 120
                while self.version < step - 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert self.version == step - 1, f"step {step - 1}'s update never landed"
        return original(self, prompts, params)

    monkeypatch.setattr(rl_recipe, "AheadCollector", Marking)
    monkeypatch.setattr(GatedGenerator, "generate", hold)
    run = tmp_path / "ahead"
    ahead = ("rl.max_staleness=1", "rl.eval_every=1", "rl.eval_tasks=2")
    assert main(_args(data_dir, run, *ahead, "trainer.stop_after=2")) == 0
    assert [m["step"] for m in read_metrics(run)] == [1, 2] and calls[2] >= 2
    stopped = read_metrics(run)[1]
    assert main(_args(data_dir, run, *ahead)) == 0
    assert held["step"] == 4  # the resumed run trains step 3 alone: nothing is collected ahead of it
    _same_as_uninterrupted_but_versions(run, uninterrupted)
    for step, m in zip((1, 2, 3), read_metrics(run)):
        for r in _dump(run, step):
            assert 0 <= step - 1 - r["weight_version"] <= 1, (step, r["weight_version"])
            assert r["turn_versions"][0] == r["weight_version"] and r["turn_versions"] == sorted(r["turn_versions"])
            assert len(r["turn_versions"]) == r["num_turns"]
        assert 0 <= m["staleness_mean"] <= m["staleness_max"] <= 1 and m["rollout_wait_seconds"] >= 0
        assert 0 <= m["eval_accuracy"] <= 100
        assert m["generation_blocked_seconds"] >= 0 and m["update_waited_seconds"] >= 0
    spanning = [r for r in _dump(run, 2) if len(set(r["turn_versions"])) > 1]
    assert spanning, "no rollout of step 2 ran a turn after step 1's update"
    for r in _dump(run, 2):  # every rollout of step 2 started on version 0, and none was dropped or re-run
        assert r["weight_version"] == 0 and set(r["turn_versions"]) <= {0, 1}
    for r in spanning:
        assert r["turn_versions"] == [0] + [1] * (r["num_turns"] - 1), r["turn_versions"]
    assert stopped == read_metrics(run)[1]  # the stopped step is logged once, as it was trained
    assert stopped["spanning_rollouts"] == len(spanning) and stopped["staleness_max"] == 1 == stopped["staleness_mean"]


def _same_as_uninterrupted_but_versions(run_dir, uninterrupted):
    a, b = read_metrics(uninterrupted), read_metrics(run_dir)
    assert [m["step"] for m in b] == [1, 2, 3]
    for step, x, y in zip((1, 2, 3), a, b):
        assert _without_versions(_dump(uninterrupted, step)) == _without_versions(_dump(run_dir, step))
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] != 0
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5, abs=1e-7)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_rollouts_ahead_need_a_generator_with_its_own_weights(data_dir, tmp_path, capsys):
    assert main(_args(data_dir, tmp_path / "hf", "generation=hf", "rl.max_staleness=1", "trainer.max_steps=1")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: rl.max_staleness=1") and "generation=vllm" in err, err
    assert main(_args(data_dir, tmp_path / "neg", "rl.max_staleness=-1")) == 2
    assert "rl.max_staleness=-1: must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("k", [0, 1])
def test_a_generator_that_dies_is_one_resumable_line(data_dir, tmp_path, uninterrupted, monkeypatch, capsys, k):
    """The generator fails (a dead server) once it holds step 1's weights: in step 2 with the synchronous loop; with
    rollouts generated ahead while step 2 trains (or in step 2). Either way the run stops with one line that names
    the checkpoint to resume from, and the resumed run is the uninterrupted one."""
    from nemo_rcgrpo.generation.scripted import ScriptedGenerator
    from nemo_rcgrpo.generation.vllm_client import GeneratorError

    original = ScriptedGenerator.generate

    def dies(self, prompts, params):
        if self.version >= 1:
            raise GeneratorError("vLLM server http://127.0.0.1:1: connection refused")
        return original(self, prompts, params)

    run = tmp_path / f"dead{k}"
    args = _args(data_dir, run, f"rl.max_staleness={k}")
    monkeypatch.setattr(ScriptedGenerator, "generate", dies)
    assert main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    done = len(read_metrics(run))
    assert done == 1 or (k == 1 and done == 2), done
    assert (
        last.startswith("error: vLLM server http://127.0.0.1:1")
        and f"[in step {done + 1}; the last checkpoint {run / 'checkpoints' / f'step_{done}'} resumes" in last
    ), last
    monkeypatch.setattr(ScriptedGenerator, "generate", original)
    assert main(args) == 0
    _same_as_uninterrupted_but_versions(run, uninterrupted)
