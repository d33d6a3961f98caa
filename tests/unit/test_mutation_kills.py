"""Tests written to kill the mutants that survived `make mutation` (docs/testing.md).

Each test names the mutant(s) it kills; the expectations are worked out by hand in the comments.
Boundaries are tested on both sides: the largest value accepted and the smallest refused.
"""

import inspect
import math
import random

import pytest
import torch

from nemo_rcgrpo.algorithms import reward_tokens
from nemo_rcgrpo.algorithms.advantages import group_advantages
from nemo_rcgrpo.algorithms.losses import GRPOLoss, NLLStats, sft_loss
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.algorithms.reward_tokens import stratified_count
from nemo_rcgrpo.registry import lookup
from nemo_rcgrpo.envs.bfcl.calls import (MAX_CALL_CHARS, MAX_NAME_CHARS, MAX_NESTING, CallRejected, parse_call_string,
                                         parse_json_call, to_tool_call)
from nemo_rcgrpo.envs.bfcl.executor import (MAX_INT_EXPONENT, MAX_PRECISION, MAX_TREE_ENTRIES, ExecutedCall, Toolbox,
                                            _resource_guard, _walk_fits, named_arguments)
from nemo_rcgrpo.envs.bfcl.reward import GoldAction, GoldReplay, OfficialChecker, action_matches
from nemo_rcgrpo.envs.bfcl.tasks import ToolDoc
from nemo_rcgrpo.types import OfficialVerdict, ToolCall, ToolCallError

from ..conftest import rl_batch


class ZeroRandom(random.Random):
    """random() may return exactly 0.0 (probability 2^-53 per draw); this one always does."""

    def random(self):
        return 0.0


# --------------------------------------------------------------------------- advantages


def test_default_eps_and_groups_of_two():
    # kills: eps default 1e-6 -> 1.000001; `g > 1` -> `g > 2` (a group of 2 got std 0)
    # G = 2, R = (1, 0): mean 0.5, unbiased std = sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    a = group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64))
    expected = 0.5 / (math.sqrt(0.5) + 1e-6)  # 0.7071058
    assert a[0].tolist() == pytest.approx([expected, -expected], abs=1e-12)


def test_eps_is_added_to_the_std():
    # kills: `std + eps` -> `std - eps`; R = (1, 0), eps = 0.5: 0.5 / (0.70711 + 0.5) = 0.41421 (not 0.5 / 0.20711)
    a = group_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64), eps=0.5)
    assert a[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 0.5), abs=1e-12)


def test_leave_one_out_with_two_members_and_several_groups():
    # kills: `g < 2` -> `g <= 2` / `g < 3` (G = 2 refused); keepdim=True -> False in the LOO sum
    # G = 2: A_j = R_j - R_other: (1 - 0, 0 - 1)
    loo2 = group_advantages(torch.tensor([[1.0, 0.0]]), baseline="leave_one_out", scale="none")
    assert loo2.tolist() == [[1.0, -1.0]]
    # two groups of 3: (1, 0, 0) -> (1 - 0, 0 - 0.5, 0 - 0.5); (0, 1, 1) -> (0 - 1, 1 - 0.5, 1 - 0.5)
    loo = group_advantages(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]), baseline="leave_one_out", scale="none")
    assert loo.tolist() == [[1.0, -0.5, -0.5], [-1.0, 0.5, 0.5]]


def test_groups_of_one_get_zero_advantage():
    # kills: `g > 1` -> `g >= 1` (std of one sample is NaN); r[:, :1] -> r[:, :0] (shape [N, 0])
    a = group_advantages(torch.tensor([[3.0], [5.0]]))
    assert a.shape == (2, 1) and a.tolist() == [[0.0], [0.0]]


# --------------------------------------------------------------------------- losses


