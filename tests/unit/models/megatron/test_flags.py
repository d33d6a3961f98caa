"""The Megatron backend's device-dependent choices (``models/megatron/flags.py``), GPU cases included, on CPU.

Pure: nothing here imports megatron. Building and stepping a model with the GPU flags is in
tests/megatron/test_megatron_model.py."""

import pytest

from nemo_rcgrpo.config_schema import MegatronConfig
from nemo_rcgrpo.models.megatron.flags import FlagError, Platform, decide, padded_length

CPU = Platform(cuda=False)
BARE_GPU = Platform(cuda=True, compiles=True)  # the minimal GPU machine: no Transformer Engine, no apex
NO_COMPILER = Platform(cuda=True)  # torch.compile cannot build kernels here (no Triton or no C compiler)
NGC = Platform(cuda=True, transformer_engine=True, apex_softmax=True, apex_grad_accum=True, compiles=True)
TE_ONLY = Platform(cuda=True, transformer_engine=True, compiles=True)


def test_layer_norm_persistence_is_never_requested():
    # local spec RMSNorm is megatron's WrappedTorchNorm, which asserts persist_layer_norm is off
    for platform in (CPU, BARE_GPU, NGC, TE_ONLY):
        assert decide(platform, MegatronConfig()).transformer["persist_layer_norm"] is False


def test_fused_kernels_only_where_they_import():
    bare = decide(BARE_GPU, MegatronConfig()).transformer
    assert bare["masked_softmax_fusion"] is False  # apex's scaled_masked_softmax_cuda is absent
    assert bare["gradient_accumulation_fusion"] is False  # apex's fused_weight_gradient_mlp_cuda is absent
    assert bare["apply_rope_fusion"] is False  # Transformer Engine's fused RoPE is absent
    ngc = decide(NGC, MegatronConfig()).transformer
    assert ngc["masked_softmax_fusion"] and ngc["gradient_accumulation_fusion"] and ngc["apply_rope_fusion"]
    te = decide(TE_ONLY, MegatronConfig()).transformer
    assert te["apply_rope_fusion"] and not te["gradient_accumulation_fusion"] and not te["masked_softmax_fusion"]
    cpu = decide(CPU, MegatronConfig()).transformer
    assert not (cpu["masked_softmax_fusion"] or cpu["gradient_accumulation_fusion"] or cpu["apply_rope_fusion"])
    # megatron's jit_fuser is torch.compile: on a GPU where it can build kernels, never on CPU (test cost)
    for flag in ("bias_activation_fusion", "bias_dropout_fusion"):
        assert bare[flag] and ngc[flag] and not cpu[flag]
        assert not decide(NO_COMPILER, MegatronConfig()).transformer[flag]
    assert cpu["use_cpu_initialization"] is True and bare["use_cpu_initialization"] is False


def test_no_gloo_side_groups_anywhere():
    # get_megatron_optimizer's default use_gloo_process_groups=True fails where the groups were not created
    for platform in (CPU, BARE_GPU, NGC):
        flags = decide(platform, MegatronConfig())
        assert flags.parallel == {"create_gloo_process_groups": False}
        assert flags.optimizer == {"use_gloo_process_groups": False}


def test_spec_choice():
    assert decide(CPU, MegatronConfig()).spec == "local"
    assert decide(BARE_GPU, MegatronConfig()).spec == "local"
    assert decide(TE_ONLY, MegatronConfig()).spec == "te"  # auto: TE's flash / fused attention in bf16 too
    assert decide(TE_ONLY, MegatronConfig(spec="local")).spec == "local"
    with pytest.raises(FlagError, match="spec=te needs Transformer Engine"):
        decide(BARE_GPU, MegatronConfig(spec="te"))
    with pytest.raises(FlagError, match="spec"):
        decide(CPU, MegatronConfig(spec="fast"))


def test_fp8_needs_te_and_pads_tokens_to_16():
    with pytest.raises(FlagError, match="Transformer Engine"):
        decide(BARE_GPU, MegatronConfig(fp8="hybrid"))
    with pytest.raises(FlagError, match="spec=auto"):
        decide(NGC, MegatronConfig(fp8="hybrid", spec="local"))
    flags = decide(NGC, MegatronConfig(fp8="hybrid"))
    assert flags.spec == "te" and flags.transformer["fp8"] == "hybrid" and flags.token_multiple == 16
    assert decide(NGC, MegatronConfig()).token_multiple == 1


