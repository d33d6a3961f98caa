"""Builds and trains a tiny GPTModel on CPU with the flags ``flags.decide`` gives a GPU machine (no TE, no apex;
torch.compile available), every one of them as the GPU gets it (the compatibility layer maps the CUDA
initialisation to CPU; the compiled fusions build CPU kernels); prints JSON.

Run by tests/megatron/test_megatron_model.py in its own process (it creates a process group)."""

import json
import sys

import torch
from transformers import LlamaConfig

from nemo_rcgrpo.config_schema import MegatronConfig
from nemo_rcgrpo.data.batch import MicroBatch
from nemo_rcgrpo.models.megatron.builder import build_gpt, init_parallel
from nemo_rcgrpo.models.megatron.flags import Platform, decide
from nemo_rcgrpo.models.megatron.policy import pad_micro_batches


def main() -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    mcfg = MegatronConfig(recompute=sys.argv[1])
    flags = decide(Platform(cuda=True, compiles=True), mcfg, dp=1)  # torch.compile'd fusions included
    init_parallel(1, 1, 1, seed=1)
    hf = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )
    model, _, config = build_gpt(hf, mcfg, flags=flags)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**flags.ddp), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True, clip_grad=1.0),
        [ddp],
        **flags.optimizer,
    )
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 21), generator=g)
    pos = lambda t: torch.arange(t.shape[1]).unsqueeze(0).expand_as(t)  # noqa: E731
    # right padding to the FP8 multiple leaves every earlier position's logits as they were (causal attention)
    with torch.no_grad():
        ddp.eval()
        plain = ddp(ids, pos(ids), None)
        ones = torch.ones_like(ids)
        padded_ids = pad_micro_batches([MicroBatch(ids, ones, ones)], same_shape=False, multiple=16)[0].input_ids
        padded = ddp(padded_ids, pos(padded_ids), None)
        ddp.train()
    before = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    losses = []
    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(ids[:, :-1], pos(ids[:, :-1]), None, labels=ids[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok
        losses.append(float(loss))
    after = model.state_dict()
    print(
        json.dumps(
            {
                "flags": {k: v for k, v in flags.transformer.items() if isinstance(v, (bool, int, str))},
                "padded_shape": list(padded_ids.shape),
                "padding_max_diff": float((plain - padded[:, : ids.shape[1]]).abs().max()),
                "losses": losses,
                "changed": sum(not torch.equal(before[k], after[k]) for k in before),
                "tensors": len(before),
            }
        )
    )


if __name__ == "__main__":
    main()
