"""The paper's reward R = R_state x R_action and BFCL's official per-turn verdict.

Reward (the RC-GRPO paper, Appendix D):
  R_state  = 1 iff the public state of every involved API instance equals the
             state reached by replaying the ground truth from the same initial
             config (what BFCL's state checker compares: attributes not
             starting with '_').
  R_action = 1 iff every gold action a* has some action a in the trajectory
             with the same name and a.args[k] == v for every gold argument
             (k, v). Positional gold arguments are bound to names through the
             signature; the model's arguments are compared after the method's
             defaults are applied (omitting an argument equals passing its
             default); extra optional arguments and order are ignored.

Official verdict (bfcl_eval multi_turn_checker): after every turn whose ground
truth is non-empty, the model must have made a decodable call in that turn, the
state must equal the gold state after that turn, and every gold result string
of the turn must be among the model's results so far (multiset inclusion).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from nemo_rcgrpo.envs.bfcl.apis import build_instances, public_state, snapshot, state_differences
from nemo_rcgrpo.envs.bfcl.executor import ExecutedCall, Toolbox
from nemo_rcgrpo.envs.bfcl.tasks import BFCLDataError, BFCLTask
from nemo_rcgrpo.envs.calls import CallRejected, parse_call_string
from nemo_rcgrpo.registry import lookup, register
from nemo_rcgrpo.types import OfficialVerdict, RewardInfo


@dataclass(frozen=True)
class GoldAction:
    name: str
    arguments: Mapping[str, Any]  # explicit gold arguments, positional ones bound to names

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        return f"{self.name}({args})"


@dataclass(frozen=True)
class GoldReplay:
    """The ground truth executed once: results, state after each turn, actions."""

    turn_results: tuple[tuple[str, ...], ...]
    turn_states: tuple[Mapping[str, Mapping[str, Any]], ...]
    turn_has_calls: tuple[bool, ...]
    actions: tuple[GoldAction, ...]

    @property
    def final_state(self) -> Mapping[str, Mapping[str, Any]]:
        return self.turn_states[-1]


def replay_gold(task: BFCLTask) -> GoldReplay:
    """Execute the ground truth of ``task`` through the safe executor.

    The state after each turn is kept for the per-turn verdict, copying only
    what can still change: a class is copied at the end of turn t only if a
    later turn calls one of its methods; otherwise its state at t is its final
    state, and the replay's own instances (which nothing else ever touches)
    are referenced directly. Unchanged classes reuse the previous copy.
    """
    instances = build_instances(task)
    toolbox = Toolbox(instances, task.tools)
    class_of = {t.name: t.class_name for t in task.tools}
    parsed = []
    for turn, calls in enumerate(task.ground_truth):
        try:
            parsed.append([parse_call_string(text) for text in calls])
        except CallRejected as e:
            raise BFCLDataError(f"{task.id} turn {turn}: ground-truth call rejected: {e}") from None
    touched = [{class_of.get(c.name) for c in calls} for calls in parsed]
    last_touch = {name: max((t for t, cs in enumerate(touched) if name in cs), default=-1) for name in instances}
    live = {name: public_state(inst) for name, inst in instances.items()}  # dicts of live attributes
    turn_results, turn_states, actions = [], [], []
    previous: dict[str, Any] = {}
    for turn, calls in enumerate(parsed):
        results = []
        for call in calls:
            try:
                executed = toolbox.execute(call)
            except CallRejected as e:
                raise BFCLDataError(f"{task.id} turn {turn}: ground-truth call {call.name} rejected: {e}") from None
            results.append(executed.result)
            actions.append(GoldAction(executed.name, executed.arguments))
        turn_results.append(tuple(results))
        state = {}
        for name, inst in instances.items():
            if turn >= last_touch[name]:
                state[name] = live[name] if name not in touched[turn] else public_state(inst)
                live[name] = state[name]
            elif name in touched[turn] or name not in previous:
                state[name] = snapshot({name: inst})[name]
            else:
                state[name] = previous[name]
        turn_states.append(state)
        previous = state
    return GoldReplay(
        turn_results=tuple(turn_results),
        turn_states=tuple(turn_states),
        turn_has_calls=tuple(bool(c) for c in task.ground_truth),
        actions=tuple(actions),
    )


def _canon(value: Any) -> Any:
    """Tuples and lists compare equal (call strings give tuples, JSON gives lists)."""
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    return value


def action_matches(gold: GoldAction, call: ExecutedCall) -> bool:
    if gold.name != call.name:
        return False
    args = call.full_arguments
    return all(k in args and _canon(args[k]) == _canon(v) for k, v in gold.arguments.items())


def missing_actions(gold: Iterable[GoldAction], calls: Sequence[ExecutedCall]) -> list[GoldAction]:
    """Gold actions with no matching call in the trajectory (R_action = not missing)."""
    by_name: dict[str, list[ExecutedCall]] = {}
    for c in calls:
        by_name.setdefault(c.name, []).append(c)
    return [g for g in gold if not any(action_matches(g, c) for c in by_name.get(g.name, ()))]


def compute_reward(
    instances: Mapping[str, object],
    calls: Sequence[ExecutedCall],
    gold: GoldReplay,
    truncated: str | None = None,
    reward: str = "state_x_action",
) -> RewardInfo:
    """The paper's two components of a finished trajectory and the value of the registered ``reward`` (by default
    R = R_state x R_action); a truncated one scores 0."""
    diffs = state_differences(instances, gold.final_state)
    missing = missing_actions(gold.actions, calls)
    state_ok, actions_ok = not diffs, not missing
    details: dict[str, Any] = {
        "state_differences": diffs,
        "missing_actions": [str(m) for m in missing],
        "num_calls": len(calls),
    }
    if truncated:
        details["truncated"] = truncated
    components = RewardInfo(value=0.0, state_ok=state_ok, actions_ok=actions_ok, details=details)
    value = 0.0 if truncated else float(lookup("reward", reward)(components))
    return dataclasses.replace(components, value=value)


# The rewards BFCL's env can pay (``env.settings.reward``): each ``fn(components: RewardInfo) -> float`` from the paper's
# two components, called once by compute_reward (which pays 0 for a truncated episode whatever the reward).
@register("reward", "state_x_action")
def state_x_action(info: RewardInfo) -> float:
    """The paper's R = R_state x R_action (Appendix D)."""
    return float(info.state_ok and info.actions_ok)


