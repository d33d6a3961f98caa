#!/usr/bin/env python
"""Mutation testing of the core pure modules (``make mutation``; docs/testing.md).

A small self-contained runner instead of mutmut/cosmic-ray: the mutants are
generated from the ``ast`` of each module, restricted to the functions listed in
TARGETS, and each one is written into a *copy* of the checkout under /tmp (the
checkout itself is never touched). The copy's root goes first on ``sys.path``,
so the tests import the mutated package (asserted for every run).

Operators: comparison (< <=, > >=, == !=, in / not in, is / is not, compared
strings), arithmetic and bit operators (+ -, * /, // /, % //, ** *, & |) also in
augmented assignments (not where an operand is a str or list literal: that only
raises TypeError), ``and``/``or``, dropped ``not`` and unary minus,
constants (True/False, n -> n + 1), ``return x`` -> ``return None``, slice bounds
+-1, and the swaps min/max, any/all, torch.minimum/maximum.

Speed: the parent imports the heavy third-party modules (torch, transformers,
pytest) once and forks one child per mutant; the child imports nemo_rcgrpo from
the copy and runs the module's fast unit tests with ``-x``, fastest test first
(durations from the unmutated baseline run); ``--subprocess`` runs a fresh
``python -m pytest`` instead, and survivors are always re-checked that way
(unless ``--no-verify``). One mutant at a time. A mutant that makes the tests
run past 3 x baseline + 10 s counts as killed (timeout). Tests that already fail
on the unmutated copy (someone's work in progress) are deselected and named.

Surviving mutants must be explained: EQUIVALENT (below) lists those that no test
can kill, each with the reason; any other survivor makes the run exit 1.

    python -m scripts.mutation                      # the pure core (make mutation)
    python -m scripts.mutation --all                # and the loop's glue (make mutation-all)
    python -m scripts.mutation --module kl --list   # show the mutants only
    python -m scripts.mutation --module losses --match 'clip_low'  # re-run some
    python -m scripts.mutation --survivors-of outputs/mutation/report.json  # re-check last run's survivors
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- what is mutated


def mirror_tests(path: str) -> tuple[str, ...]:
    """A module's own unit tests by the layout rule (tests/unit/test_docs_layout.py: the tests of
    nemo_rcgrpo/<folder>/ are in tests/unit/<folder>/): those of nemo_rcgrpo/<folder>/<mod>.py are
    tests/unit/<folder>/test_<mod>.py, where that file exists."""
    rel = Path(path).relative_to("nemo_rcgrpo")
    test = Path("tests", "unit", rel.parent, f"test_{rel.stem}.py")
    return (test.as_posix(),) if (ROOT / test).is_file() else ()


@dataclass(frozen=True)
class Target:
    path: str
    extra_tests: tuple[str, ...] = ()  # pytest arguments (files or node ids) beyond the module's own (mirror_tests)
    scope: tuple[str, ...] | None = None  # qualified names of the functions mutated; None: the whole module
    glue: bool = False  # the loop's glue (make mutation-all, --all); else the pure core (make mutation)

    @property
    def tests(self) -> tuple[str, ...]:
        """The pytest arguments run against each mutant: the module's own test file, then the extra ones."""
        tests = tuple(dict.fromkeys(mirror_tests(self.path) + self.extra_tests))
        if not tests:
            raise ValueError(f"{self.path}: no tests/unit file mirrors it and no extra_tests are given")
        return tests


_BFCL_CALLS = (
    "tests/unit/envs/bfcl/test_executor.py",
    "tests/unit/envs/bfcl/test_arg_strictness.py",
    "tests/unit/envs/bfcl/test_security.py",
)