def test_sft_loss_by_hand():
    # kills every sft_loss mutant (no other test calls it): sign, `*` -> `/`, `/` -> `*`, max -> min, return None
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ones = torch.ones(1, 3, dtype=torch.long)
    loss, metrics = sft_loss(logp, MicroBatch(ones, ones, torch.tensor([[0, 1, 1]])), num_valid_tokens=2)
    # NLL of the two trained tokens: 2 + 3 = 5, over 2 tokens: 2.5
    assert loss.item() == pytest.approx(2.5) and metrics == NLLStats(loss=2.5, nll_sum=5.0, tokens=2.0)
    # kills: max(num_valid_tokens, 1.0) -> max(.., 2.0); one token: 3 / 1 (not 3 / 2)
    loss, _ = sft_loss(logp, MicroBatch(ones, ones, torch.tensor([[0, 0, 1]])), num_valid_tokens=1)
    assert loss.item() == pytest.approx(3.0)


def _one_token_batch(adv=1.0):
    # logp = old = ref: ratio 1, KL 0, so per-token loss = -min(1 * A, 1 * A) = -A
    z = torch.tensor([[-0.5]])
    return z.clone(), rl_batch(torch.ones(1, 1), [adv], z.clone(), old_logprobs=z.clone())


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_grpo_loss_of_a_single_token(aggregation):
    # kills: max(num_valid_tokens, 1.0) -> 2.0 (token); lengths.clamp(min=1.0) -> 2.0 (sequence)
    logp, batch = _one_token_batch(adv=1.0)
    loss, _ = GRPOLoss(aggregation=aggregation, num_sequences=1)(logp, batch, 1)
    assert loss.item() == pytest.approx(-1.0)  # -1 / 1 token (or / 1 sequence of length 1), not -1 / 2


def _clip_batch(ratios, advs):
    logp = torch.tensor([[math.log(r)] for r in ratios])
    z = torch.zeros_like(logp)
    return logp, rl_batch(torch.ones_like(logp), torch.tensor(advs, dtype=torch.float32), logp.clone(), old_logprobs=z)


def test_clipped_token_count():
    # kills: `1.0 - clip_low` -> `1.0 + clip_low`, `adv < 0` -> `adv <= 0`, `adv > 0` -> `adv >= 0` in the metric
    # a token is clipped when the clamp takes the gradient away: ratio < 0.8 with A < 0, or ratio > 1.2 with A > 0
    ratios = [0.5, 1.5, 0.5, 1.5, 0.5, 1.5, 1.1]
    advs = [-1.0, 1.0, 1.0, -1.0, 0.0, 0.0, -1.0]
    #       yes   yes   no    no    no    no    no (1.1 is inside [0.8, 1.2])
    logp, batch = _clip_batch(ratios, advs)
    _, m = GRPOLoss(clip_low=0.2, clip_high=0.2)(logp, batch, 7)
    assert m.clipped_tokens == 2.0


def test_ratio_on_the_clip_bound_is_not_clipped():
    # kills: `ratio < 1.0 - clip_low` -> `<=`, `ratio > 1.0 + clip_high` -> `>=`
    # clip_low = clip_high = 0 and logp = old: ratio = exp(0) = 1.0 exactly, on both bounds; the clamp changes nothing
    logp, batch = _clip_batch([1.0, 1.0], [-1.0, 1.0])
    _, m = GRPOLoss(clip_low=0.0, clip_high=0.0)(logp, batch, 2)
    assert m.clipped_tokens == 0.0


# --------------------------------------------------------------------------- reward tokens


def test_samplers_stay_importable_by_name():
    # kills: register_sampler's wrap returning None (the module attribute `iid` would be None)
    assert reward_tokens.iid is lookup("reward_token_sampler", "iid")
    assert reward_tokens.stratified is lookup("reward_token_sampler", "stratified")


@pytest.mark.parametrize("sampler", ["iid", "stratified"])
def test_argument_checks_are_exact(sampler):
    # kills: `or` -> `and`, `group_size < 1` -> `<= 1` / `< 2`, `p <= 1.0` -> `p < 1.0`, 1.0 -> 2.0
    fn = lookup("reward_token_sampler", sampler)
    assert [len(g) for g in fn(3, 1, 0.5, random.Random(0))] == [1, 1, 1]  # G = 1 is allowed
    assert len(fn(2, 4, 1.0, random.Random(0))) == 2 and len(fn(2, 4, 0.0, random.Random(0))) == 2  # p at 0 and 1
    for group_size, p in [(0, 0.5), (-1, 0.5), (4, 1.5), (4, 1.0001), (4, -0.1)]:
        with pytest.raises(ValueError, match="group_size"):
            fn(1, group_size, p, random.Random(0))


