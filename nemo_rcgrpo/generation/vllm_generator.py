"""The ``Generator`` over vLLM servers (``generation.backend=vllm``): ``generation.vllm.engines`` managed servers
started on the policy's weights, or attached ones (``generation.vllm.url``, one or a list); generation through the
OpenAI-compatible API, token ids in and out, each group on one engine (`vllm_engines.py`); weight updates to every
engine by the collective path (`weight_transfer.py`) or by folder (`vllm_sync.py`). The server process itself:
`vllm_server.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch

from nemo_rcgrpo.generation.base import Completion, SamplingParams, WeightSync
from nemo_rcgrpo.generation.vllm_client import GeneratorError, GeneratorUnavailable, VLLMClient, WeightSyncError
from nemo_rcgrpo.generation.vllm_engines import EnginePool
from nemo_rcgrpo.generation.vllm_server import (
    DTYPES,
    ServerSpec,
    VLLMServer,
    engine_count,
    engine_specs,
    managed_server_devices,
    start_all,
    visible_gpus,
)
from nemo_rcgrpo.generation.vllm_sync import (
    FolderSync,
    _atomic_write,
    _manifest,
    _save,
    _stream_with_lm_head,
    _with_lm_head,
    fan_out,
)


class VLLMGenerator:
    """The ``Generator`` over a vLLM server (managed or attached); started on first use. Its ``version`` is its
    weight sync's (`generation.base.WeightSync`)."""

    shares_policy_weights = False  # the server holds its own copy: weights are sent (folder or collective)

    def __init__(
        self,
        vcfg: Any,
        *,
        model: Any,
        tokenizer: Any,
        weight_dir: Path,
        dtype: str,
        reward_tokens: tuple[str, ...] = (),
        model_path: str | None = None,
        generation_gpus: int = 0,
    ):
        self.vcfg, self.model, self.tokenizer, self.model_path = vcfg, model, tokenizer, model_path
        self.generation_gpus = generation_gpus  # layout.generation_gpus: a managed server's GPUs when devices is unset
        self.weight_dir, self.reward_tokens = Path(weight_dir), reward_tokens
        self.dtype = dtype if vcfg.dtype == "auto" else vcfg.dtype
        self.servers: list[VLLMServer] = []  # the started engines (none attached)
        self.pool: EnginePool | None = None
        self.sync: WeightSync | None = None
        self._version = 0  # before a server is attached, and after close
        self._tied: bool | None = None

    places_groups = True  # generate() takes each prompt's group: a group's rollouts stay on one engine

    @property
    def server(self) -> VLLMServer | None:
        """Engine 0's server process (None when attached or closed)."""
        return self.servers[0] if self.servers else None

    @property
    def client(self) -> VLLMClient | None:
        """The first live engine's client (the only one with ``engines=1``)."""
        live = self.pool.live if self.pool is not None else []
        return live[0] if live else None

    @property
    def urls(self) -> list[str]:
        """``generation.vllm.url`` as a list (empty: started engines)."""
        url = self.vcfg.url
        return [url] if isinstance(url, str) else list(url or ())

    @property
    def version(self) -> int:
        """The policy version whose weights the server holds."""
        return self.sync.version if self.sync is not None else self._version

    @property
    def weight_sync(self) -> str:
        """'collective' (auto; also 'nccl', which insists on NCCL) or 'folder'."""
        return "folder" if self.vcfg.weight_sync == "folder" else "collective"

    def start(self, weights: Iterable[tuple[str, torch.Tensor]] | None = None, version: int | None = None) -> None:
        """Attach to ``url`` (one or several), or start ``generation.vllm.engines`` servers on ``weights`` (default:
        the model's own) from ``weight_dir/v<version>`` (default: the version it served last, 0 at first)."""
        if self.pool is not None:
            return
        version = self._version if version is None else version
        v = self.vcfg
        folder = None
        if self.urls:
            clients = [self._client(url, None) for url in self.urls]
            for client in clients:
                if not client.healthy():
                    raise GeneratorUnavailable(
                        f"vLLM server {client.url} (generation.vllm.url) is not answering /health; "
                        f"start it with `rcgrpo serve MODEL --port ...` or set generation.vllm.url=null"
                    )
        else:
            folder = self._write_initial(weights if weights is not None else self.model.state_dict().items(), version)
            clients = self._start_engines(folder)
        for client in clients:
            self._check_reward_tokens(client)
        self.pool = EnginePool(clients, on_lost=self._lost)
        folders = FolderSync(self.pool, self.weight_dir, v.request_timeout, version=version)
        if folder is not None:
            folders.manifest, folders.serving = _manifest(folder), folder
            folders.keep_only(folder)  # folders of an earlier server (a resumed run) are stale
        self.sync = folders
        if self.weight_sync == "collective":
            from nemo_rcgrpo.generation.weight_transfer import CollectiveSync

            self.sync = CollectiveSync(
                self.pool,
                v.nccl_master,
                v.request_timeout,
                folders,
                backend="nccl" if v.weight_sync == "nccl" else None,
                default_dtype=DTYPES[self.dtype],
            )
        self._set_version(version)

    def _client(self, url: str, alive) -> VLLMClient:
        v = self.vcfg
        return VLLMClient(
            url,
            request_timeout=v.request_timeout,
            max_retries=v.max_retries,
            max_concurrency=v.max_concurrency,
            alive=alive,
        )

    def _start_engines(self, folder: Path) -> list[VLLMClient]:
        """``generation.vllm.engines`` servers on ``folder`` (auto: as many as the servers' GPUs hold, one on CPU),
        started at once: each on its ``tp`` GPUs (on CPU, its own cores) with its own seed (``seed + i``); all stopped
        if one fails to start."""
        v = self.vcfg
        devices = managed_server_devices(
            v.devices, visible_gpus(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")), self.generation_gpus
        )
        base = ServerSpec.from_config(
            v,
            str(folder.resolve()),
            dtype=self.dtype,
            devices=devices,
            worker_extension=self.weight_sync == "collective",
        )
        for i, spec in enumerate(engine_specs(base, engine_count(v.engines, devices, v.tp))):
            self.servers.append(VLLMServer(spec, self.weight_dir / ("server.log" if i == 0 else f"server{i}.log")))
        try:
            start_all(self.servers, v.startup_timeout)
        except BaseException:
            self.servers = []
            raise
        return [self._client(server.url, server.exit_reason) for server in self.servers]

    def _lost(self, engine: int, why: str) -> None:
        """An engine the pool dropped: its started server is stopped (its process may hang rather than exit)."""
        if engine < len(self.servers):
            self.servers[engine].stop(grace=5.0)

    def _set_version(self, version: int) -> None:
        """Every live engine labels its weights ``version`` (``/weight_info``), read back from each."""
        live = self.pool.live
        fan_out(live, lambda c: c.set_weight_version(version))
        served = fan_out(live, lambda c: c.weight_version())
        if any(s != str(version) for s in served):
            raise WeightSyncError(
                f"vLLM engines {[c.url for c in live]} report weight versions {served} after the update to {version}"
            )

    def _write_initial(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
        """The served folder: config, tokenizer, weights. Tied embeddings are served untied (lm_head written as
        its own tensor): vLLM's in-place reload on CPU refreshes the embedding but not a tied output layer."""
        config = self._hf_config()
        tensors = _with_lm_head(weights, self.tied)
        embed = tensors.get("model.embed_tokens.weight")
        if embed is not None:
            config.vocab_size = int(embed.shape[0])  # reward tokens (and any vocabulary padding) included
        if self.tied and "lm_head.weight" in tensors:
            config.tie_word_embeddings = False

        def write(tmp: Path) -> None:
            config.save_pretrained(tmp)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            _save(tensors, tmp, {n: DTYPES[self.dtype] for n, t in tensors.items() if t.is_floating_point()})

        return _atomic_write(self.weight_dir / f"v{version}", write)

    def _hf_config(self):
        """A copy of the policy's HF config (from the model, else from ``model_path``)."""
        import copy

        config = getattr(self.model, "config", None)
        if hasattr(config, "save_pretrained"):
            return copy.deepcopy(config)
        from transformers import AutoConfig  # not an HF module: the config of the model it was built from

        from nemo_rcgrpo.models.hf import resolve_model_path

        return AutoConfig.from_pretrained(str(resolve_model_path(self.model_path)), local_files_only=True)

    @property
    def tied(self) -> bool:
        """Whether the policy ties its output layer to the embedding (then it is served untied)."""
        if self._tied is None:
            self._tied = bool(getattr(self._hf_config(), "tie_word_embeddings", False))
        return self._tied

    def _check_reward_tokens(self, client: VLLMClient) -> None:
        """The served tokenizer must map each reward token to the trainer's single id (the stage-1 export as is)."""
        for token in self.reward_tokens:
            ours = self.tokenizer.convert_tokens_to_ids(token)
            served = client.tokenize(token)
            if served != [ours]:
                raise GeneratorError(
                    f"the served tokenizer at {client.url} encodes reward token {token!r} as "
                    f"{served}, the trainer's as [{ours}]: serve the policy's own export "
                    f"(a stage-1 run's hf/ folder) with its tokenizer"
                )

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, groups: list | None = None
    ) -> list[Completion]:
        """``groups``: each prompt's group key (its group's rollouts, every turn, on one engine); None: each its own."""
        self.start()
        return self.pool.generate(prompts, params, groups)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Path, version: int) -> None:
        """Push new weights as ``version`` to every live engine. Before the first use this starts the servers on them
        instead."""
        if not isinstance(weights, (str, Path)):
            if self.pool is None and not self.urls:
                self.start(weights, version)  # the served folder gets the untied output layer there
                return
            weights = _stream_with_lm_head(weights, self.tied)
        self.start()
        self.pool.prune()  # an engine lost since the last call is dropped before the update addresses it
        try:
            self.sync.push(weights, version)  # the sync's version is this one once it has finished
            self._set_version(version)
        except GeneratorUnavailable:
            if not self.pool.prune():  # an engine died during the update: the others get it again
                raise
            self.sync.push(weights, version)
            self._set_version(version)

    def close(self) -> None:
        if self.sync is not None:
            self._version = self.sync.version
            self.sync.close()
        for server in self.servers:
            server.stop()
        self.servers = []
        self.pool = self.sync = None


def make_vllm_generator(cfg: Any, model: Any, tokenizer: Any) -> VLLMGenerator:
    """The generator of ``generation=vllm`` from a `PolicySetup` (``cfg``): a started or an attached server."""
    v = cfg.generation.vllm
    weight_dir = Path(v.weight_dir) if v.weight_dir else Path(cfg.run_dir) / "generator"
    tokens = (cfg.reward_tokens.high, cfg.reward_tokens.low) if cfg.model.reward_tokens == "special" else ()
    return VLLMGenerator(
        v,
        model=model,
        tokenizer=tokenizer,
        weight_dir=weight_dir,
        dtype=cfg.model.dtype,
        reward_tokens=tokens,
        model_path=cfg.model.path,
        generation_gpus=cfg.generation_gpus,
    )