# Each target's tests: its mirror file (tests/unit/<folder>/test_<mod>.py, where it exists) plus extra_tests.
TARGETS: dict[str, Target] = {
    "advantages": Target("nemo_rcgrpo/algorithms/advantages.py"),
    "losses": Target("nemo_rcgrpo/algorithms/losses.py"),
    "kl": Target("nemo_rcgrpo/algorithms/kl.py", ("tests/unit/algorithms/test_losses.py",)),
    "corrections": Target("nemo_rcgrpo/algorithms/corrections.py", ("tests/unit/algorithms/test_losses.py",)),
    "reward_tokens": Target("nemo_rcgrpo/algorithms/reward_tokens.py"),
    "rl_collect": Target("nemo_rcgrpo/algorithms/rl_collect.py", glue=True),
    "rl_batch": Target("nemo_rcgrpo/algorithms/rl_batch.py", glue=True),
    "rl_tasks": Target("nemo_rcgrpo/data/rl_tasks.py", scope=("stratified_sample", "load_rl_tasks"), glue=True),
    "sft_data": Target("nemo_rcgrpo/data/sft_data.py", scope=("build_examples", "epoch_batches", "collate"), glue=True),
    "dataset": Target(
        "nemo_rcgrpo/data/dataset.py",
        scope=("_check_message", "check_record", "jsonl_objects", "_check_columns", "_select", "to_record"),
        glue=True,
    ),
    "hf_local": Target(
        "nemo_rcgrpo/generation/hf_local.py",
        scope=(
            "sample_inverse_cdf",
            "call_seed",
            "HFGenerator.generate",
            "HFGenerator._generate_batch",
            "HFGenerator._prefill",
            "HFGenerator.update_weights",
        ),
        glue=True,
    ),
    "config": Target(
        "nemo_rcgrpo/config.py",
        ("tests/unit/test_rl_config.py",),
        scope=(
            "PolicySetup.validate",
            "TrainConfig.validate",
            "TrainConfig._validate_stage1_dataset",
            "TrainConfig._validate_megatron_section",
            "TrainConfig._validate_rl",
        ),
        glue=True,
    ),
    "prefix_tree": Target("nemo_rcgrpo/data/prefix_tree.py"),
    "packing": Target("nemo_rcgrpo/data/packing.py", ("tests/unit/data/test_flat_row.py",)),
    "shared_prefix": Target(
        "nemo_rcgrpo/models/shared_prefix.py",
        scope=(
            "tree_pass",
            "_PassCache.update",
            "_PassCache.get_seq_length",
            "_PassCache.get_mask_sizes",
            "_PassCache.take",
            "_own_checkpointing",
            "_recomputed",
            "_root",
            "_rows_rest",
            "_flat_rest",
            "shared_hidden",
        ),
        glue=True,
    ),
    "stage1_batches": Target("nemo_rcgrpo/recipes/stage1.py", scope=("micro_batches_for_rank",), glue=True),
    "layout": Target("nemo_rcgrpo/layout.py", scope=("parallel_plan",), glue=True),
    "rl_recipe": Target(
        "nemo_rcgrpo/recipes/rl.py",
        scope=(
            "step_rng",
            "eval_reward_token",
            "RLTrainer._start",
            "RLTrainer.update",
        ),
        glue=True,
    ),
    "rl_update": Target(
        "nemo_rcgrpo/recipes/rl_update.py",
        scope=("StepUpdate.apply", "StepUpdate._mine", "StepUpdate._update", "StepUpdate._budget_ranges"),
        glue=True,
    ),
    "eval_token": Target("nemo_rcgrpo/evaluation/policies.py", scope=("conditioning",), glue=True),
    "reward": Target("nemo_rcgrpo/envs/bfcl/reward.py", ("tests/unit/envs/bfcl/test_reward_classes.py",)),
    "calls": Target(
        "nemo_rcgrpo/envs/calls.py",
        _BFCL_CALLS,
        scope=(
            "_spend",
            "_check_nesting",
            "_literal",
            "parse_call_string",
            "parse_json_call",
            "to_tool_call",
            "_check_plain_names",
            "_check_call_id",
        ),
    ),
    "executor": Target(
        "nemo_rcgrpo/envs/bfcl/executor.py",
        _BFCL_CALLS,
        scope=(
            "_check_type",
            "_as_number",
            "_walk_fits",
            "_resource_guard",
            "_bind",
            "named_arguments",
            "Toolbox.__init__",
            "Toolbox.bind",
        ),
    ),
    "tokenize": Target(
        "nemo_rcgrpo/data/tokenize.py",
        ("tests/unit/data/test_chat_format.py",),
        scope=(
            "ChatRenderer._encode_pieces",
            "ChatRenderer.render",
            "ChatRenderer.render_into",
            "ChatRenderer._template_into",
            "ChatRenderer._encode_template_text",
        ),
    ),
    "stage1_datasets": Target("nemo_rcgrpo/data/stage1_datasets.py", scope=("reward_conditioned", "_first_user")),
    "chat_format": Target(
        "nemo_rcgrpo/data/chat_format.py",
        scope=(
            "Piece",
            "_hermes_pieces",
            "_hermes_generation_prompt",
            "_llama3_header",
            "_llama3_pieces",
            "_llama3_generation_prompt",
        ),
    ),
}