def test_sequence_parallel_with_te_and_tp():
    assert decide(NGC, MegatronConfig(tp=2)).transformer["sequence_parallel"] is True  # null: on with TE at tp > 1
    assert decide(NGC, MegatronConfig(tp=2)).token_multiple == 2
    assert decide(NGC, MegatronConfig(tp=1)).transformer["sequence_parallel"] is False
    assert decide(NGC, MegatronConfig(tp=2, sequence_parallel=False)).transformer["sequence_parallel"] is False
    assert decide(BARE_GPU, MegatronConfig(tp=2)).transformer["sequence_parallel"] is False
    with pytest.raises(FlagError, match="sequence_parallel=true needs the Transformer Engine spec"):
        decide(BARE_GPU, MegatronConfig(tp=2, sequence_parallel=True))
    # FP8 and sequence parallel together: every TP rank's slice of the sequence a multiple of 16
    assert decide(NGC, MegatronConfig(tp=3, fp8="e4m3")).token_multiple == 48
    assert decide(NGC, MegatronConfig(tp=4, fp8="e4m3")).token_multiple == 64
    assert decide(NGC, MegatronConfig(tp=8, fp8="hybrid")).token_multiple == 128


def test_overlapped_gradient_reduction_with_several_replicas():
    for platform in (CPU, NGC):
        assert decide(platform, MegatronConfig(), dp=1).ddp["overlap_grad_reduce"] is False
        assert decide(platform, MegatronConfig(), dp=4).ddp["overlap_grad_reduce"] is True
    ddp = decide(NGC, MegatronConfig(distributed_optimizer=False, grad_reduce_in_fp32=False)).ddp
    assert ddp["use_distributed_optimizer"] is False and ddp["grad_reduce_in_fp32"] is False


def test_recompute_settings():
    assert "recompute_granularity" not in decide(CPU, MegatronConfig()).transformer
    assert decide(CPU, MegatronConfig(recompute="selective")).transformer["recompute_granularity"] == "selective"
    full = decide(CPU, MegatronConfig(recompute="full")).transformer
    assert (full["recompute_granularity"], full["recompute_method"], full["recompute_num_layers"]) == (
        "full",
        "uniform",
        1,
    )


def test_padded_length():
    assert [padded_length(n, 16) for n in (1, 16, 17, 33)] == [16, 16, 32, 48]
    assert padded_length(7, 1) == 7


def test_micro_batches_padded_for_pipelines_and_fp8():
    import torch

    from nemo_rcgrpo.data.batch import RLMicroBatch
    from nemo_rcgrpo.models.megatron.policy import pad_micro_batches

    def batch(rows, length):
        ids = torch.arange(1, rows * length + 1).view(rows, length)
        return RLMicroBatch(
            ids,
            torch.ones_like(ids),
            torch.ones_like(ids),
            advantages=torch.ones(rows),
            ref_logprobs=torch.zeros(rows, length),
            sampler_logprobs=torch.zeros(rows, length),
            first=3,
        )

    a, b = batch(2, 5), batch(3, 17)
    # FP8 at PP=1: each micro-batch's length to a multiple of 16, rows untouched
    pa, pb = pad_micro_batches([a, b], same_shape=False, multiple=16)
    assert pa.input_ids.shape == (2, 16) and pb.input_ids.shape == (3, 32)
    assert torch.equal(pa.input_ids[:, :5], a.input_ids) and int(pa.input_ids[:, 5:].abs().sum()) == 0
    assert int(pa.loss_mask.sum()) == 10 and pa.advantages.shape == (2,) and pa.first == 3
    # pipeline stages: one shape for all, and with FP8 that shape's length a multiple of 16
    qa, qb = pad_micro_batches([a, b], same_shape=True, multiple=16)
    assert qa.input_ids.shape == qb.input_ids.shape == (3, 32) and qa.ref_logprobs.shape == (3, 32)
    assert qa.advantages.shape == (3,) and float(qa.advantages[2]) == 0.0 and int(qa.loss_mask.sum()) == 10
    assert pad_micro_batches([a, b])[0].input_ids.shape == (3, 17)


def test_detect_on_this_machine():
    here = Platform.detect()
    assert here.cuda is False and here.transformer_engine is False and here.apex_softmax is False  # CPU test machine
    assert decide(here, MegatronConfig()).spec == "local"


def test_flat_rows_only_where_an_explicit_mask_is_used():
    # the local spec's unfused softmax takes the flat row's mask; the fused causal kernel (apex) would ignore it
    cpu = decide(CPU, MegatronConfig())
    assert cpu.flat_rows and cpu.flat_rows_off == ""
    for platform in (BARE_GPU, NGC, TE_ONLY):
        flags = decide(platform, MegatronConfig())
        assert not flags.flat_rows and flags.flat_rows_off, platform
    assert "Transformer Engine" in decide(NGC, MegatronConfig()).flat_rows_off
    assert "dense" in decide(BARE_GPU, MegatronConfig(spec="local")).flat_rows_off
    cp = decide(CPU, MegatronConfig(cp=2))
    assert not cp.flat_rows and "context parallel" in cp.flat_rows_off
