"""A GGUF's config read from its own metadata as llama.cpp reads it (runtime.model.gguf_config): the
config transformers' mapping gives where that mapping is right, the file's shapes where it is not, and
the tokens of the transformers model the file was written from."""

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from runtime.model.cached_model import gguf_config
from runtime.model.gguf_config import MODEL_TYPES, Metadata, config_from_gguf
from runtime.model.loader import resolve_model
from tests.gguf_model import write_tiny_gguf
from tests.gguf_writer import write_gguf_of
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)


# (transformers has no GGUF mapping for Qwen3.5, nor one for llama.cpp's gpt-oss tensors:
# tests/runtime/model/test_gguf_qwen35.py and test_gguf_gpt_oss.py hold their configs to the replicas')
@pytest.mark.parametrize("arch", sorted(set(MODEL_TYPES) - {"qwen35", "qwen35moe", "gpt-oss"}))
def test_the_config_is_transformers_own_where_its_mapping_is_right(tmp_path, arch):
    path = write_tiny_gguf(tmp_path, "Q4_1", arch=arch)
    theirs = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).to_dict()
    ours = config_from_gguf(str(path), str(tmp_path)).to_dict()
    # Qwen2Config has no head_dim field (its modeling code takes hidden / heads, as the file says);
    # Qwen3Config's is 128 unless given: the file says 16 (tested below with a file of its own)
    assert ours.pop("head_dim") == 16 and theirs.pop("head_dim", None) in (None, 16, 128)
    assert ours == theirs


def test_the_header_is_read_without_its_vocabulary(tmp_path):
    meta = Metadata(str(write_tiny_gguf(tmp_path, "Q4_1", arch="qwen3", head_dim=32)))
    assert meta.architecture == "qwen3" and meta.num_tokens == 96
    assert meta.get("attention.key_length") == 32 and meta.get("block_count") == 2
    assert meta.shapes["blk.1.attn_q.weight"] == (128, 64) and meta.shapes["output_norm.weight"] == (64,)


def serves_transformers_tokens(model, path) -> None:
    engine = engine_for(path)  # batch-invariant
    prompts = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[str(i)]["choices"][0] == hf_greedy(model, prompt, 10)
    return engine


def test_a_qwen3_file_whose_head_size_is_its_own_serves_the_tokens_of_the_model_it_was_written_from(tmp_path):
    # transformers' mapping ignores qwen3.attention.key_length: Qwen3Config's 128 instead of the file's 32
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **SIZES)).eval()
    path = write_gguf_of(model, tmp_path / "qwen3-f32.gguf")
    assert AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).head_dim == 128
    config = gguf_config(resolve_model(str(path)))
    assert config.model_type == "qwen3" and config.head_dim == 32
    engine = serves_transformers_tokens(model, path)
    assert engine.runner.decoder.head_dim == 32 and engine.model.model.layers[0].self_attn.q_proj.out_features == 128


def test_a_llama_file_with_biases_serves_the_tokens_of_the_model_it_was_written_from(tmp_path):
    # transformers' mapping leaves attention_bias and mlp_bias unset: the file's biases would be dropped
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **SIZES)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    path = write_gguf_of(model, tmp_path / "llama-bias-f32.gguf")
    assert not AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name).attention_bias
    config = gguf_config(resolve_model(str(path)))
    assert config.attention_bias and config.mlp_bias
    serves_transformers_tokens(model, path)