# Survivors that no test can kill. Key: (module, function, the mutated statement, occurrence) as the report prints
# them (`after`, `occurrence`). The statement is rendered from the ast with the mutation in place (statement_text:
# a compound statement's header only; a statement replaced whole as `before -> after`), so the key does not change
# when the source is reformatted (line breaks, quotes, parentheses, comments) and does when the code changes;
# occurrence tells apart mutants that give the same statement in one function (two `return False` -> `return None`).
EQUIVALENT: dict[tuple[str, str, str, int], str] = {
    (
        "prefix_tree",
        "hidden_index",
        "row = torch.cat([torch.arange(R), R + b * Q + torch.arange(q), suffixes + r * S + torch.arange(layout.lengths[r] - R + q)])",
        1,
    ): "a longer suffix range: the row is cut at its length (row[:n]), so the positions written are the same",
    (
        "prefix_tree",
        "hidden_index",
        "row = torch.cat([torch.arange(R), R + b * Q + torch.arange(q), suffixes + r * S + torch.arange(layout.lengths[r] + R - q)])",
        1,
    ): "a longer suffix range: the row is cut at its length (row[:n]), so the positions written are the same",
    (
        "prefix_tree",
        "step_savings",
        "return {'prefix_tokens_saved': float(saved), 'forward_flops_saved': 1.0 - shared / unshared if unshared > 1 else 0.0}",
        1,
    ): "unshared is 0 (no micro-batch) or at least 2 N for one token of a model with parameters: never in (0, 1]",
    (
        "packing",
        "positions",
        "return len(lengths) * max(lengths, default=1)",
        1,
    ): "the default is read only for no rows, and then multiplied by len(lengths) = 0",
    (
        "packing",
        "positions_saved",
        "padded = sum((len(lengths) * max(lengths, default=1) for _, lengths in batches))",
        1,
    ): "the default is read only for a micro-batch of no rows, and then multiplied by its 0 rows",
    (
        "packing",
        "choose_layout",
        "width = max(lengths, default=1)",
        1,
    ): "the default is read only for no rows: then the cost is 0 x width and nothing is packed or shared",
    (
        "packing",
        "choose_layout",
        "if share and len(rows) >= 1:",
        1,
    ): "a one-row tree runs all of its row (every row keeps a token of its own): never fewer than B x T",
    (
        "packing",
        "_tree_slots",
        "segment = torch.full((n,), -2, dtype=torch.long)",
        1,
    ): "padding is told from the rest by segment < 0 (real = segment >= 0), -1 or -2 alike",
    (
        "packing",
        "_tree_slots",
        "sees = torch.eye(2 + nb + B, dtype=torch.bool)",
        1,
    ): "a segment index is at most nb + B: the extra last row and column of the table are never read",
    (
        "packing",
        "flat_row",
        "visible = sees[seg][:, seg] & (positions[None, :] < positions[:, None]) & real[None, :] & real[:, None]",
        1,
    ): "positions rise along a path, so the only slot of its path at a slot's own position is itself, and every "
    "slot's diagonal is set right after (`visible |= eye`)",
    (
        "shared_prefix",
        "_PassCache.update",
        "key_states, value_states = (torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=-2))",
        1,
    ): "keys and values are [rows, heads, length, dim]: dim 2 is dim -2",
    (
        "shared_prefix",
        "_PassCache.update",
        "key_states, value_states = (torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=2))",
        1,
    ): "keys and values are [rows, heads, length, dim]: dim 2 is dim -2",
    (
        "shared_prefix",
        "_PassCache.get_seq_length",
        "def get_seq_length(self, layer_idx: int=1) -> int:",
        1,
    ): "every layer continues from the same length: layer 1's is layer 0's",
    (
        "shared_prefix",
        "_PassCache.get_seq_length",
        "return 0 if self.before is None else self.before[layer_idx][1].shape[-2]",
        1,
    ): "a layer's keys and values are as long as each other",
    (
        "shared_prefix",
        "_PassCache.get_seq_length",
        "return 0 if self.before is None else self.before[layer_idx][0].shape[2]",
        1,
    ): "keys are [rows, heads, length, dim]: dim 2 is dim -2",
    (
        "shared_prefix",
        "shared_hidden",
        "on = [layer for layer in layers if getattr(layer, 'gradient_checkpointing', True) and layer.training]",
        1,
    ): "every decoder layer of a model that shares (Llama, Mistral, Qwen2/3) has the setting: the default is never read",
    (
        "shared_prefix",
        "_flat_rest",
        "used[torch.cat([flat.index[r, :n + 1] for r, n in enumerate(layout.lengths)])] = True",
        1,
    ): "past a row's length `hidden_index` points at slot 0: the root's (dropped from the slots after it) or, without "
    "a root, a branch part's first slot, which is real or a padding slot no token sees and no one reads",
    (
        "shared_prefix",
        "_flat_rest",
        "out = model.get_decoder()(input_ids=flat.ids[rest].to(device)[None], attention_mask=mask[None, None], position_ids=flat.positions[rest].to(device)[None], past_key_values=cache, use_cache=True)",
        1,
    ): "a cache given is updated whatever use_cache says; without one the decoder makes one nothing reads (memory only)",
    (
        "reward",
        "compute_reward",
        "components = RewardInfo(value=1.0, state_ok=state_ok, actions_ok=actions_ok, details=details)",
        1,
    ): "the placeholder value is replaced: the registered reward reads only the components and details",
    (
        "advantages",
        "std_scale",
        "std = r.std(dim=1, keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :2])",
        1,
    ): "the branch runs only for g <= 1, where r[:, :2] and r[:, :1] have the same shape [N, g] (values unused)",
    (
        "losses",
        "GRPOLoss.__call__",
        "adv = batch.advantages.to(token_logprobs.dtype).unsqueeze(1)",
        1,
    ): "advantages are [B]: on a 1-D tensor unsqueeze(1) and unsqueeze(-1) are the same [B, 1]",
    (
        "kl",
        "kl_k3",
        "d = (ref_logprobs - logprobs).clamp(-21.0, 20.0)",
        1,
    ): "for d in [-21, -20) k3 = e^d - d - 1 > 19, above the K3_MAX = 10 clamp either way (value 10, gradient 0)",
    (
        "kl",
        "kl_k3",
        "d = (ref_logprobs - logprobs).clamp(-20.0, 21.0)",
        1,
    ): "for d in (20, 21] k3 = e^d - d - 1 > 10^8, above the K3_MAX = 10 clamp either way (value 10, gradient 0)",
    (
        "reward",
        "replay_gold",
        "last_touch = {name: max((t for t, cs in enumerate(touched) if name in cs), default=1) for name in instances}",
        1,
    ): "a class no gold call touches never changes: its state at turn 0 is copied instead of referenced, same values",
    (
        "reward",
        "replay_gold",
        "last_touch = {name: max((t for t, cs in enumerate(touched) if name in cs), default=-2) for name in instances}",
        1,
    ): "any negative default is below every turn index: `turn >= last_touch` holds for -1 and -2 alike",
    (
        "chat_format",
        "_llama3_pieces",
        "if len(calls) >= 1:",
        1,
    ): "one call through the several-calls branch is the same text: tojson of {name, parameters} and the "
    "template's concatenation agree on the names a parser accepts (identifiers)",
    (
        "chat_format",
        "_llama3_pieces",
        "if len(calls) > 2:",
        1,
    ): "unreachable with two calls: llama3_json renders through one_call_per_message, so a message reaching "
    "_llama3_pieces holds at most one call",
    (
        "rl_collect",
        "shuffled_tasks",
        "random.Random(seed * 7919 - epoch).shuffle(order)",
        1,
    ): "seeds stay distinct across steps, epochs and rounds and repeat for the same ones: any such constant draws alike",
    (
        "rl_collect",
        "shuffled_tasks",
        "random.Random(seed / 7919 + epoch).shuffle(order)",
        1,
    ): "seeds stay distinct across steps, epochs and rounds and repeat for the same ones: any such constant draws alike",
    (
        "rl_collect",
        "shuffled_tasks",
        "random.Random(seed * 7920 + epoch).shuffle(order)",
        1,
    ): "seeds stay distinct across steps, epochs and rounds and repeat for the same ones: any such constant draws alike",
    (
        "rl_collect",
        "collect_groups",
        "trajs, timings = engine.rollout_timed(specs, seed=seed + 100003 * step - 1009 * round_index)",
        1,
    ): "seeds stay distinct across steps, epochs and rounds and repeat for the same ones: any such constant draws alike",
    (
        "rl_collect",
        "collect_groups",
        "trajs, timings = engine.rollout_timed(specs, seed=seed - 100003 * step + 1009 * round_index)",
        1,
    ): "seeds stay distinct across steps, epochs and rounds and repeat for the same ones: any such constant draws alike",
    (
        "rl_collect",
        "collect_groups",
        "trajs, timings = engine.rollout_timed(specs, seed=seed + 100004 * step + 1009 * round_index)",
        1,
    ): "seeds stay distinct across steps, epochs and rounds and repeat for the same ones: any such constant draws alike",
    (
        "rl_collect",
        "collect_groups",
        "trajs, timings = engine.rollout_timed(specs, seed=seed + 100003 * step + 1010 * round_index)",
        1,
    ): "seeds stay distinct across steps, epochs and rounds and repeat for the same ones: any such constant draws alike",
    (
        "rl_tasks",
        "stratified_sample",
        "if k > len(task_ids):",
        1,
    ): "with k equal to the number of ids every category's share is all of it: the same ids in the same order",
    (
        "rl_collect",
        "collect_groups",
        "rounds = 1 + (rl.group_filter_refills if filtering else 1)",
        1,
    ): "without a filter the first round keeps every group, and the loop stops at `need <= 0` before a second",
    (
        "rl_collect",
        "collect_groups",
        "check_failures(stage, step + 1, sampled, 2.0)",
        1,
    ): "this call only raises when every rollout failed (which does not depend on the share); its warning is unused",
    (
        "rl_batch",
        "pearson",
        "cov = sum(((x + mx) * (y - my) for x, y in zip(xs, ys))) / len(xs)",
        1,
    ): "sum(y - my) = 0, so mx * sum(y - my) adds nothing: a covariance needs only one side centred",
    (
        "rl_batch",
        "pearson",
        "cov = sum(((x - mx) * (y + my) for x, y in zip(xs, ys))) / len(xs)",
        1,
    ): "sum(x - mx) = 0, so my * sum(x - mx) adds nothing: a covariance needs only one side centred",
    (
        "hf_local",
        "sample_inverse_cdf",
        "def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor, block: int=257) -> torch.Tensor:",
        1,
    ): "the draw is exact for any block size (tested with blocks of 2 and 4 and the default): only the speed differs",
    (
        "hf_local",
        "sample_inverse_cdf",
        "cdf = blocks.sum(-1).double().cumsum(1)",
        1,
    ): "cdf is [B, K]: on a 2-D tensor dimension 1 is dimension -1",
    (
        "hf_local",
        "sample_inverse_cdf",
        "j = torch.searchsorted(inner.double().cumsum(1), (target - before).unsqueeze(1), right=True).squeeze(1)",
        1,
    ): "inner is [B, block]: on a 2-D tensor dimension 1 is dimension -1",
    (
        "hf_local",
        "sample_inverse_cdf",
        "j = torch.where((inner > 0) & (slot <= j.clamp(max=block - 1).unsqueeze(1)), slot, -1).amax(1)",
        1,
    ): "the [B, block] choice: on a 2-D tensor dimension 1 is dimension -1",
    (
        "hf_local",
        "sample_inverse_cdf",
        "j = torch.where((inner > 0) & (slot <= j.clamp(max=block + 1).unsqueeze(1)), slot, -1).amax(-1)",
        1,
    ): "searchsorted gives j <= block, and every slot is <= block - 1: clamping at block or block + 1 selects alike",
    (
        "hf_local",
        "sample_inverse_cdf",
        "j = torch.where((inner > 0) & (slot <= j.clamp(max=block - 1).unsqueeze(1)), slot, -2).amax(-1)",
        1,
    ): "unreachable for u < 1: cdf[k - 1] <= target < cdf[k], so block k has mass and j passes its leading zeros",
    (
        "hf_local",
        "HFGenerator.generate",
        "seed = None if params.seed is None else params.seed - start",
        1,
    ): "a call's chunks need distinct seeds, repeated for the call's seed: seed - start gives them as seed + start does",
    (
        "hf_local",
        "HFGenerator._generate_batch",
        "positions = attn.sum(1, keepdim=True)",
        1,
    ): "attn is [B, T]: on a 2-D tensor dimension 1 is dimension -1",
    (
        "hf_local",
        "HFGenerator._generate_batch",
        "probs = scores.softmax(1)",
        1,
    ): "scores are [B, V]: on a 2-D tensor dimension 1 is dimension -1",
    (
        "hf_local",
        "HFGenerator._generate_batch",
        "picked = probs.argmax(1)",
        1,
    ): "probs are [B, V]: on a 2-D tensor dimension 1 is dimension -1",
    (
        "hf_local",
        "HFGenerator._prefill",
        "share = self.share_prefixes and len(first) <= len(prompts)",
        1,
    ): "with every prompt distinct, sharing runs every row and reorders the cache by the identity: the same cache, "
    "logits and counts (only a needless copy)",
    (
        "hf_local",
        "HFGenerator._prefill",
        "positions = (u_attn.cumsum(1) - 1).masked_fill(u_attn == 0, 1)",
        1,
    ): "u_attn is [U, W]: on a 2-D tensor dimension 1 is dimension -1",
    (
        "hf_local",
        "HFGenerator._prefill",
        "positions = (u_attn.cumsum(-1) - 1).masked_fill(u_attn == 0, 2)",
        1,
    ): "the position of a left-padding slot is never seen: the slot is masked out of every attention",
    (
        "hf_local",
        "HFGenerator._prefill",
        "out = self.model(input_ids=u_ids, attention_mask=u_attn, position_ids=positions, use_cache=True, past_key_values=_roomy_cache(self.model.config, room), logits_to_keep=2)",
        1,
    ): "only the last position's logits are read (out.logits[:, -1]): keeping two computes one more row of them",
    (
        "hf_local",
        "HFGenerator._generate_batch",
        "return [] -> return None",
        1,
    ): "unreachable: generate hands it chunks of a range over the prompts, never an empty one (an empty call "
    "returns [] from generate itself, tested)",
    (
        "hf_local",
        "HFGenerator._generate_batch",
        "if not greedy and params.top_p <= 1.0:",
        1,
    ): "top-p at 1.0 removes only tokens whose cumulative probability is <= 0, whose probability is 0 already",
    (
        "hf_local",
        "HFGenerator._generate_batch",
        "if not greedy and params.top_p < 2.0:",
        1,
    ): "top_p is at most 1 (a probability): < 2.0 is <= 1.0, and top-p at 1.0 removes only tokens of probability 0",
    (
        "executor",
        "_walk_fits",
        "return False -> return None",
        1,
    ): "its one caller refuses on `not _walk_fits(...)`: None and False refuse alike (the bound at a directory)",
    (
        "executor",
        "_walk_fits",
        "return False -> return None",
        2,
    ): "its one caller refuses on `not _walk_fits(...)`: None and False refuse alike (the bound at a file)",
    (
        "executor",
        "_check_type",
        "if typ == 'XXanyXX' or (value is None and 'default' in spec):",
        1,
    ): "'any' is not a key of _JSON_TYPES, so the `allowed is None` return two lines below skips it the same way",
}