def test_iid_with_p_zero_never_draws_high():
    # kills: `rng.random() < p_high` -> `<=`; random() returns values in [0, 1), 0.0 included
    assert lookup("reward_token_sampler", "iid")(2, 3, 0.0, ZeroRandom()) == [[False] * 3, [False] * 3]
    assert lookup("reward_token_sampler", "iid")(1, 3, 1.0, ZeroRandom()) == [[True] * 3]


def test_stratified_count_never_rounds_a_whole_number_up():
    # kills: `rng.random() < exact - n` -> `<=`; p * G = 0.5 * 4 = 2 exactly: frac 0, so never 3, even at random() = 0
    assert stratified_count(4, 0.5, ZeroRandom()) == 2
    # frac(0.5 * 5) = 0.5 > 0.0: a draw of 0.0 rounds 2.5 up to 3
    assert stratified_count(5, 0.5, ZeroRandom()) == 3


def test_stratified_groups_have_group_size_tokens():
    # kills: `group_size - n_high` -> `group_size + n_high` (extra low tokens)
    groups = lookup("reward_token_sampler", "stratified")(50, 5, 0.5, random.Random(3))
    assert {len(g) for g in groups} == {5}
    assert {sum(g) for g in groups} == {2, 3}


# --------------------------------------------------------------------------- reward


def _call(name, arguments, full=None):
    return ExecutedCall(name, arguments, full if full is not None else arguments, "", True)


def test_action_matching_compares_dict_arguments():
    # kills: _canon's dict branch returning None (every dict would equal every other)
    gold = GoldAction("f", {"d": {"a": 1, "b": [1, 2]}})
    assert action_matches(gold, _call("f", {"d": {"a": 1, "b": (1, 2)}}))  # tuples inside dicts equal lists
    assert not action_matches(gold, _call("f", {"d": {"a": 2, "b": [1, 2]}}))
    assert not action_matches(gold, _call("f", {"d": {"a": 1}}))


def test_action_matches_returns_a_bool():
    # kills: `return False` -> `return None` for a different tool name
    assert action_matches(GoldAction("f", {}), _call("g", {})) is False
    assert action_matches(GoldAction("f", {}), _call("f", {})) is True


def test_verdict_before_any_turn_is_force_terminated():
    # kills: turns_checked = 0 -> 1; valid=False -> True; `stopped_early or msg` -> `and`
    gold = GoldReplay(turn_results=((),), turn_states=({},), turn_has_calls=(False,), actions=())
    assert OfficialChecker(gold).verdict() == OfficialVerdict(
        valid=False, error_type="multi_turn:force_terminated", error_message="episode ended after 0 of 1 turns", turn=0)
    stopped = OfficialChecker(gold).verdict(stopped_early="step limit")
    assert stopped.valid is False and stopped.error_message == "step limit"


# --------------------------------------------------------------------------- executor: argument checks


def _lists(n):  # n nested lists: the innermost element sits at depth n
    return "[" * n + "1" + "]" * n


def _dicts(n):  # n nested dicts: the innermost key and value sit at depth n
    text = "1"
    for _ in range(n):
        text = "{'k': " + text + "}"
    return text


def _tuples(n):  # n nested 1-tuples
    text = "1"
    for _ in range(n):
        text = f"({text},)"
    return text


def test_nesting_limit_is_exact():
    # kills: depth default 0 -> 1, `depth > MAX_NESTING` -> `>=`, `depth + 1` -> `depth - 1` / `depth + 2` (lists, dict
    # keys, dict values). An argument value is at depth 0; MAX_NESTING = 16 levels below it are allowed.
    assert MAX_NESTING == 16
    for nested in (_lists, _dicts):
        parse_call_string(f"f(a={nested(16)})")
        with pytest.raises(CallRejected, match="nested deeper than 16"):
            parse_call_string(f"f(a={nested(17)})")
    # a dict key is one level below its dict: key (((1,),),...) of 15 tuples puts the 1 at depth 1 + 15 = 16
    parse_call_string("f(a={" + _tuples(15) + ": 0})")
    with pytest.raises(CallRejected, match="nested deeper than 16"):
        parse_call_string("f(a={" + _tuples(16) + ": 0})")


