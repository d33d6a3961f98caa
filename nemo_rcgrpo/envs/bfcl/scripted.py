"""A scripted generator (``generation.backend=scripted``): plays chosen completions instead of sampling a model.

For RL tests and for checking a pipeline end to end: groups get known, mixed rewards, so the path from rewards
to advantages, loss, gradient and weights is exercised even with a random tiny policy (which scores 0 on every
rollout, leaving every group at zero variance).

Each rollout is, at its first turn, either a *success* (it plays the task's ground truth, as the expert
trajectories of `prepare-data` do) or a *failure* (a verified reward-0 perturbation of the ground truth, built by
`envs/bfcl/failures.py` as the failure trajectories are). The choice is a seeded coin per rollout, with

    P(success) = success_high  when the prompt carries the high reward token,
                 success_low   when it carries the low one,
                 success_rate  otherwise (GRPO, evaluation without a token),

so a scripted "RCTP-FT model" follows its reward token as strongly as one chooses. The coin depends on the
sampling seed the engine passes (step and round), the rollout's position in the first generator call and its
prompt ids, so a resumed run plays the same rollouts as an uninterrupted one.

Token-in, token-out like every generator: the task is recognised in the decoded prompt (its first user message;
tasks that share a request are played alike when their plans are the same messages, as bfcl_micro's twins that
differ only in files the request does not touch, and refused otherwise, as base and long_context with both
categories in the run),
later turns of a rollout are recognised because their prompt extends an earlier prompt plus completion, and a
completion is the token ids of the planned assistant message as the chat format renders it (the trained tokens:
content and end-of-turn). Sampler logprobs are 0.0 (the completion is a choice, not a sample). Weights sent to it
are consumed and ignored; ``version`` records the last update.

The live rollouts are kept per calling thread: with rollouts generated ahead (``rl.max_staleness`` >= 1) the
rollout thread and the trainer's in-training evaluation call one generator in turns, and each caller's next call
continues its own rollouts.
"""

from __future__ import annotations

import hashlib
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from nemo_rcgrpo.data.chat_format import one_call_per_message
from nemo_rcgrpo.data.tokenize import ChatRenderer
from nemo_rcgrpo.envs.bfcl.env import merged_prompt
from nemo_rcgrpo.envs.bfcl.failures import make_failure
from nemo_rcgrpo.envs.bfcl.suite import BFCLSuite
from nemo_rcgrpo.envs.bfcl.tasks import BFCLTask
from nemo_rcgrpo.envs.bfcl.trajectories import gold_plan, play
from nemo_rcgrpo.generation.base import Completion, SamplingParams

FINAL_TEXT = "I have completed the request."


@dataclass
class _Script:
    messages: list[dict[str, Any]]  # the planned assistant messages, in order
    turn: int  # index of the next message to play
    success: bool
    task_id: str