# --------------------------------------------------------------------------- mutant generation

CMP_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
BIN_SWAP = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Pow: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}
NAME_SWAP = {"min": "max", "max": "min", "any": "all", "all": "any"}
ATTR_SWAP = {"minimum": "maximum", "maximum": "minimum"}


@dataclass
class Mutant:
    module: str
    index: int
    function: str
    line: int
    original: str  # source text of the mutated node
    mutated: str  # its replacement
    operator: str
    after: str = ""  # the mutated statement as the ast renders it (statement_text): no layout, no comments
    occurrence: int = 1  # n-th mutant of this module and function giving this same mutated statement (source order)
    status: str = "pending"  # killed | survived | timeout | pending
    killed_by: str = ""
    seconds: float = 0.0
    equivalent: str = ""  # reason, when listed in EQUIVALENT
    span: tuple[int, int, int, int] = (0, 0, 0, 0)  # lineno, col, end_lineno, end_col (bytes)
    expression: bool = True

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.module, self.function, self.after, self.occurrence)


def _docstring_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                out.add(id(first))
    return out


def _sequence_operand(node: ast.BinOp) -> bool:
    """``"a" + x`` or ``[0] * n``: swapping the operator only raises TypeError (an incompetent mutant)."""
    seq = (ast.List, ast.ListComp, ast.Tuple, ast.JoinedStr)
    for side in (node.left, node.right):
        while isinstance(side, ast.BinOp):
            side = side.right if isinstance(side.right, seq) or _is_str(side.right) else side.left
        if isinstance(side, seq) or _is_str(side):
            return True
    return False