def test_text_budget_is_exact():
    # kills: `budget[0] < 0` -> `<= 0` / `< 1`; `budget[0] -= len(list)` -> `+=`
    # the budget is MAX_CALL_CHARS = 16384, checked when text is counted:
    # key "a" (1) + a 16383-character value = 16384, accepted
    assert MAX_CALL_CHARS == 16384
    parse_json_call({"name": "f", "arguments": {"a": "x" * 16383}})
    with pytest.raises(CallRejected, match="more than 16384 characters"):
        parse_json_call({"name": "f", "arguments": {"a": "x" * 16384}})
    # a list costs one unit per element (checked at the next text): "a" 1 + 16382 + "b" 1 = 16384 accepted,
    # "a" 1 + 16383 + "b" 1 = 16385 refused
    parse_json_call({"name": "f", "arguments": {"a": [0] * 16382, "b": 0}})
    with pytest.raises(CallRejected, match="more than 16384 characters"):
        parse_json_call({"name": "f", "arguments": {"a": [0] * 16383, "b": 0}})


def test_length_limits_are_exact():
    # kills: `len(text) > MAX_CALL_CHARS` -> `>=`, `len(name) > MAX_NAME_CHARS` -> `>=`,
    # `len(arguments) > MAX_CALL_CHARS` -> `>=`
    call = "f(a='" + "x" * (16384 - 7) + "')"  # 5 + 16377 + 2 = 16384 characters
    assert len(call) == MAX_CALL_CHARS and parse_call_string(call).name == "f"
    with pytest.raises(CallRejected, match="call is 16385 characters long"):
        parse_call_string(call[:-2] + "x')")
    assert MAX_NAME_CHARS == 128
    assert parse_json_call({"name": "n" * 128}).name == "n" * 128
    with pytest.raises(CallRejected, match="longer than 128"):
        parse_json_call({"name": "n" * 129})
    arguments = '{"a": "' + "x" * (16384 - 9) + '"}'  # 7 + 16375 + 2 = 16384
    assert len(arguments) == MAX_CALL_CHARS
    assert len(parse_json_call({"name": "f", "arguments": arguments}).kwargs["a"]) == 16375
    with pytest.raises(CallRejected, match="arguments are 16385 characters long"):
        parse_json_call({"name": "f", "arguments": arguments[:-2] + 'x"}'})


def test_to_tool_call_passes_parsed_calls_through_and_clips_raw_text():
    # kills: `return raw` -> `return None`; raw[:200] -> [:199] / [:201]
    call, error = ToolCall("f", {"a": 1}), ToolCallError(raw="f(", message="bad")
    assert to_tool_call(call) is call and to_tool_call(error) is error
    text = "f(" + "x" * 300  # 302 characters, not a valid call
    result = to_tool_call(text)
    assert isinstance(result, ToolCallError) and result.raw == text[:200] and len(result.raw) == 200


class Probe:
    def f(self, i=None, xs=None):
        return "ok"


PROBE = ToolDoc("f", "Probe", {"name": "f", "parameters": {"type": "dict", "properties": {
    "i": {"type": "integer"}, "xs": {"type": "array"}}}}, inspect.signature(Probe.f))


def test_strict_array_without_item_type_accepts_any_items():
    # kills: `"items" in spec and isinstance(value, list)` -> `or` (a KeyError on spec["items"])
    box = Toolbox({"Probe": Probe()}, [PROBE], arg_types="strict")
    assert box.execute(ToolCall("f", {"xs": [1, "a", None]})).result == "ok"


def test_named_arguments_binds_positional_and_drops_self():
    # kills: named_arguments returning None, `k != "self"` -> `==`, "self" -> "XXselfXX"
    assert named_arguments(PROBE, ToolCall("f", {"xs": [1]}, args=(3,))) == {"i": 3, "xs": [1]}


class Node:
    """A directory for _tree_entries: ``contents`` maps names to Nodes (directories) or plain objects (files)."""

    def __init__(self, contents=None):
        self.contents = {} if contents is None else contents


