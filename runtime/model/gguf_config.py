"""A GGUF's model config built from the file's own metadata, as llama.cpp reads it (its llama-model.cpp
`load_hparams`), not through transformers' GGUF config mapping, which ignores keys a family needs
(`attention.key_length`: a Qwen3 file whose head size is not 128 gets 128) and refuses families it has
no table for.

`MODEL_TYPES` names the architectures read here (llama.cpp's `general.architecture` -> transformers'
`model_type`); each reads the `FIELDS` every decoder has, then its own step in `_FAMILY_STEPS` (a
function of the metadata and the tensor names that adds or changes config fields). A new family is
one line in `MODEL_TYPES` and, where it has fields of its own, one function. Files of any other
architecture keep transformers' reading (runtime.model.loader).
"""

from __future__ import annotations

from typing import Callable

# llama.cpp's architecture -> transformers' model_type
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen35": "qwen3_5_text",
               "qwen35moe": "qwen3_5_moe_text", "gpt-oss": "gpt_oss"}

# `{arch}.KEY` -> the config field it gives (llama.cpp's LLM_KV names)
FIELDS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
}
TOKEN_IDS = {"tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
             "tokenizer.ggml.padding_token_id": "pad_token_id"}


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LONG_ARRAY = 4096  # an array longer than this (a vocabulary, its merges) is skipped, its length kept


class Metadata:
    """The file's key/value fields (as Python values; a long array as its length) and its tensors'
    shapes ([out, in]), read from its header without reading any tensor. (gguf's GGUFReader makes a
    numpy object of every token of the vocabulary: 128 MB for SmolLM2's 49152, and seconds.)"""

    def __init__(self, path: str) -> None:
        import struct

        with open(path, "rb") as file:
            def scalar(kind):
                fmt = _SCALARS[kind]
                return struct.unpack(fmt, file.read(struct.calcsize(fmt)))[0]

            def string():
                return file.read(scalar(10)).decode("utf-8", errors="replace")

            def value(kind):
                if kind == _STRING:
                    return string()
                if kind != _ARRAY:
                    return scalar(kind)
                item, count = scalar(4), scalar(10)
                if count <= _LONG_ARRAY:
                    return [value(item) for _ in range(count)]
                if item == _STRING:
                    for _ in range(count):
                        file.seek(scalar(10), 1)
                elif item == _ARRAY:
                    raise ValueError("a long array of arrays in the GGUF header")
                else:
                    file.seek(count * struct.calcsize(_SCALARS[item]), 1)
                return LongArray(count)

            if file.read(4) != b"GGUF":
                raise ValueError(f"{path} is not a GGUF file")
            scalar(4)  # the format's version
            num_tensors, num_fields = scalar(10), scalar(10)
            self.values = {}
            for _ in range(num_fields):
                key = string()
                self.values[key] = value(scalar(4))
            self.shapes = {}
            for _ in range(num_tensors):
                name = string()
                dims = [scalar(10) for _ in range(scalar(4))]
                scalar(4), scalar(10)  # type, offset
                self.shapes[name] = tuple(reversed(dims))
        self.architecture = self.values.get("general.architecture")
        tokens = self.values.get("tokenizer.ggml.tokens")
        self.num_tokens = None if tokens is None else len(tokens)

    def get(self, key: str, default=None):
        """`{arch}.key`'s value."""
        return self.values.get(f"{self.architecture}.{key}", default)


class LongArray:
    """A long array of the header, unread: its length."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count


def read_field(path: str, key: str):
    """One metadata field's value (None where the file has none)."""
    return Metadata(path).values.get(key)


def _llama_biases(meta: Metadata, fields: dict) -> None:
    fields["attention_bias"] = "blk.0.attn_q.bias" in meta.shapes
    fields["mlp_bias"] = "blk.0.ffn_gate.bias" in meta.shapes


def _qwen3_biases(meta: Metadata, fields: dict) -> None:
    fields["attention_bias"] = "blk.0.attn_q.bias" in meta.shapes