def _is_str(node: ast.AST) -> bool:
    """A str literal, or ``"sep".join(...)`` and other methods of one."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        node = node.func.value
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


class _Collector(ast.NodeVisitor):
    """Walks the module, keeping the qualified name of the enclosing function, and proposes mutations."""

    def __init__(self, scope: tuple[str, ...] | None):
        self.scope = scope
        self.stack: list[str] = []
        self.found: list[tuple[str, ast.AST, ast.AST, str, bool]] = []  # (function, node, new node, operator, expr?)
        self.skip: set[int] = set()

    # ---- scoping
    def _in_scope(self) -> bool:
        if self.scope is None:
            return True
        name = ".".join(self.stack)
        return any(name == s or name.startswith(s + ".") for s in self.scope)

    def _enter(self, node, name):
        self.stack.append(name)
        for dec in getattr(node, "decorator_list", []):
            self.skip.update(id(n) for n in ast.walk(dec))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for a in (
                node.args.posonlyargs + node.args.args + node.args.kwonlyargs + [node.args.vararg, node.args.kwarg]
            ):
                if a is not None and a.annotation is not None:
                    self.skip.update(id(n) for n in ast.walk(a.annotation))
            if node.returns is not None:
                self.skip.update(id(n) for n in ast.walk(node.returns))
        self.generic_visit(node)
        self.stack.pop()

    def visit_FunctionDef(self, node):
        self._enter(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._enter(node, node.name)

    def visit_AnnAssign(self, node):
        self.skip.update(id(n) for n in ast.walk(node.annotation))
        self.generic_visit(node)

    def visit_JoinedStr(self, node):  # f-strings: messages, not logic
        return

    def visit_ImportFrom(self, node):
        return

    # ---- proposals
    def _add(self, node, new, operator, expression=True):
        if self._in_scope() and id(node) not in self.skip:
            self.found.append((".".join(self.stack) or "<module>", node, new, operator, expression))

    def generic_visit(self, node):
        if id(node) in self.skip:
            return
        self._propose(node)
        super().generic_visit(node)

    def _propose(self, node):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in CMP_SWAP:
                    new = copy.deepcopy(node)
                    new.ops[i] = CMP_SWAP[type(op)]()
                    self._add(node, new, "compare")
            for i, c in enumerate([node.left] + node.comparators):
                if isinstance(c, ast.Constant) and isinstance(c.value, str):
                    new = copy.deepcopy(c)
                    new.value = "XX" + c.value + "XX"
                    self._add(c, new, "string")
        elif isinstance(node, ast.BinOp) and type(node.op) in BIN_SWAP and not _sequence_operand(node):
            new = copy.deepcopy(node)
            new.op = BIN_SWAP[type(node.op)]()
            self._add(node, new, "arithmetic")
        elif (
            isinstance(node, ast.AugAssign)
            and type(node.op) in BIN_SWAP
            and not _sequence_operand(ast.BinOp(node.value, node.op, node.value))
        ):
            new = copy.deepcopy(node)
            new.op = BIN_SWAP[type(node.op)]()
            self._add(node, new, "arithmetic", expression=False)
        elif isinstance(node, ast.BoolOp):
            new = copy.deepcopy(node)
            new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            self._add(node, new, "boolean")
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            self._add(node, copy.deepcopy(node.operand), "unary")
        elif isinstance(node, ast.Constant) and not isinstance(node.value, str):
            v = node.value
            if isinstance(v, bool):
                self._add(node, ast.Constant(not v), "constant")
            elif isinstance(v, (int, float)) and not isinstance(v, complex):
                self._add(node, ast.Constant(v + 1), "constant")
        elif (
            isinstance(node, ast.Return)
            and node.value is not None
            and not (isinstance(node.value, ast.Constant) and node.value.value is None)
        ):
            self._add(node, ast.Return(ast.Constant(None)), "return", expression=False)
        elif isinstance(node, ast.Slice):
            for bound in ("lower", "upper"):
                b = getattr(node, bound)
                if b is not None:
                    for op in (ast.Sub(),) if isinstance(b, ast.Constant) else (ast.Add(), ast.Sub()):
                        self._add(b, ast.BinOp(copy.deepcopy(b), op, ast.Constant(1)), "slice")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in NAME_SWAP:
                self._add(f, ast.Name(NAME_SWAP[f.id], ast.Load()), "swap")
            elif isinstance(f, ast.Attribute) and f.attr in ATTR_SWAP:
                new = copy.deepcopy(f)
                new.attr = ATTR_SWAP[f.attr]
                self._add(f, new, "swap")


def _segment(lines: list[bytes], lineno, col, end_lineno, end_col) -> bytes:
    if lineno == end_lineno:
        return lines[lineno - 1][col:end_col]
    parts = [lines[lineno - 1][col:]] + lines[lineno : end_lineno - 1] + [lines[end_lineno - 1][:end_col]]
    return b"".join(parts)


# statements, and the parts of one that have a header of their own: a mutant's statement is the innermost of these
_HEADED = (ast.stmt, ast.ExceptHandler, ast.match_case)
_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _places(tree: ast.AST) -> dict[int, tuple[ast.AST, ast.AST, str, int | None]]:
    """id(node) -> (its statement, its parent, the parent's field holding it, its index in that field or None)."""
    places: dict[int, tuple[ast.AST, ast.AST, str, int | None]] = {}
    todo = [(tree, tree)]
    while todo:
        node, owner = todo.pop()
        for field, value in ast.iter_fields(node):
            for i, child in enumerate(value) if isinstance(value, list) else [(None, value)]:
                if isinstance(child, ast.AST):
                    child_owner = child if isinstance(child, _HEADED) else owner
                    places[id(child)] = (child_owner, node, field, i)
                    todo.append((child, child_owner))
    return places


def statement_text(node: ast.AST) -> str:
    """A statement as one line rendered from its ast (ast.unparse): the same text whatever the source's layout,
    quotes, parentheses, line breaks or comments. A compound statement (if, for, def, ...) gives its header only."""
    if any(isinstance(getattr(node, f, None), list) for f in _BLOCKS):
        node = copy.copy(node)  # shallow: the blocks are replaced, not emptied
        for f in _BLOCKS:
            if isinstance(getattr(node, f, None), list):
                setattr(node, f, [ast.Pass()] if f == "body" else [])
        if hasattr(node, "decorator_list"):
            node.decorator_list = []
        return " ".join(ast.unparse(node).strip().splitlines()[0].split())
    return " ".join(ast.unparse(node).split())


def _mutated_statement(node: ast.AST, new: ast.AST, places) -> str:
    """The key text of a mutant: its statement rendered with the mutation in place (statement_text); a statement
    replaced whole (`return x` -> `return None`, `+=` -> `-=`) gives `before -> after`."""
    owner, parent, field, index = places[id(node)]
    if owner is node:
        return f"{statement_text(node)} -> {statement_text(new)}"
    held = getattr(parent, field)
    if index is None:
        setattr(parent, field, new)
    else:
        held[index] = new
    try:
        return statement_text(owner)
    finally:
        if index is None:
            setattr(parent, field, held)
        else:
            held[index] = node


def generate(module: str, source: str) -> list[Mutant]:
    target = TARGETS[module]
    tree = ast.parse(source)
    places = _places(tree)
    collector = _Collector(target.scope)
    collector.skip.update(_docstring_nodes(tree))
    collector.visit(tree)
    lines = source.encode().splitlines(keepends=True)
    mutants, seen, occurrences = [], set(), {}
    for function, node, new, operator, expression in collector.found:
        span = (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset)
        original = " ".join(_segment(lines, *span).decode().split())
        text = ast.unparse(new)
        mutated = f"({text})" if expression else text
        if (span, mutated) in seen or ast.unparse(node) == text:
            continue
        seen.add((span, mutated))
        m = Mutant(
            module,
            len(mutants),
            function,
            node.lineno,
            original,
            " ".join(text.split()),
            operator,
            span=span,
            expression=expression,
        )
        mutated_source = apply(source, m)
        try:
            compile(mutated_source, target.path, "exec")
        except SyntaxError:
            continue
        m.after = _mutated_statement(node, new, places)
        same = (m.module, m.function, m.after)
        occurrences[same] = m.occurrence = occurrences.get(same, 0) + 1
        m.equivalent = EQUIVALENT.get(m.key, "")
        mutants.append(m)
    return mutants


def apply(source: str, m: Mutant) -> str:
    lines = source.encode().splitlines(keepends=True)
    lineno, col, end_lineno, end_col = m.span
    replacement = (f"({m.mutated})" if m.expression else m.mutated).encode()
    head = b"".join(lines[: lineno - 1]) + lines[lineno - 1][:col]
    tail = lines[end_lineno - 1][end_col:] + b"".join(lines[end_lineno:])
    return (head + replacement + tail).decode()


# --------------------------------------------------------------------------- running tests


def make_copy(dest: Path) -> Path:
    """The checkout's tracked and untracked, not ignored, files (what a clean checkout plus local edits holds)."""
    try:
        listed = (
            subprocess.run(
                ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
            )
            .stdout.decode()
            .split("\0")
        )
        files = [f for f in listed if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "outputs", "runs", "__pycache__", ".pytest_cache"}
        files = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
        ]
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    return dest