def test_walk_bounds_by_hand():
    # kills: the entry count (1 per directory, 1 per file, `>` -> `>=`), the path characters (1 + len(name) per
    # level on top of the parent's), a cycle or a shared subtree walked as often as it is reached
    file = object()
    tree = Node({"a": file, "b": Node({"c": file, "dd": file})})  # paths: "", /a, /b, /b/c, /b/dd
    assert _walk_fits(tree, 5, 100) and not _walk_fits(tree, 4, 100)
    chars = 0 + 2 + 2 + 4 + 5
    assert _walk_fits(tree, 100, chars) and not _walk_fits(tree, 100, chars - 1)
    named = Node({"x": file})
    named.name = "root"  # the walk starts from the directory's own name: "root", "root/x"
    assert _walk_fits(named, 100, 4 + 6) and not _walk_fits(named, 100, 4 + 5)
    loop = Node({"f": file})
    loop.contents["self"] = loop  # a cycle: stops at the bound instead of running forever
    assert not _walk_fits(loop, 1000, 10**9)
    shared = Node({"f": file})
    for _ in range(40):  # cp's shallow copies: 2^40 paths, refused after at most max_entries steps
        shared = Node({"a": shared, "b": shared})
    assert not _walk_fits(shared, 10_000, 10**9)


def test_walk_of_a_deep_tree_needs_no_recursion():
    deep = Node()
    for _ in range(5 * 1000):  # deeper than the default recursion limit (1000)
        deep = Node({"d": deep})
    assert _walk_fits(deep, 10_001, 10**9)  # iterative: no RecursionError
    assert not _walk_fits(deep, 10_001, 1000)  # long paths: over the character bound


def test_resource_limits_are_exact():
    # kills: `abs(number) > MAX_PRECISION` -> `>=`, `abs(exponent) > MAX_INT_EXPONENT` -> `>=`,
    # `entries > MAX_TREE_ENTRIES` -> `>=`, `name in ("find", "du") and hasattr(...)` -> `or`
    assert (MAX_PRECISION, MAX_INT_EXPONENT, MAX_TREE_ENTRIES) == (1000, 4096, 100_000)
    for key in ("precision", "decimal_places"):
        _resource_guard("round_number", {key: 1000}, None)
        _resource_guard("round_number", {key: -1000}, None)
        with pytest.raises(CallRejected, match="at most 1000 digits"):
            _resource_guard("round_number", {key: 1001}, None)
    _resource_guard("power", {"base": 2, "exponent": 4096}, None)
    _resource_guard("power", {"base": 2, "exponent": -4096}, None)
    with pytest.raises(CallRejected, match="exceeds the limit of 4096"):
        _resource_guard("power", {"base": 2, "exponent": 4097}, None)

    class FS:
        def __init__(self, files):
            self.root = Node({str(i): object() for i in range(files)})

    _resource_guard("find", {}, FS(99_999))  # 1 + 99 999 = 100 000 entries: allowed
    with pytest.raises(CallRejected, match="more than 100000 entries"):
        _resource_guard("du", {}, FS(100_000))
    _resource_guard("ls", {}, FS(100_000))  # only find and du walk the tree


# --------------------------------------------------------------------------- renderer masks

from nemo_rcgrpo.data.chat_format import format_spec  # noqa: E402
from nemo_rcgrpo.data.tokenize import ChatRenderer, Tokenized  # noqa: E402

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|eom_id|>", "<|high_reward|>", "<|low_reward|>", "<|python_tag|>")