@register("reward", "state")
def state_only(info: RewardInfo) -> float:
    """R_state alone: the final state equals the gold state (an ablation: extra or misdirected calls that leave
    the state right are not punished)."""
    return float(info.state_ok)


@register("reward", "action")
def action_only(info: RewardInfo) -> float:
    """R_action alone: every gold action was called with the gold arguments (an ablation: side effects beyond
    the gold state are not punished)."""
    return float(info.actions_ok)


class OfficialChecker:
    """BFCL's multi-turn checker, fed turn by turn while the episode runs."""

    def __init__(self, gold: GoldReplay):
        self.gold = gold
        self.results_so_far: list[str] = []
        self.turns_checked = 0
        self.failure: OfficialVerdict | None = None

    def end_turn(self, turn: int, instances: Mapping[str, object], results: Sequence[str], decoded_steps: int) -> None:
        self.results_so_far.extend(results)
        self.turns_checked = turn + 1
        if self.failure is not None or not self.gold.turn_has_calls[turn]:
            return  # turns with empty ground truth are not checked (as in BFCL)
        if decoded_steps == 0:
            self._fail(turn, "multi_turn:empty_turn_model_response", f"Model response list is empty for turn {turn}")
            return
        diffs = state_differences(instances, self.gold.turn_states[turn])
        if diffs:
            self._fail(turn, "multi_turn:instance_state_mismatch", f"state differs from ground truth: {diffs}")
            return
        available = Counter(self.results_so_far)
        missing = []
        for r in self.gold.turn_results[turn]:
            if available[r] > 0:
                available[r] -= 1
            else:
                missing.append(r)
        if missing:
            self._fail(
                turn,
                "multi_turn:execution_response_mismatch",
                f"{len(missing)} ground-truth result(s) of turn {turn} missing from the model's results",
            )

    def _fail(self, turn: int, error_type: str, message: str) -> None:
        self.failure = OfficialVerdict(valid=False, error_type=error_type, error_message=message, turn=turn)

    def verdict(self, stopped_early: str | None = None) -> OfficialVerdict:
        """BFCL first checks that every turn was played (else ``force_terminated``), then the turns."""
        total = len(self.gold.turn_results)
        if self.turns_checked < total:
            return OfficialVerdict(
                valid=False,
                error_type="multi_turn:force_terminated",
                error_message=stopped_early or f"episode ended after {self.turns_checked} of {total} turns",
                turn=self.turns_checked,
            )
        return self.failure if self.failure is not None else OfficialVerdict(valid=True)