GUARD = '''"""Loaded with -p by the mutation runner (scripts/mutation.py).

The tests must import the copy, never the checkout; the baseline run records each test's
duration, and the mutant runs order the tests fastest first (a mutant is then killed by
the cheapest test that can kill it).
"""
import json
import os
from pathlib import Path

_durations = {}


def pytest_collection_modifyitems(session, config, items):
    order = os.environ.get("RCGRPO_MUTATION_ORDER")
    if order and Path(order).exists():
        seconds = json.loads(Path(order).read_text())
        items.sort(key=lambda item: seconds.get(item.nodeid, 0.0))


def pytest_collection_finish(session):
    import nemo_rcgrpo

    root = Path(os.environ["RCGRPO_MUTATION_COPY"]).resolve()
    if not Path(nemo_rcgrpo.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"mutation runner: nemo_rcgrpo imported from {nemo_rcgrpo.__file__}, not from {root}")


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("RCGRPO_MUTATION_DURATIONS")
    if out:
        Path(out).write_text(json.dumps(_durations))
'''


def _pytest_args(tests, *, stop_first: bool, deselect=()) -> list[str]:
    args = [
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "-p",
        "_mutation_guard",
        "--no-header",
        "-o",
        "addopts=",
        "-W",
        "ignore::DeprecationWarning",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    if stop_first:
        args.append("-x")
    for d in deselect:
        args += ["--deselect", d]
    return args + list(tests)


def _child(copy_root: Path, args: list[str], log: Path) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 3
    try:
        os.chdir(copy_root)
        sys.path[:0] = [str(copy_root), str(copy_root.parent / "plugin")]
        if "datasets" in sys.modules:  # imported by the parent: its cache folder was read then
            sys.modules["datasets"].config.HF_DATASETS_CACHE = Path(os.environ["HF_DATASETS_CACHE"])
        import pytest

        code = int(pytest.main(args))
    except BaseException as e:  # noqa: BLE001 - anything a mutant breaks
        print(f"mutation runner: {type(e).__name__}: {e}", flush=True)
        code = 3
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_tests(copy_root: Path, tests, timeout: float, log: Path, **kwargs) -> tuple[str, float]:
    """-> (outcome, seconds): outcome 'passed', 'failed', 'error' (collection/import/usage), 'timeout'."""
    try:
        return _run_tests(copy_root, tests, timeout, log, **kwargs)
    finally:
        shutil.rmtree(log.with_suffix(".datasets-cache"), ignore_errors=True)


def _run_tests(
    copy_root: Path,
    tests,
    timeout: float,
    log: Path,
    *,
    subprocess_mode: bool,
    deselect=(),
    stop_first: bool = True,
    env_extra: dict[str, str] | None = None,
) -> tuple[str, float]:
    args = _pytest_args(tests, stop_first=stop_first, deselect=deselect)
    for k in ("RCGRPO_MUTATION_ORDER", "RCGRPO_MUTATION_DURATIONS"):
        os.environ.pop(k, None)
    os.environ.update(env_extra or {})
    # a fresh `datasets` cache per run: a dataset cached by the unmutated code (keyed by the file, not by the code
    # that checked its rows) would hand a mutant the unmutated rows
    cache = log.with_suffix(".datasets-cache")
    shutil.rmtree(cache, ignore_errors=True)
    os.environ["HF_DATASETS_CACHE"] = str(cache)
    start = time.monotonic()
    if subprocess_mode:
        env = dict(
            os.environ,
            PYTHONDONTWRITEBYTECODE="1",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(copy_root), str(copy_root.parent / "plugin")]),
        )
        with open(log, "w") as out:
            try:
                rc = subprocess.run(
                    [sys.executable, "-m", "pytest", *args],
                    cwd=copy_root,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                ).returncode
            except subprocess.TimeoutExpired:
                return "timeout", time.monotonic() - start
    else:
        pid = os.fork()
        if pid == 0:
            _child(copy_root, args, log)
        rc = None
        while time.monotonic() - start < timeout:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.02)
        if rc is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.monotonic() - start
    return {0: "passed", 1: "failed"}.get(rc, "error"), time.monotonic() - start