class CharTokenizer:
    """One id per character (its code point); the control and reward tokens are single ids from 1 000 000 up.

    ``apply_chat_template`` writes ChatML the way Qwen2.5's template does (consecutive tool results in one
    user block), so the template renderer can be checked without loading a real tokenizer.
    """

    chat_template = "ChatML with tools"

    def __init__(self, extra=()):
        self.vocab = {t: 1_000_000 + i for i, t in enumerate(SPECIALS + tuple(extra))}
        self.inverse = {i: t for t, i in self.vocab.items()}

    def get_vocab(self):
        return dict(self.vocab)

    def __call__(self, text, add_special_tokens=False, split_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids):
        return "".join(self.inverse.get(i) or chr(i) for i in ids)

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        text = "<|im_start|>system\ntools: " + ",".join(t["function"]["name"] for t in tools) + "<|im_end|>\n" \
            if tools else ""
        for i, m in enumerate(messages):
            if m["role"] == "tool":
                if i == 0 or messages[i - 1]["role"] != "tool":
                    text += "<|im_start|>user"
                text += f"\n<tool_response>\n{m['content']}\n</tool_response>"
                if i + 1 == len(messages) or messages[i + 1]["role"] != "tool":
                    text += "<|im_end|>\n"
            else:
                text += f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


CONVERSATION = [
    {"role": "user", "content": "ls please <|high_reward|>"},
    {"role": "assistant", "content": "A1"},
    {"role": "tool", "content": "r1"},
    {"role": "tool", "content": "r2"},
    {"role": "assistant", "content": "A2"},
    {"role": "user", "content": "bye"},
    {"role": "assistant", "content": "A3"},
]
TOOLS = [{"type": "function", "function": {"name": "ls"}}]


def _trained_text(tok, rendered):
    return tok.decode([i for i, m in zip(rendered.ids, rendered.mask) if m])


@pytest.mark.parametrize("renderer", ["project", "template"])
def test_generation_prompt_is_not_trained_and_render_into_returns_its_argument(renderer):
    # kills: the generation prompt's mask [0] -> [1]; render_into's `return out` -> `return None` (both renderers)
    r = ChatRenderer(CharTokenizer(), "hermes", renderer=renderer)
    messages = CONVERSATION[:1]
    with_prompt = r.render(messages, TOOLS, add_generation_prompt=True)
    n = len(r.generation_prompt_ids())  # "<|im_start|>" + "assistant\n": 1 + 10 ids
    assert n == 11 and with_prompt.ids[-n:] == r.generation_prompt_ids() and with_prompt.mask[-n:] == [0] * n
    out = Tokenized([], [])
    assert r.render_into(out, messages, 0, TOOLS) is out


def test_template_renderer_continues_from_any_message_boundary():
    # kills: previous = template(messages[:start]) -> messages[:start + 1] / [:start - 1] (the rollout engine
    # appends the messages after `start` to the ids it already has)
    r = ChatRenderer(CharTokenizer(), "hermes", renderer="template")
    full = r.render(CONVERSATION, TOOLS)
    # boundaries: after every message except inside the run of two tool results (between messages 2 and 3)
    for start in (1, 2, 4, 5, 6):
        out = r.render(CONVERSATION[:start], TOOLS)
        r.render_into(out, CONVERSATION, start, TOOLS)
        assert (out.ids, out.mask) == (full.ids, full.mask), start
    # the trained text is exactly the three assistant bodies, each with its end-of-turn token
    assert _trained_text(CharTokenizer(), full) == "A1<|im_end|>A2<|im_end|>A3<|im_end|>"


def test_template_renderer_keeps_end_of_turn_as_one_id_and_reward_tokens_out_of_template_text():
    # kills: Piece(eot, special=True) -> special=False (the end-of-turn would be trained as text characters);
    # the tail after the end-of-turn encoded with user_text=True (a reward token there would become its id)
    tok = CharTokenizer()
    r = ChatRenderer(tok, "hermes", renderer="template")
    im_end, high = tok.vocab["<|im_end|>"], tok.vocab["<|high_reward|>"]
    full = r.render(CONVERSATION, TOOLS)
    trained = [i for i, m in zip(full.ids, full.mask) if m]
    assert trained.count(im_end) == 3 and len(trained) == 3 * 3  # "A1", "A2", "A3": 2 characters + 1 id each
    # an assistant message that writes the end-of-turn string itself: what follows is template text (untrained,
    # no reward-token id: those are recognised in user text only)
    sneaky = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "A<|im_end|><|high_reward|>"}]
    rendered = r.render(sneaky)
    assert high not in rendered.ids
    assert tok.decode([i for i, m in zip(rendered.ids, rendered.mask) if m]) == "A<|im_end|>"