def _qwen35(meta: Metadata, fields: dict) -> None:
    """Qwen3.5's keys as llama.cpp's qwen35 / qwen35moe `load_arch_hparams` reads them: the Gated
    DeltaNet's sizes from `ssm.*` (one head size for keys and values: `state_size`; the value width
    `inner_size`), which layers are recurrent (`attention.recurrent_layers`, else every layer but each
    `full_attention_interval`-th), the partial interleaved mrope (`rope.dimension_count` of the head,
    `rope.dimension_sections`); multi-token-prediction blocks (`nextn_predict_layers`, counted in
    `block_count`) are not served."""
    layers = fields["num_hidden_layers"] = fields["num_hidden_layers"] - meta.get("nextn_predict_layers", 0)
    value_heads = meta.get("ssm.time_step_rank")
    fields.update(linear_conv_kernel_dim=meta.get("ssm.conv_kernel"), linear_key_head_dim=meta.get("ssm.state_size"),
                  linear_num_key_heads=meta.get("ssm.group_count"), linear_num_value_heads=value_heads,
                  linear_value_head_dim=meta.get("ssm.inner_size") // value_heads)
    recurrent = meta.get("attention.recurrent_layers")
    if recurrent is None:
        interval = meta.get("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    fields["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    rotary = meta.get("rope.dimension_count", fields["head_dim"] // 4)
    sections = list(meta.get("rope.dimension_sections") or [11, 11, 10, 0])  # (the converter's default)
    rope = fields.get("rope_parameters") or {"rope_type": "default", "rope_theta": fields.pop("rope_theta", 10000000.0)}
    fields["rope_parameters"] = {**rope, "partial_rotary_factor": rotary / fields["head_dim"], "mrope_interleaved": True,
                                 "mrope_section": sections[:3]}
    for key, name in (("expert_count", "num_experts"), ("expert_used_count", "num_experts_per_tok"),
                      ("expert_feed_forward_length", "moe_intermediate_size"),
                      ("expert_shared_feed_forward_length", "shared_expert_intermediate_size")):
        if meta.get(key) is not None:
            fields[name] = meta.get(key)


def _gpt_oss(meta: Metadata, fields: dict) -> None:
    """gpt-oss's keys as llama.cpp's openai-moe `load_arch_hparams` reads them: the experts' width
    (`expert_feed_forward_length`), the sliding window on the layers `attention.sliding_window_pattern`
    names (an array of a flag a layer, or a period n: layer i slides where i % n < n - 1; 2 where absent,
    so the even layers slide), one rope base for both kinds of layer. The yarn rotary is the file's
    `rope.scaling.*`, untruncated as gpt-oss's own config has it (the file does not say), and no scaling
    where the file has none."""
    layers = fields["num_hidden_layers"]
    fields.update(num_local_experts=meta.get("expert_count"), num_experts_per_tok=meta.get("expert_used_count"),
                  attention_bias="blk.0.attn_q.bias" in meta.shapes)
    if meta.get("expert_feed_forward_length") is not None:
        fields["intermediate_size"] = meta.get("expert_feed_forward_length")
    pattern = meta.get("attention.sliding_window_pattern", 2)
    sliding = list(pattern)[:layers] if isinstance(pattern, list) else \
        [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    fields["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
    fields.pop("use_sliding_window", None)
    rope = fields.get("rope_parameters")
    if rope is None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta", 150000.0)}
    elif rope["rope_type"] == "yarn":
        rope["truncate"] = False


_FAMILY_STEPS: dict[str, Callable[[Metadata, dict], None]] = {"llama": _llama_biases, "qwen3": _qwen3_biases,
                                                              "qwen3_5_text": _qwen35, "qwen3_5_moe_text": _qwen35,
                                                              "gpt_oss": _gpt_oss}


def _rope_scaling(meta: Metadata, fields: dict) -> None:
    """llama.cpp's `rope.scaling.*` as transformers' rope parameters (linear and YaRN)."""
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return
    parameters = {"rope_type": kind, "rope_theta": fields.get("rope_theta", 10000.0),
                  "factor": float(meta.get("rope.scaling.factor", 1.0))}
    if meta.get("rope.scaling.original_context_length") is not None:
        parameters["original_max_position_embeddings"] = int(meta.get("rope.scaling.original_context_length"))
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                      ("yarn_attn_factor", "attention_factor")):
        if meta.get(f"rope.scaling.{key}") is not None:
            parameters[name] = float(meta.get(f"rope.scaling.{key}"))
    fields["rope_parameters"] = parameters
    fields.pop("rope_theta", None)


def config_fields(meta: Metadata) -> dict:
    """The config's fields (transformers' names) the file's metadata gives, for an architecture in MODEL_TYPES."""
    fields: dict = {"model_type": MODEL_TYPES[meta.architecture]}
    for key, name in FIELDS.items():
        value = meta.get(key)
        if value is not None:
            fields[name] = value
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    # llama.cpp's head size without key_length: the width over the heads (Qwen3Config's default is 128)
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    if "sliding_window" in fields:
        fields["use_sliding_window"] = True
    embedding = meta.shapes.get("token_embd.weight")
    fields["vocab_size"] = meta.get("vocab_size") or (embedding[0] if embedding else meta.num_tokens)
    fields["tie_word_embeddings"] = "output.weight" not in meta.shapes
    for key, name in TOKEN_IDS.items():
        if key in meta.values:
            fields[name] = meta.values[key]
    _rope_scaling(meta, fields)
    step = _FAMILY_STEPS.get(fields["model_type"])
    if step is not None:
        step(meta, fields)
    return fields


def config_from_gguf(path: str, name_or_path: str = ""):
    """The transformers config of the GGUF at `path` from its own metadata, or None where its
    architecture is not one of MODEL_TYPES."""
    from transformers import AutoConfig

    meta = Metadata(path)
    if meta.architecture not in MODEL_TYPES:
        return None
    fields = config_fields(meta)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._name_or_path = name_or_path
    return config