class ScriptedGenerator:
    shares_policy_weights = False  # weights are streamed to it (consumed and ignored), as to a server

    def __init__(
        self,
        renderer: ChatRenderer,
        suite: BFCLSuite,
        *,
        mode: str = "merged",
        success_rate: float = 0.5,
        success_high: float = 1.0,
        success_low: float = 0.0,
        high_token: str = "<|high_reward|>",
        low_token: str = "<|low_reward|>",
        failure_type: str = "wrong_param",
        seed: int = 0,
    ):
        for key, p in {"success_rate": success_rate, "success_high": success_high, "success_low": success_low}.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"generation.scripted.{key}={p}: must be in [0, 1]")
        self.renderer, self.tokenizer, self.suite, self.mode = renderer, renderer.tokenizer, suite, mode
        self.success_rate, self.success_high, self.success_low = success_rate, success_high, success_low
        self.high_token, self.low_token = high_token, low_token
        self.failure_type, self.seed = failure_type, seed
        self.version = 0
        self._opening: dict[str, list[BFCLTask]] = {}  # first user message -> the tasks that open with it
        for t in suite.tasks.values():
            self._opening.setdefault(self._opening_text(t), []).append(t)
        self._plans: dict[tuple[str, bool, int], list[dict[str, Any]]] = {}
        # prompt + completion so far -> the scripts of the live rollouts with exactly these ids (rollouts of one
        # group can share them), handed out in order: the engine passes live rollouts in a fixed order
        # (per calling thread: `_live`)
        self._local = threading.local()
        self.played = {"success": 0, "failure": 0}  # rollouts started, by kind (for tests and logs)

    # ------------------------------------------------------------------ plans
    def _opening_text(self, task: BFCLTask) -> str:
        if self.mode == "merged":
            return merged_prompt(task)
        return "\n".join(m["content"] for m in task.turns[0])

    def _tasks(self, text: str) -> list[BFCLTask]:
        """The tasks whose first user message ``text`` holds (the longest match: one text may contain another)."""
        found = [opening for opening in self._opening if opening in text]
        if not found:
            raise ValueError(
                "scripted generator: the prompt holds no known task's first user message "
                "(are generation.scripted and env.categories / env.settings.mode those of the run?)"
            )
        return self._opening[max(found, key=len)]

    def _script_for(self, tasks: list[BFCLTask], success: bool, variant: int) -> tuple[BFCLTask, list[dict]]:
        """The task to play and its plan. Tasks that open with the same request (e.g. a base task and its
        long_context twin, or generated tasks that differ only in files the request does not touch) are
        played alike when their plans are the same messages; otherwise the prompt cannot choose, and it is an
        error."""
        plans = [self._plan(t, success, variant) for t in tasks]
        if any(p != plans[0] for p in plans[1:]):
            raise ValueError(
                f"scripted generator: tasks {[t.id for t in tasks]} open with the same user message "
                "but are played differently, so a prompt cannot tell them apart; restrict "
                "env.categories (e.g. [base]) for scripted runs"
            )
        return tasks[0], plans[0]

    def _plan(self, task: BFCLTask, success: bool, variant: int) -> list[dict[str, Any]]:
        key = (task.id, success, variant)
        if key not in self._plans:
            gold = self.suite.gold(task)
            played = play(task, gold_plan(task), self.mode, gold=gold)
            if not success:
                failure = make_failure(
                    task, gold_plan(task), self.failure_type, random.Random(variant), {"mode": self.mode, "gold": gold}
                )
                if failure is None:
                    raise ValueError(f"scripted generator: no reward-0 perturbation of {task.id} could be built")
                played = failure.played
            messages = played.messages
            if self.renderer.fmt == "llama3_json":  # one call per message, as the format allows
                messages = one_call_per_message(messages)
            self._plans[key] = [m for m in messages if m["role"] == "assistant"]
        return self._plans[key]

    @property
    def _live(self) -> dict[tuple[int, ...], list[_Script]]:
        return getattr(self._local, "live", {})

    @_live.setter
    def _live(self, live: dict[tuple[int, ...], list[_Script]]) -> None:
        self._local.live = live

    def _completion_ids(self, message: dict[str, Any]) -> list[int]:
        """The trained tokens (content and end-of-turn) of ``message`` as the chat format renders it."""
        return self.renderer.completion_ids(message)

    def _start(self, prompt: list[int], seed: int | None, position: int) -> _Script:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        tasks = self._tasks(text)
        if self.high_token in text:
            p = self.success_high
        elif self.low_token in text:
            p = self.success_low
        else:
            p = self.success_rate
        digest = hashlib.sha256(repr((self.seed, seed, position, prompt)).encode()).hexdigest()
        rng = random.Random(int(digest[:16], 16))
        success = rng.random() < p
        variant = rng.randrange(4)  # a few different failures per task
        task, plan = self._script_for(tasks, success, variant)
        self.played["success" if success else "failure"] += 1
        return _Script(plan, 0, success, task.id)

    # ------------------------------------------------------------------ generator interface
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        live: dict[tuple[int, ...], list[_Script]] = {}
        out = []
        for position, prompt in enumerate(prompts):
            script = self._continue(prompt) or self._start(prompt, params.seed, position)
            if script.turn < len(script.messages):
                message = script.messages[script.turn]
            else:  # the plan is played out: a message without tool calls ends the episode
                message = {"role": "assistant", "content": FINAL_TEXT}
            script.turn += 1
            ids = self._completion_ids(message)
            reason = "stop"
            if len(ids) > params.max_new_tokens:
                ids, reason = ids[: params.max_new_tokens], "length"
            live.setdefault(tuple(prompt) + tuple(ids), []).append(script)
            out.append(
                Completion(ids, [0.0] * len(ids), reason, {"scripted": "success" if script.success else "failure"})
            )
        self._live = live  # every live rollout comes back in the next call; the rest have ended
        return out

    def _continue(self, prompt: list[int]) -> _Script | None:
        for key, scripts in self._live.items():
            if scripts and len(prompt) > len(key) and tuple(prompt[: len(key)]) == key:
                return scripts.pop(0)
        return None

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        if not isinstance(weights, (str, Path)):
            for _ in weights:  # consume (an export may be a collective's iterator)
                pass
        self.version = version

    def close(self) -> None:
        """Nothing to release."""


def make_scripted_generator(cfg: Any, model: Any, tokenizer: Any) -> ScriptedGenerator:
    from nemo_rcgrpo.envs.sources import make_suite
    from nemo_rcgrpo.models.setup import make_renderer

    s = cfg.generation.scripted
    # BFCL's env and settings: plugin.py: _check_scripted refuses another env in one line at start
    return ScriptedGenerator(
        make_renderer(cfg, tokenizer),
        make_suite(cfg.env.task_source, cfg.env.categories),
        mode=cfg.env.settings.mode,
        success_rate=s.success_rate,
        success_high=s.success_high,
        success_low=s.success_low,
        high_token=cfg.reward_tokens.high,
        low_token=cfg.reward_tokens.low,
        failure_type=s.failure_type,
        seed=s.seed,
    )