def test_template_header_is_the_generation_prompt_whatever_the_reward_token_names():
    # kills: the assistant header encoded with user_text=True: a configured reward token whose name occurs in the
    # header ("assistant") would become its id there, and the header would no longer be the generation prompt's ids
    tok = CharTokenizer(extra=("assistant",))
    r = ChatRenderer(tok, "hermes", renderer="template", reward_tokens=("assistant", "<|low_reward|>"))
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "A"}]
    prompt = r.render(messages[:1], add_generation_prompt=True)
    full = r.render(messages)
    assert full.ids[: len(prompt.ids)] == prompt.ids and tok.vocab["assistant"] not in full.ids


# exact renderings: text by hand from the format constants, masks through the character tokenizer

from nemo_rcgrpo.data.chat_format import (  # noqa: E402
    HERMES_TOOLS_POSTAMBLE,
    HERMES_TOOLS_PREAMBLE,
    LLAMA3_DATE_HEADER,
    LLAMA3_SYSTEM_HEADER,
    LLAMA3_TOOLS_PREAMBLE,
    render_text,
)

LS = {"type": "function", "function": {"name": "ls", "parameters": {"properties": {"a": {"type": "boolean"}}}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"a": true}'}}
HR = "<|high_reward|>"


def _check_masks(fmt, messages, tools, trained_text):
    tok = CharTokenizer()
    r = ChatRenderer(tok, fmt, renderer="project", tool_description="compact")
    rendered = r.render(messages, tools)
    text = render_text(messages, tools, fmt, "compact")
    assert tok.decode(rendered.ids) == text
    assert _trained_text(tok, rendered) == trained_text
    for control in format_spec(fmt).special_tokens:  # every control token is its one id, never characters
        assert rendered.ids.count(tok.vocab[control]) == text.count(control), control
    # the reward token is one id in user messages only; in system, tool and assistant text it stays characters
    high = tok.vocab[HR]
    user_tokens = sum(HR in (m.get("content") or "") for m in messages if m["role"] == "user")
    assert rendered.ids.count(high) == user_tokens
    return rendered


def test_hermes_rendering_without_a_system_message():
    # kills (_hermes_pieces): index == 0 -> 1, role != "system" -> ==, "system" -> "XX..", `out +=` -> `-=`,
    # "tool" -> "XX..", `content or ""` -> `and ""`, the train/special/user_text flags of every piece
    messages = [{"role": "user", "content": f"hi {HR}"},
                {"role": "assistant", "content": "ok", "tool_calls": [CALL]},
                {"role": "tool", "content": f"r {HR}"},
                {"role": "assistant", "content": None},
                {"role": "user", "content": None}]
    system = "system\n" + HERMES_TOOLS_PREAMBLE + "\nls(a?: boolean)" + HERMES_TOOLS_POSTAMBLE
    call = '<tool_call>\n{"name": "ls", "arguments": {"a": true}}\n</tool_call>'
    assert render_text(messages, [LS], "hermes", "compact") == (
        f"<|im_start|>{system}<|im_end|>\n"
        f"<|im_start|>user\nhi {HR}<|im_end|>\n"
        f"<|im_start|>assistant\nok\n{call}<|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\nr {HR}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>user\n<|im_end|>\n")
    _check_masks("hermes", messages, [LS], f"ok\n{call}<|im_end|><|im_end|>")


def test_hermes_rendering_with_a_system_message():
    # kills: the system branch (role == "system", its content `or ""`), tools added to the given system prompt once
    messages = [{"role": "system", "content": f"S {HR}"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}]
    tools_text = HERMES_TOOLS_PREAMBLE + "\nls(a?: boolean)" + HERMES_TOOLS_POSTAMBLE
    assert render_text(messages, [LS], "hermes", "compact") == (
        f"<|im_start|>system\nS {HR}\n\n{tools_text}<|im_end|>\n"
        "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n")
    assert render_text(messages, None, "hermes") == (
        f"<|im_start|>system\nS {HR}<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n")
    _check_masks("hermes", messages, [LS], "a<|im_end|>")


def _h(role):
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def test_llama3_rendering_without_a_system_message():
    # kills (_llama3_pieces): the begin-of-text and default system header only at index 0, the ipython turn, the
    # tools preamble in the first user message only (any -> all, `not` dropped, messages[:index] +- 1)
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": f"b {HR}"},
                {"role": "assistant", "content": "ignored", "tool_calls": [CALL, CALL]},
                {"role": "tool", "content": "r"},
                {"role": "tool", "content": "s"},
                {"role": "assistant", "content": " done "},
                {"role": "user", "content": None}]
    call = '{"name": "ls", "parameters": {"a": true}}'
    # a parallel turn is written as call/result pairs; results through tojson; text trimmed
    assert render_text(messages, [LS], "llama3_json", "compact") == (
        f"<|begin_of_text|>{_h('system')}{LLAMA3_SYSTEM_HEADER}<|eot_id|>"
        f"{_h('user')}{LLAMA3_TOOLS_PREAMBLE}ls(a?: boolean)\n\na<|eot_id|>"
        f"{_h('user')}b {HR}<|eot_id|>"
        f"{_h('assistant')}{call}<|eot_id|>"
        f"{_h('ipython')}\"r\"<|eot_id|>"
        f"{_h('assistant')}{call}<|eot_id|>"
        f"{_h('ipython')}\"s\"<|eot_id|>"
        f"{_h('assistant')}done<|eot_id|>"
        f"{_h('user')}<|eot_id|>")
    _check_masks("llama3_json", messages, [LS], f"{call}<|eot_id|>{call}<|eot_id|>done<|eot_id|>")


