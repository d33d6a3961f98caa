import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_rcgrpo.models.hf import ModelFilesError, add_reward_tokens, load_model, load_tokenizer, resolve_model_path

TOKENS = ("<|high_reward|>", "<|low_reward|>")


@pytest.mark.parametrize("name, tied", [("tiny-llama", True), ("tiny-qwen2", False)])
def test_reward_tokens_are_single_ids_with_mean_rows(name, tied, tmp_path):
    tok, model = load_tokenizer(name), load_model(name)
    old = model.get_input_embeddings().weight.detach().clone()
    old_out = model.get_output_embeddings().weight.detach().clone()
    ids = add_reward_tokens(tok, model, TOKENS)
    assert ids == [len(tok) - 2, len(tok) - 1]
    for t, i in zip(TOKENS, ids):
        assert tok.encode(t, add_special_tokens=False) == [i]
        assert tok.encode(f"x {t} y", add_special_tokens=False).count(i) == 1
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == len(tok) and torch.allclose(emb[ids[0]], old.mean(0)) and torch.equal(emb[: len(old)], old)
    out = model.get_output_embeddings().weight
    assert (out.data_ptr() == emb.data_ptr()) == tied
    assert torch.allclose(out[ids[1]], old_out.mean(0))
    assert add_reward_tokens(tok, model, TOKENS) == ids  # idempotent
    # saved and reloaded as a plain HF folder, the tokens and rows are still there
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tok2, model2 = AutoTokenizer.from_pretrained(tmp_path), AutoModelForCausalLM.from_pretrained(tmp_path)
    assert tok2.encode(TOKENS[0], add_special_tokens=False) == [ids[0]]
    assert torch.equal(model2.get_input_embeddings().weight, emb.detach())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_reward_token_rows_are_the_mean_when_the_embedding_has_spare_rows(name):
    """Qwen2.5-7B has 152,064 rows for 151,665 tokens: new tokens land on existing (random) padding rows, which
    must be overwritten with the mean of the real vocabulary's rows, not kept."""
    tok, model = load_tokenizer(name), load_model(name)
    vocab = len(tok)
    model.resize_token_embeddings(vocab + 64, mean_resizing=False)  # 64 spare rows
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in {model.get_input_embeddings(), model.get_output_embeddings()}:
            layer.weight[vocab:] = torch.randn_like(layer.weight[vocab:])
    emb_before = model.get_input_embeddings().weight.detach().clone()
    out_before = model.get_output_embeddings().weight.detach().clone()
    ids = add_reward_tokens(tok, model, TOKENS)
    assert ids == [vocab, vocab + 1] and model.get_input_embeddings().weight.shape[0] == vocab + 64  # no growth
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    for i in ids:
        assert torch.allclose(emb[i], emb_before[:vocab].mean(0), atol=1e-7)  # the real tokens' mean
        assert torch.allclose(out[i], out_before[:vocab].mean(0), atol=1e-7)
    assert torch.equal(emb[:vocab], emb_before[:vocab]) and torch.equal(emb[vocab + 2 :], emb_before[vocab + 2 :])


def test_model_names_and_errors(tmp_path):
    with pytest.raises(ModelFilesError, match="not a local HF folder"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelFilesError, match="unknown tiny model"):
        from nemo_rcgrpo.models.hf import tiny_model_dir

        tiny_model_dir("tiny-gpt")
    cfg = load_model("tiny-qwen2").config
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads) == ("qwen2", 4, 2)


@pytest.mark.slow
def test_smollm2_from_the_wheel(tmp_path):
    model = load_model("smollm2")
    model.save_pretrained(tmp_path / "export")  # a plain HF model (no GGUF quantisation record)
    assert "quantization_config" not in (tmp_path / "export" / "config.json").read_text()
    cfg = model.config
    assert (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
        cfg.tie_word_embeddings,
    ) == (30, 576, 9, 3, 49152, True)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    tok = load_tokenizer("smollm2")
    ids = tok("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    # greedy, so one answer: the de-quantised weights must make the instruct model answer, not just emit tokens
    assert tok.decode(out[0, ids.shape[1] :]) == "The answer is 4."
