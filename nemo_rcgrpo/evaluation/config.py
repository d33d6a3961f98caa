"""Settings of `rcgrpo eval` (conf/eval*.yaml), validated before anything runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from nemo_rcgrpo.config import PolicySetup, _build
from nemo_rcgrpo.config_schema import ChatConfig, GenerationConfig, ModelConfig, RewardTokensConfig
from nemo_rcgrpo.envs.config import EnvConfig, build_settings, settings_class
from nemo_rcgrpo.utils.config import ConfigError, plain

EvalProtocol = Literal["paper", "bfcl"]  # the choices of protocol and bfcl_handler
BFCLHandler = Literal["auto", "openai_fc", "llama3_1", "qwen_fc", "project"]


@dataclass(frozen=True)
class CheckpointPolicyConfig:
    """policy=checkpoint: an HF folder, a model name, or a run dir (its hf/ export or newest checkpoint)."""

    path: str | None = (
        None  # HF folder, model name (smollm2), run dir (its hf/ or newest checkpoint) or checkpoints/step_N
    )
    step: int | None = None  # a run dir's checkpoints/step_N instead of the newest


@dataclass(frozen=True)
class EndpointPolicyConfig:
    """policy=endpoint: any OpenAI-compatible chat completions server with tool calling."""

    url: str = "http://127.0.0.1:8000/v1"  # base URL; /chat/completions is appended
    model: str | None = None  # the served model name (required)
    # the served model's folder: its training record decides reward_token=auto and gives the reward goal, as for
    # a checkpoint (null: endpoint.model when that is a folder, as `vllm serve PATH` names the model PATH)
    model_path: str | None = None
    api_key_env: str | None = None  # name of the environment variable holding the key (never the key itself)
    timeout: float = 120.0  # seconds per request
    max_retries: int = 4  # connection errors, 408, 429 and 5xx are retried with exponential backoff
    backoff: float = 1.0  # seconds before the first retry; doubles each time
    concurrency: int = 8  # episodes in flight at once
    tool_choice: str = "auto"
    extra_body: dict[str, Any] = field(default_factory=dict)  # passed through (e.g. chat_template_kwargs)


@dataclass
class EvalConfig:
    # oracle (ground truth, 100%) | null (no calls, 0%) | checkpoint | endpoint | a plugin's (kind eval_policy)
    policy: str = "oracle"
    # paper (held-out split, merged, R_state x R_action) | bfcl (per turn, official checker)
    protocol: EvalProtocol = "paper"
    out_dir: str | None = None  # required: episodes.jsonl, summary.json
    overwrite: bool = False  # remove an evaluation already in out_dir first
    resume: bool = False  # finish an incomplete evaluation in out_dir (episodes already scored are kept)
    seed: int = 1234
    plugins: tuple[str, ...] = ()  # modules to import first: their @register entries (rcgrpo plugins lists them)
    # -- which tasks --
    data_dir: str | None = None  # paper: the split.json of this prepared data dir (null: recompute the split)
    split_seed: int = 1234  # paper, without data_dir: the split prepare-data makes with this seed
    test_fraction: float = 0.1  # paper, without data_dir: the held-out share of that split
    categories: tuple[str, ...] = ()  # the task source's categories ([]: every one it declares)
    # a registered task source (bfcl (BFCL v4) | bfcl_micro (docs/experiments.md) | a plugin's), as the run was
    # trained on
    task_source: str = "bfcl"
    env: str = "bfcl"  # a registered environment (bfcl | a plugin's), as the run was trained on (its env.name)
    # BFCL's env: the registered reward scored (the paper's R_state x R_action, success = 1; state | action: ablations)
    reward: str = "state_x_action"
    tasks: tuple[str, ...] | None = None  # explicit task ids, e.g. [multi_turn_base_0] (overrides the protocol's)
    limit: int | None = None  # at most this many tasks per category (small smoke runs)
    # -- conditioning and sampling --
    # checkpoint and endpoint: auto (high if trained with reward conditioning: its training record, else none) | high |
    # low | none
    reward_token: Literal["auto", "high", "low", "none"] = "auto"
    samples: int = 1  # rollouts per task; > 1 needs temperature > 0 (pass@k and mean accuracy)
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_new_tokens: int = 512  # per assistant message
    max_turns: int = 20  # assistant messages per episode
    max_total_tokens: int = 16384  # context budget of a token-level episode (checkpoint policy)
    max_steps: int = 20  # tool-calling steps per turn (bfcl) / per episode (paper); BFCL's limit is 20
    progress: bool = True  # a progress bar over the episodes
    # protocol=bfcl: the folder of BFCL's result files (out_dir/bfcl_result/<name>/), the model's name in BFCL's
    # model_config for `bfcl evaluate --model` (null: endpoint.model, else the policy's name)
    bfcl_registry: str | None = None
    # protocol=bfcl: which of BFCL's handlers plays the model. auto: an endpoint gets BFCL's OpenAI-compatible FC
    # handler (openai_fc), a checkpoint the local handler of its chat.format (llama3_json: llama3_1, hermes:
    # qwen_fc) | openai_fc | llama3_1 (LlamaHandler_3_1) | qwen_fc (QwenFCHandler) | project (a checkpoint's
    # per-turn episodes through the project's chat template: not BFCL's pipeline)
    bfcl_handler: BFCLHandler = "auto"
    # -- policy settings --
    checkpoint: CheckpointPolicyConfig = CheckpointPolicyConfig()
    endpoint: EndpointPolicyConfig = EndpointPolicyConfig()
    model: ModelConfig = ModelConfig()  # dtype, reward_tokens of the checkpoint policy
    chat: ChatConfig = ChatConfig()
    generation: GenerationConfig = GenerationConfig()  # checkpoint: generation=vllm runs it through a vLLM server
    reward_tokens: RewardTokensConfig = RewardTokensConfig()

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "EvalConfig":
        cfg = dict(cfg)
        from nemo_rcgrpo.registry import load_plugins

        load_plugins(cfg.get("plugins") or ())  # before validation
        if "policy" in cfg and cfg["policy"] is None:  # Hydra reads `policy=null` as YAML null
            cfg["policy"] = "null"
        config = _build(cls, cfg, "")
        if isinstance(config.categories, list):
            config.categories = tuple(config.categories)
        if isinstance(config.tasks, list):
            config.tasks = tuple(config.tasks)
        config.validate()
        return config

    @property
    def mode(self) -> str:
        return "merged" if self.protocol == "paper" else "per_turn"

    def validate(self) -> None:
        from nemo_rcgrpo.registry import lookup

        lookup("eval_policy", self.policy, setting="policy")
        if not self.out_dir:
            raise ConfigError("out_dir is required: rcgrpo eval policy=... protocol=... out_dir=PATH")

        lookup("task_source", self.task_source, setting="task_source")
        lookup("env", self.env, setting="env")
        lookup("reward", self.reward, setting="reward")
        from nemo_rcgrpo.envs.sources import check_categories

        self.categories = check_categories(self.task_source, self.categories, "categories")
        if self.samples < 1:
            raise ConfigError(f"samples={self.samples}: must be >= 1")
        if self.samples > 1 and self.temperature == 0:
            raise ConfigError("samples > 1 with temperature=0 repeats one greedy episode; set temperature > 0")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ConfigError("temperature >= 0 and 0 < top_p <= 1")
        for key in ("max_new_tokens", "max_turns", "max_total_tokens", "max_steps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}={getattr(self, key)}: must be > 0")
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"limit={self.limit}: must be > 0 or null")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"test_fraction={self.test_fraction}: must be between 0 and 1")
        if self.policy == "endpoint" and self.bfcl_handler == "project":
            raise ConfigError(
                "bfcl_handler=project is a checkpoint's; an endpoint is played by openai_fc, llama3_1 or qwen_fc"
            )
        if self.policy == "checkpoint" and self.bfcl_handler == "openai_fc":
            raise ConfigError(
                "bfcl_handler=openai_fc needs a chat server: serve the checkpoint (rcgrpo serve) and "
                "evaluate it as policy=endpoint, or use llama3_1 / qwen_fc / project"
            )
        if self.policy == "checkpoint":
            if not self.checkpoint.path:
                raise ConfigError("policy=checkpoint needs checkpoint.path (an HF folder, a model name or a run dir)")
            self.policy_setup().validate()  # model / chat / reward tokens / generation
        if self.policy == "endpoint":
            e = self.endpoint
            if not e.model:
                raise ConfigError("policy=endpoint needs endpoint.model (the served model name)")
            if not e.url.startswith(("http://", "https://")):
                raise ConfigError(f"endpoint.url={e.url!r}: must start with http:// or https://")
            if e.timeout <= 0 or e.max_retries < 0 or e.backoff < 0 or e.concurrency < 1:
                raise ConfigError("endpoint.timeout > 0, max_retries >= 0, backoff >= 0 and concurrency >= 1")

    def env_config(self) -> EnvConfig:
        """The environment of the episodes: the task source, categories, and the env's settings, of which the
        protocol's episode shape (``mode``), ``max_steps`` and ``reward`` where the env's settings have them."""
        given = {"mode": self.mode, "max_steps": self.max_steps, "reward": self.reward}
        known = {f.name for f in dataclasses.fields(settings_class(self.env))}
        return EnvConfig(
            name=self.env,
            task_source=self.task_source,
            categories=tuple(self.categories),
            settings=build_settings(self.env, {k: v for k, v in given.items() if k in known}),
        )

    def policy_setup(self, model_path: str | None = None) -> PolicySetup:
        """What a checkpoint policy is built from, as in training: model loading, chat format, generator, tasks."""
        return PolicySetup(
            model=dataclasses.replace(self.model, path=model_path or self.checkpoint.path or "smollm2"),
            chat=self.chat,
            reward_tokens=self.reward_tokens,
            generation=self.generation,
            env=self.env_config(),
            run_dir=str(self.out_dir),
        )

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))  # api keys are never settings (only the variable's name)