def test_llama3_rendering_with_a_system_message():
    # kills: the system branch (its content `or ""`, LLAMA3_SYSTEM_HEADER + content), no second system header,
    # the first user after a system message still gets the tools
    messages = [{"role": "system", "content": f"S {HR}"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": None}, {"role": "user", "content": "v"}]
    assert render_text(messages, [LS], "llama3_json", "compact") == (
        f"<|begin_of_text|>{_h('system')}{LLAMA3_SYSTEM_HEADER}S {HR}<|eot_id|>"
        f"{_h('user')}{LLAMA3_TOOLS_PREAMBLE}ls(a?: boolean)\n\nu<|eot_id|>"
        f"{_h('assistant')}<|eot_id|>"
        f"{_h('user')}v<|eot_id|>")
    # no tools: no "Environment: ipython" line
    assert render_text(messages[:2], None, "llama3_json") == (
        f"<|begin_of_text|>{_h('system')}{LLAMA3_DATE_HEADER}S {HR}<|eot_id|>{_h('user')}u<|eot_id|>")
    _check_masks("llama3_json", messages, [LS], "<|eot_id|>")


@pytest.mark.parametrize("fmt, prompt", [("hermes", "<|im_start|>assistant\n"),
                                         ("llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n")])
def test_generation_prompts(fmt, prompt):
    # kills: the generation prompt pieces (returned, special flags) of both formats
    tok = CharTokenizer()
    r = ChatRenderer(tok, fmt, renderer="project")
    ids = r.generation_prompt_ids()
    assert tok.decode(ids) == prompt and sum(i >= 1_000_000 for i in ids) == prompt.count("<|")
    assert "".join(p.text for p in format_spec(fmt).generation_prompt()) == prompt


def test_one_size_budget_for_every_argument():
    """Containers are checked against the budget before they are walked: a 2M-element list or a nested mapping of
    100k integer keys is refused at once, not after copying and canonicalising it."""
    with pytest.raises(CallRejected, match="more than 16384 characters of text"):
        parse_json_call({"name": "f", "arguments": {"a": [0] * 2_000_000}})
    with pytest.raises(CallRejected, match="more than 16384 characters of text"):
        parse_json_call({"name": "f", "arguments": {"a": {i: i for i in range(100_000)}}})
    # a nested mapping costs one per entry besides its text: "a" 1 + 2 entries + "x" 1 + "y" 1 = 5
    parse_json_call({"name": "f", "arguments": {"a": {"x": 0, "y": 0}, "b": "z" * (16384 - 6)}})
    with pytest.raises(CallRejected, match="more than 16384"):
        parse_json_call({"name": "f", "arguments": {"a": {"x": 0, "y": 0}, "b": "z" * (16384 - 5)}})
