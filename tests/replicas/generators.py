"""Replicas of published generator checkpoints: `write_generator(family, directory)`.

Each writer states which published checkpoint it copies and where the layout was read. The weights are
seeded random tensors saved with `safetensors.torch.save_file` under the published names and in the
published dtype; a transformers model class never writes them. The final norm is scaled up so
greedy decoding has clear winners.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.replicas import tokenizers as tk

HIDDEN = 64
INTERMEDIATE = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
SHARPEN = 8.0  # final-norm gain: logits an order of magnitude apart, so argmax ties never happen
# Small embeddings (as trained ones are): the layers' outputs, not the input token, steer the next
# token, so greedy decoding does not just repeat its input (what a tied head does otherwise).
EMBED_STD = 0.1


def generator(seed_name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(seed_name.encode()))


def decoder_tensors(name: str, *, vocab_size: int, head_dim: int, qkv_bias: bool = False,
                    qk_norm: bool = False, sandwich_norms: bool = False, norm_offset: float = 1.0,
                    final_gain: float = SHARPEN, query_gain: float = 1.0) -> dict[str, torch.Tensor]:
    """`model.*` tensors of a llama-family decoder, named as Hugging Face checkpoints name them.

    `norm_offset` is 1 where a norm multiplies by its weight and 0 for Gemma, whose RMSNorm multiplies
    by (1 + weight) and whose checkpoints hold weights around 0. `query_gain` scales the queries, so
    attention scores grow large enough for soft-capping to matter.
    """
    g = generator(name)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g) / in_features ** 0.5

    def norm(size: int, gain: float = 1.0) -> torch.Tensor:
        return gain - 1.0 + norm_offset + 0.1 * torch.randn(size, generator=g)

    tensors = {"model.embed_tokens.weight": EMBED_STD * torch.randn(vocab_size, HIDDEN, generator=g)}
    q_size, kv_size = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = query_gain * linear(q_size, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = linear(kv_size, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = linear(kv_size, HIDDEN)
        if qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = 0.1 * torch.randn(q_size, generator=g)
            tensors[p + "self_attn.k_proj.bias"] = 0.1 * torch.randn(kv_size, generator=g)
            tensors[p + "self_attn.v_proj.bias"] = 0.1 * torch.randn(kv_size, generator=g)
        tensors[p + "self_attn.o_proj.weight"] = linear(HIDDEN, q_size)
        if qk_norm:
            tensors[p + "self_attn.q_norm.weight"] = norm(head_dim)
            tensors[p + "self_attn.k_norm.weight"] = norm(head_dim)
        tensors[p + "mlp.gate_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = linear(INTERMEDIATE, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = linear(HIDDEN, INTERMEDIATE)
        tensors[p + "input_layernorm.weight"] = norm(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
        if sandwich_norms:
            tensors[p + "pre_feedforward_layernorm.weight"] = norm(HIDDEN)
            tensors[p + "post_feedforward_layernorm.weight"] = norm(HIDDEN)
    tensors["model.norm.weight"] = norm(HIDDEN, final_gain)
    return tensors


def lm_head(name: str, vocab_size: int) -> torch.Tensor:
    return EMBED_STD * torch.randn(vocab_size, HIDDEN, generator=generator(name + "/lm_head"))


def save_weights(directory: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype, *,
                 num_shards: int) -> None:
    """One `model.safetensors`, or `model-0000k-of-0000n.safetensors` shards with the index file
    transformers and vLLM read (`metadata.total_size`, `weight_map`), as published."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = list(tensors)
    per_shard = -(-len(keys) // num_shards)
    weight_map = {}
    for k in range(num_shards):
        name = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {key: tensors[key] for key in keys[k * per_shard:(k + 1) * per_shard]}
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_json(directory: Path, name: str, data: dict[str, Any]) -> None:
    (directory / name).write_text(json.dumps(data, indent=2))


def sizes(vocab_size: int, head_dim: int | None = None, **extra: Any) -> dict[str, Any]:
    """The size fields every family shares, shrunk."""
    fields = {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": NUM_LAYERS,
              "num_attention_heads": NUM_HEADS, "num_key_value_heads": NUM_KV_HEADS,
              "vocab_size": vocab_size}
    if head_dim is not None:
        fields["head_dim"] = head_dim
    fields.update(extra)
    return fields


def padded(n: int, multiple: int = 64) -> int:
    """Published Qwen embeddings have more rows than the tokenizer has tokens (151936 > 151665)."""
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------------------------
# Chat templates: the published templates' structure (turn markers, default system text, BOS
# handling, generation prompt), without the tool-calling branches.

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}{{- 'Today Date: 26 Jul 2024\\n\\n' }}"
    "{{- system_message }}{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def qwen_template(default_system: str | None, thinking: bool = False) -> str:
    first = ""
    if default_system is not None:
        first = ("{%- if messages[0]['role'] != 'system' %}"
                 "{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}{%- endif %}")
    prompt = "{{- '<|im_start|>assistant\\n' }}"
    if thinking:  # Qwen3: enable_thinking=False pre-fills an empty think block
        prompt += ("{%- if enable_thinking is defined and enable_thinking is false %}"
                   "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
    return (first + "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}" + prompt + "{%- endif %}")


MISTRAL_V3_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + eos_token }}"
    "{%- endif %}{%- endfor %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