def first_failure(log: Path) -> str:
    text = log.read_text(errors="replace")
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", text, re.M)
    if m:
        return m.group(1)
    m = re.search(r"^E\s+(.{1,120})", text, re.M)
    return m.group(1).strip() if m else text.strip().splitlines()[-1][:120] if text.strip() else ""


def failing_ids(log: Path) -> list[str]:
    """Node ids from the -rfE summary ("FAILED tests/x.py::test_y[a] - AssertionError")."""
    text = log.read_text(errors="replace")
    return [m.group(1).split(" - ")[0] for m in re.finditer(r"^(?:FAILED|ERROR) (.+)$", text, re.M)]


# --------------------------------------------------------------------------- main


def _preload() -> None:
    """Third-party imports shared by every forked child (never nemo_rcgrpo itself)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("pytest", "torch", "numpy", "mpmath", "transformers"):
        try:
            __import__(name)
        except ImportError:
            pass
    from importlib.metadata import entry_points

    for ep in entry_points(group="pytest11"):  # plugins: imported (and not assertion-rewritten) once
        try:
            __import__(ep.module)
        except Exception:  # noqa: BLE001 - pytest reports a broken plugin itself
            pass
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    if "transformers" in sys.modules:
        from transformers import AutoTokenizer  # noqa: F401 - the lazy import, done once
    assert not any(k == "nemo_rcgrpo" or k.startswith("nemo_rcgrpo.") for k in sys.modules)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--module",
        action="append",
        choices=sorted(TARGETS),
        help="modules to mutate (default: the pure core; --all: the glue modules too)",
    )
    p.add_argument("--all", action="store_true", help="every module, the loop's glue included (make mutation-all)")
    p.add_argument("--match", help="only mutants whose line, function or code contains this text (regex)")
    p.add_argument("--line", type=int, action="append", help="only mutants on these lines")
    p.add_argument(
        "--survivors-of",
        metavar="REPORT_JSON",
        help="only the mutants that survived in that report (re-check them after adding tests)",
    )
    p.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    p.add_argument("--subprocess", action="store_true", help="a fresh `python -m pytest` per mutant (slower)")
    p.add_argument("--no-verify", action="store_true", help="do not re-check survivors with --subprocess")
    p.add_argument("--out", default=str(ROOT / "outputs" / "mutation"), help="report folder (report.json, report.md)")
    p.add_argument("--keep", action="store_true", help="keep the copy under /tmp")
    a = p.parse_args(argv)
    sys.dont_write_bytecode = True  # a rewritten module must never be shadowed by a stale .pyc
    modules = a.module or [m for m, t in TARGETS.items() if a.all or not t.glue]
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    previous = None
    if a.survivors_of:
        previous = {
            (m["module"], m["function"], m["after"], m.get("occurrence", 1))
            for m in json.loads(Path(a.survivors_of).read_text())["mutants"]
            if m["status"] == "survived"
        }
        modules = [mod for mod in modules if any(k[0] == mod for k in previous)]
    all_mutants: dict[str, list[Mutant]] = {}
    for mod in modules:
        source = (ROOT / TARGETS[mod].path).read_text()
        ms = generate(mod, source)
        if a.match:
            ms = [m for m in ms if re.search(a.match, f"{m.line} {m.function} {m.original} -> {m.mutated}")]
        if a.line:
            ms = [m for m in ms if m.line in a.line]
        if previous is not None:
            ms = [m for m in ms if m.key in previous]
        all_mutants[mod] = ms
    if not (a.match or a.line or a.survivors_of):
        found = {m.key for ms in all_mutants.values() for m in ms}
        stale = [k for k in EQUIVALENT if k[0] in all_mutants and k not in found]
        for k in stale:  # its code changed: the entry explains nothing now, and the mutant (if any) is unexplained
            print(f"warning: EQUIVALENT lists a mutant that is not generated any more: {k}", file=sys.stderr)
    if a.list:
        for mod, ms in all_mutants.items():
            for m in ms:
                occurrence = f"  #{m.occurrence}" if m.occurrence > 1 else ""
                print(
                    f"{mod}#{m.index} {TARGETS[mod].path}:{m.line} [{m.function}] {m.operator}: "
                    f"{m.original}  ->  {m.mutated}    | {m.after}{occurrence}"
                )
        print(f"{sum(map(len, all_mutants.values()))} mutants")
        return 0

    if not a.subprocess:
        _preload()
    work = Path(tempfile.mkdtemp(prefix="rcgrpo-mutation-"))
    started = time.monotonic()
    summary: dict[str, dict] = {}
    try:
        copy_root = make_copy(work / "repo")
        (work / "plugin").mkdir()
        (work / "plugin" / "_mutation_guard.py").write_text(GUARD)
        os.environ["RCGRPO_MUTATION_COPY"] = str(copy_root)
        logs = work / "logs"
        logs.mkdir()
        for mod, ms in all_mutants.items():
            target = TARGETS[mod]
            tests = target.tests
            path = copy_root / target.path
            source = path.read_text()
            # baseline: the unmutated tests must pass; tests failing already (work in progress) are left out
            base_log = logs / f"{mod}-baseline.log"
            durations = logs / f"{mod}-durations.json"
            outcome, base_s = run_tests(
                copy_root,
                tests,
                900,
                base_log,
                subprocess_mode=a.subprocess,
                stop_first=False,
                env_extra={"RCGRPO_MUTATION_DURATIONS": str(durations)},
            )
            deselect = []
            if outcome != "passed":
                deselect = failing_ids(base_log)
                if deselect:
                    outcome, base_s = run_tests(
                        copy_root,
                        tests,
                        900,
                        base_log,
                        subprocess_mode=a.subprocess,
                        deselect=deselect,
                        stop_first=False,
                        env_extra={"RCGRPO_MUTATION_DURATIONS": str(durations)},
                    )
                if outcome != "passed":
                    print(f"{mod}: the unmutated tests do not pass; see {out_dir / (mod + '-baseline.log')}")
                    shutil.copy(base_log, out_dir / f"{mod}-baseline.log")
                    summary[mod] = {"error": "baseline failed"}
                    continue
                print(f"{mod}: the unmutated checkout fails {deselect}; those tests are left out", flush=True)
            timeout = 3 * base_s + 10
            print(f"{mod}: {len(ms)} mutants, tests {' '.join(tests)} (baseline {base_s:.1f}s)", flush=True)
            for m in ms:
                path.write_text(apply(source, m))
                log = logs / f"{mod}-{m.index}.log"
                order = {"RCGRPO_MUTATION_ORDER": str(durations)}
                outcome, m.seconds = run_tests(
                    copy_root, tests, timeout, log, subprocess_mode=a.subprocess, deselect=deselect, env_extra=order
                )
                if outcome == "passed" and not a.subprocess and not a.no_verify:
                    outcome, s2 = run_tests(
                        copy_root, tests, timeout + 20, log, subprocess_mode=True, deselect=deselect, env_extra=order
                    )
                    m.seconds += s2
                m.status = {"passed": "survived", "timeout": "timeout"}.get(outcome, "killed")
                m.killed_by = "" if outcome == "passed" else ("timeout" if outcome == "timeout" else first_failure(log))
                mark = {"killed": ".", "timeout": "T", "survived": "S"}[m.status]
                print(mark, end="", flush=True)
                if m.status == "survived":
                    print(
                        f"\n  SURVIVED {target.path}:{m.line} [{m.function}] {m.original} -> {m.mutated}: {m.after}"
                        + (f"  (equivalent: {m.equivalent})" if m.equivalent else ""),
                        flush=True,
                    )
            path.write_text(source)
            killed = sum(m.status in ("killed", "timeout") for m in ms)
            summary[mod] = {
                "path": target.path,
                "tests": list(tests),
                "deselected": deselect,
                "mutants": len(ms),
                "killed": killed,
                "survived": len(ms) - killed,
                "equivalent": sum(m.status == "survived" and bool(m.equivalent) for m in ms),
                "baseline_s": round(base_s, 2),
            }
            print(f"\n{mod}: killed {killed}/{len(ms)}", flush=True)
    finally:
        if a.keep:
            print(f"copy kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started
    report = {
        "seconds": round(elapsed, 1),
        "mode": "subprocess" if a.subprocess else "fork",
        "summary": summary,
        "mutants": [
            {k: v for k, v in asdict(m).items() if k not in ("span", "expression")}
            for ms in all_mutants.values()
            for m in ms
        ],
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=1))
    (out_dir / "report.md").write_text(markdown(report))
    print(f"report: {out_dir / 'report.md'} ({elapsed:.0f}s)")
    unexplained = [m for ms in all_mutants.values() for m in ms if m.status == "survived" and not m.equivalent]
    failed = [mod for mod, s in summary.items() if "error" in s]
    return 1 if unexplained or failed else 0


def markdown(report: dict) -> str:
    lines = [
        f"# Mutation report ({report['seconds']:.0f} s, {report['mode']} mode)",
        "",
        "| module | killed / mutants | equivalent survivors | other survivors |",
        "|---|---|---|---|",
    ]
    for mod, s in report["summary"].items():
        if "error" in s:
            lines.append(f"| {mod} | {s['error']} | | |")
        else:
            lines.append(
                f"| {mod} | {s['killed']} / {s['mutants']} | {s['equivalent']} | {s['survived'] - s['equivalent']} |"
            )
    lines += [
        "",
        "## Survivors",
        "",
        "| file:line | function | mutation | mutated statement | equivalent |",
        "|---|---|---|---|---|",
    ]
    for m in report["mutants"]:
        if m["status"] == "survived":
            path = TARGETS[m["module"]].path
            cell = lambda text: text.replace("|", "\\|")  # noqa: E731
            lines.append(
                f"| {path}:{m['line']} | {m['function']} | `{cell(m['original'])}` -> `{cell(m['mutated'])}` "
                f"| `{cell(m['after'])}` | {m['equivalent'] or '**no**'} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
