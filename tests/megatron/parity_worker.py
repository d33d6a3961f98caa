"""torchrun worker: Megatron GPTModel logits, logprobs and entropies vs the HF model (fp32).

    torchrun --nproc-per-node N tests/megatron/parity_worker.py OUT.json MODEL:TP[:DTYPE] [...]

For each MODEL:TP (TP dividing N; the other ranks form data-parallel
replicas), the HF model (with the reward tokens added, so the vocabulary is
padded) is converted to Megatron at that TP, run on fixed token ids, and rank 0
records max |logits - HF logits| (gathered over TP for the comparison only),
the same for vocab-parallel logprobs and entropies, and for the training
path's ``vocab_parallel_cross_entropy``.
"""

import json
import sys

import torch

from nemo_rcgrpo.config_schema import MegatronConfig
from nemo_rcgrpo.models.hf import add_reward_tokens, load_model, load_tokenizer
from nemo_rcgrpo.models.megatron.builder import build_gpt, init_parallel, load_hf_state


def check(name: str, tp: int, dtype: torch.dtype) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_rcgrpo.models.megatron.logprobs import mask_padded_vocab, vocab_parallel_logprobs

    par = init_parallel(tp, 1, 1, seed=1)
    tok = load_tokenizer(name)
    hf = load_model(name, "float32").to(dtype).eval()
    add_reward_tokens(tok, hf, ("<|high_reward|>", "<|low_reward|>"))
    hf.config.vocab_size = hf.get_input_embeddings().weight.shape[0]
    model, shape, _ = build_gpt(hf.config, MegatronConfig(tp=tp), params_dtype=dtype)
    load_hf_state(model, hf.state_dict(), shape, par)
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab_size, (2, 40), generator=g)
    ids[:, 5] = shape.vocab_size - 1  # a reward token (the last real vocabulary rows)
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        local = model(ids, pos, None)  # [B, T, V_pad/tp]
        masked = mask_padded_vocab(local, shape.vocab_size, par.tp_rank)
        targets = torch.roll(ids, -1, dims=1)
        lp, ent = vocab_parallel_logprobs(masked, targets, par.tp_rank, ps.get_tensor_model_parallel_group(), True)
        ce = -tensor_parallel.vocab_parallel_cross_entropy(masked.clone(), targets)
        full = tensor_parallel.gather_from_tensor_model_parallel_region(local)[..., : shape.vocab_size]
        # the reference is HF's eager attention (matmul + softmax, as megatron's local spec); HF's own SDPA
        # kernel differs from it by up to ~5e-4 on SmolLM2's logits (recorded as hf_sdpa_vs_eager)
        sdpa = hf(input_ids=ids).logits.to(dtype)
        hf.set_attn_implementation("eager")
        ref = hf(input_ids=ids).logits.to(dtype)
        sdpa_floor = float((sdpa - ref).abs().max())
        ref_lp_all = ref.log_softmax(-1)
        ref_lp = ref_lp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ref_ent = -(ref_lp_all.exp() * ref_lp_all).sum(-1)
    grad_diff = gradient_diff(model, hf, ids, pos, targets, shape, par)
    return {
        "model": name,
        "tp": tp,
        "dtype": str(dtype).removeprefix("torch."),
        "dp": par.dp,
        "grad_rel_diff": grad_diff,
        "padded_vocab": local.shape[-1] * tp,
        "vocab": shape.vocab_size,
        "hf_sdpa_vs_eager": sdpa_floor,
        "logits_max_abs_diff": float((full - ref).abs().max()),
        "logprob_max_abs_diff": float((lp - ref_lp).abs().max()),
        "entropy_max_abs_diff": float((ent - ref_ent).abs().max()),
        "cross_entropy_max_abs_diff": float((ce - ref_lp).abs().max()),
    }


def gradient_diff(model, hf, ids, pos, targets, shape, par) -> float:
    """max |grad - HF grad| / max |HF grad| over every weight, after the mean token cross entropy's backward
    (Megatron: vocab-parallel; the TP-split gradients gathered and converted to HF names)."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from nemo_rcgrpo.models.megatron.convert import is_weight, megatron_param_to_hf, replicated_over_tp
    from nemo_rcgrpo.models.megatron.logprobs import mask_padded_vocab

    group = ps.get_tensor_model_parallel_group()
    local = mask_padded_vocab(model(ids, pos, None), shape.vocab_size, par.tp_rank)
    tensor_parallel.vocab_parallel_cross_entropy(local, targets).mean().backward()
    torch.nn.functional.cross_entropy(hf(input_ids=ids).logits.flatten(0, 1), targets.flatten()).backward()
    reference = {n: p.grad for n, p in hf.named_parameters()}
    worst, scale = 0.0, max(float(g.abs().max()) for g in reference.values())
    for name, param in model.named_parameters():
        if not is_weight(name):
            continue
        grads = [param.grad]
        if par.tp > 1 and not replicated_over_tp(name):
            grads = [torch.empty_like(param.grad) for _ in range(par.tp)]
            torch.distributed.all_gather(grads, param.grad.contiguous(), group=group)
        for hf_name, g in megatron_param_to_hf(name, grads, shape):
            worst = max(worst, float((g - reference[hf_name]).abs().max()))
    return worst / scale


def main() -> None:
    out, pairs = sys.argv[1], sys.argv[2:]
    results = []
    for pair in pairs:
        name, tp, *dtype = pair.split(":")
        results.append(check(name, int(tp), getattr(torch, dtype[0]) if dtype else torch.float32))
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