LLAMA3_TOKENIZER = tk.TokenizerSpec(
    style="byte-level", tokenizer_class="PreTrainedTokenizerFast", bos="<|begin_of_text|>",
    eos="<|eot_id|>", trailing=tk.LLAMA3_SPECIALS, add_bos=True, chat_template=LLAMA3_TEMPLATE,
    extra_config={"model_input_names": ["input_ids", "attention_mask"]})


def qwen_tokenizer(specials: tuple[str, ...], template: str, *, eos: str = "<|im_end|>",
                   bos: str | None = None) -> tk.TokenizerSpec:
    return tk.TokenizerSpec(style="byte-level", tokenizer_class="Qwen2Tokenizer", bos=bos, eos=eos,
                            pad="<|endoftext|>", trailing=specials, chat_template=template,
                            model_max_length=131072, extra_config={"errors": "replace",
                                                                   "split_special_tokens": False})


def special_ids(directory: Path, *names: str) -> list[int]:
    ids = tk.token_ids(directory)
    return [ids[n] for n in names]


# ---------------------------------------------------------------------------------------------
# Writers


def write_llama3(directory: Path) -> Path:
    """meta-llama/Llama-3.2-1B-Instruct: tied embeddings (no lm_head tensor), llama3 rope scaling,
    explicit head_dim, one model.safetensors in bfloat16, eos a list of three ids.
    Sources: huggingface/transformers src/transformers/models/llama/modeling_llama.py (tensor names),
    src/transformers/modeling_rope_utils.py (`_compute_llama3_parameters`, the rope_scaling fields);
    vllm-project/vllm vllm/model_executor/models/llama.py (tied lm_head skipped on load)."""
    tk.write_tokenizer(LLAMA3_TOKENIZER, directory)
    bos, end, eom, eot = special_ids(directory, "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>",
                                     "<|eot_id|>")
    vocab = len(tk.token_ids(directory))
    config = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": bos, "eos_token_id": [end, eom, eot], "hidden_act": "silu",
              "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
              "model_type": "llama", "pretraining_tp": 1, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.45.0.dev0", "use_cache": True,
              **sizes(vocab, head_dim=HIDDEN // NUM_HEADS)}
    write_json(directory, "config.json", config)
    write_json(directory, "generation_config.json", {
        "bos_token_id": bos, "do_sample": True, "eos_token_id": [end, eom, eot], "temperature": 0.6,
        "top_p": 0.9, "transformers_version": "4.45.0.dev0"})
    save_weights(directory, decoder_tensors("llama3", vocab_size=vocab, head_dim=HIDDEN // NUM_HEADS),
                 torch.bfloat16, num_shards=1)
    return directory


def write_qwen25(directory: Path) -> Path:
    """Qwen/Qwen2.5-1.5B-Instruct: q/k/v projections with biases (o_proj without), tied embeddings,
    more embedding rows than tokens, sliding-window fields present but off, one model.safetensors.
    Sources: huggingface/transformers src/transformers/models/qwen2/modeling_qwen2.py (bias=True on
    q/k/v only); vllm-project/vllm vllm/model_executor/models/qwen2.py."""
    spec = qwen_tokenizer(tk.QWEN2_SPECIALS, qwen_template(
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."))
    tk.write_tokenizer(spec, directory)
    endoftext, im_end = special_ids(directory, "<|endoftext|>", "<|im_end|>")
    vocab = padded(len(tk.token_ids(directory)))
    config = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": endoftext,
              "eos_token_id": im_end, "hidden_act": "silu", "initializer_range": 0.02,
              "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.43.1",
              "use_cache": True, "use_sliding_window": False, **sizes(vocab)}
    write_json(directory, "config.json", config)
    write_json(directory, "generation_config.json", {
        "bos_token_id": endoftext, "pad_token_id": endoftext, "do_sample": True,
        "eos_token_id": [im_end, endoftext], "repetition_penalty": 1.1, "temperature": 0.7,
        "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"})
    save_weights(directory, decoder_tensors("qwen2.5", vocab_size=vocab, head_dim=HIDDEN // NUM_HEADS,
                                            qkv_bias=True), torch.bfloat16, num_shards=1)
    return directory


def write_qwen3(directory: Path) -> Path:
    """Qwen/Qwen3-0.6B: per-head RMSNorm on queries and keys (`q_norm`, `k_norm` [head_dim]), no
    biases, head_dim larger than hidden/heads (published 128 with 1024/16; here 32 with 64/4), tied.
    Sources: huggingface/transformers src/transformers/models/qwen3/modeling_qwen3.py;
    vllm-project/vllm vllm/model_executor/models/qwen3.py (q_norm/k_norm over head_dim)."""
    spec = qwen_tokenizer(tk.QWEN3_SPECIALS, qwen_template(None, thinking=True))
    tk.write_tokenizer(spec, directory)
    endoftext, im_end = special_ids(directory, "<|endoftext|>", "<|im_end|>")
    vocab = padded(len(tk.token_ids(directory)))
    head_dim = 2 * HIDDEN // NUM_HEADS
    config = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "bos_token_id": endoftext, "eos_token_id": im_end, "hidden_act": "silu",
              "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 28,
              "model_type": "qwen3", "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
              "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
              **sizes(vocab, head_dim=head_dim)}
    write_json(directory, "config.json", config)
    write_json(directory, "generation_config.json", {
        "bos_token_id": endoftext, "pad_token_id": endoftext, "do_sample": True,
        "eos_token_id": [im_end, endoftext], "temperature": 0.6, "top_k": 20, "top_p": 0.95,
        "transformers_version": "4.51.0"})
    save_weights(directory, decoder_tensors("qwen3", vocab_size=vocab, head_dim=head_dim, qk_norm=True),
                 torch.bfloat16, num_shards=1)
    return directory


def write_mistral(directory: Path) -> Path:
    """mistralai/Mistral-7B-Instruct-v0.3: untied `lm_head.weight`, sliding_window null, a
    SentencePiece vocabulary whose [INST]/[/INST] are control tokens 3/4, sharded (3 shards
    published; 2 here) with model.safetensors.index.json.
    Sources: huggingface/transformers src/transformers/models/mistral/modeling_mistral.py;
    vllm-project/vllm vllm/model_executor/models/llama.py (MistralForCausalLM maps to it)."""
    spec = tk.TokenizerSpec(style="sentencepiece", tokenizer_class="LlamaTokenizer", bos="<s>", eos="</s>",
                            unk="<unk>", leading=tk.MISTRAL_V3_SPECIALS, add_bos=True,
                            chat_template=MISTRAL_V3_TEMPLATE, model_max_length=1000000000000000019884624838656,
                            extra_config={"legacy": False, "spaces_between_special_tokens": False,
                                          "use_default_system_prompt": False})
    tk.write_tokenizer(spec, directory)
    vocab = len(tk.token_ids(directory))
    config = {"architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
              "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
              "max_position_embeddings": 32768, "model_type": "mistral", "rms_norm_eps": 1e-05,
              "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "transformers_version": "4.42.0.dev0", "use_cache": True,
              **sizes(vocab, head_dim=HIDDEN // NUM_HEADS)}
    write_json(directory, "config.json", config)
    write_json(directory, "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2,
                                                     "transformers_version": "4.42.0.dev0"})
    tensors = decoder_tensors("mistral", vocab_size=vocab, head_dim=HIDDEN // NUM_HEADS)
    tensors["lm_head.weight"] = lm_head("mistral", vocab)
    save_weights(directory, tensors, torch.bfloat16, num_shards=2)
    return directory


GEMMA2_SLIDING_WINDOW = 24  # published 4096: shrunk so a test's sequence outgrows it


def write_gemma2(directory: Path) -> Path:
    """google/gemma-2-2b-it: attention-logit (50) and final-logit (30) soft-capping, sandwich norms
    (pre/post feed-forward norms besides input/post-attention), RMSNorm weights applied as (1 + w),
    embeddings scaled by sqrt(hidden), gelu_pytorch_tanh, query_pre_attn_scalar, sliding window on
    alternate layers, tied embeddings (no tie field: the default), float32 weights in 2 shards.
    Sources: huggingface/transformers src/transformers/models/gemma2/modeling_gemma2.py and
    configuration_gemma2.py; vllm-project/vllm vllm/model_executor/models/gemma2.py."""
    spec = tk.TokenizerSpec(style="sentencepiece", tokenizer_class="GemmaTokenizer", bos="<bos>",
                            eos="<eos>", pad="<pad>", unk="<unk>", leading=tk.GEMMA_SPECIALS, add_bos=True,
                            add_prefix_space=False, chat_template=GEMMA_TEMPLATE,
                            model_max_length=1000000000000000019884624838656,
                            extra_config={"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"],
                                          "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
                                          "use_default_system_prompt": False})
    tk.write_tokenizer(spec, directory)
    vocab = len(tk.token_ids(directory))
    head_dim = HIDDEN // NUM_HEADS
    config = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
              "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "hidden_act": "gelu_pytorch_tanh",
              "hidden_activation": "gelu_pytorch_tanh", "initializer_range": 0.02,
              "max_position_embeddings": 8192, "model_type": "gemma2", "pad_token_id": 0,
              "query_pre_attn_scalar": head_dim, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
              "sliding_window": GEMMA2_SLIDING_WINDOW, "torch_dtype": "float32",
              "transformers_version": "4.42.4", "use_cache": True, **sizes(vocab, head_dim=head_dim)}
    write_json(directory, "config.json", config)
    write_json(directory, "generation_config.json", {"bos_token_id": 2, "cache_implementation": "hybrid",
                                                     "eos_token_id": [1, 107], "pad_token_id": 0,
                                                     "transformers_version": "4.42.4"})
    tensors = decoder_tensors("gemma2", vocab_size=vocab, head_dim=head_dim, sandwich_norms=True,
                              norm_offset=0.0, query_gain=16.0)
    save_weights(directory, tensors, torch.float32, num_shards=2)
    return directory


WRITERS = {"llama3": write_llama3, "qwen2.5": write_qwen25, "qwen3": write_qwen3,
           "mistral": write_mistral, "gemma2": write_gemma2}
GENERATOR_FAMILIES = tuple(WRITERS)


def write_generator(family: str, directory: Path) -> Path:
    """Write the replica of `family` (one of GENERATOR_FAMILIES) into `directory`; returns it."""
    if family not in WRITERS:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(GENERATOR_FAMILIES)}")
    return WRITERS[family](Path(directory))
