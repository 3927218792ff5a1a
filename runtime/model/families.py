"""Which architectures ponder serves exactly, decided from the model's config before anything loads.

ponder runs every decoder through transformers' modules (or its lean decoder, runtime.model.decoder),
with its own paged attention in transformers' attention registry (runtime.model.attention). That is
exact only where all of a layer's state across tokens is the keys and values its attention function
is given. `lacks(config)` names what a config needs that ponder does not hold; a model needing any of
it is refused at start-up in one line (runtime.preflight), never served wrong.
"""

from __future__ import annotations

# The layer kinds ponder's paged attention runs (transformers' `config.layer_types` entries).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Families whose recurrent layers ponder holds the state of, beside the paged KV: their
# `linear_attention` (Gated DeltaNet) layers run in runtime.model.recurrent.
RECURRENT_SERVED: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

_GATED_DELTANET = "Gated DeltaNet linear-attention layers keep a recurrent state ponder does not hold"
_MAMBA = "Mamba layers keep a recurrent state ponder does not hold"
# What a family's `linear_attention` layers are (transformers names Mamba layers so too).
_LINEAR_ATTENTION = {"qwen3_next": _GATED_DELTANET, "qwen3_5": _GATED_DELTANET, "qwen3_5_moe": _GATED_DELTANET,
                     "minimax": "lightning-attention layers keep a recurrent state ponder does not hold"}
# Other layer kinds whose state is not keys and values, in the refusal's words.
_LAYER_STATE = {
    "mamba": _MAMBA,
    "conv": "short-convolution layers keep a convolution state ponder does not hold",
    "recurrent": "recurrent layers keep a state ponder does not hold",
    "chunked_attention": "chunked-attention layers attend within chunks, which ponder's paged attention does not",
}
# Families whose layers keep state outside the attention interface where `layer_types` does not say so.
_FAMILY_STATE = {
    "mamba": _MAMBA, "falcon_mamba": _MAMBA, "jamba": _MAMBA, "zamba": _MAMBA,
    "mamba2": "Mamba-2 layers keep a recurrent state ponder does not hold",
    "falcon_h1": "Mamba-2 layers keep a recurrent state ponder does not hold",
    "recurrent_gemma": "RG-LRU recurrent layers keep a state ponder does not hold",
    "rwkv": "RWKV layers keep a recurrent state ponder does not hold",
    "xlstm": "xLSTM layers keep a recurrent state ponder does not hold",
}


def family(config) -> str:
    """The model's family: transformers' `model_type` of its text model, without a `_text` suffix
    (`gemma3_text` is Gemma 3's text model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None) or "unknown"
    return model_type.removesuffix("_text")


def lacks(config) -> list[str]:
    """What `config` (a transformers config, or a multimodal one's) needs that ponder lacks, each a
    phrase; empty when ponder serves it exactly."""
    model_type = family(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    missing = []
    layer_types = list(getattr(text, "layer_types", None) or ())
    for kind in dict.fromkeys(layer_types):
        if kind in SERVED_LAYER_TYPES or (kind == "linear_attention" and model_type in RECURRENT_SERVED):
            continue
        if kind == "linear_attention":
            missing.append(_LINEAR_ATTENTION.get(model_type) or _FAMILY_STATE.get(model_type)
                           or "linear-attention layers keep a recurrent state ponder does not hold")
        else:
            missing.append(_LAYER_STATE.get(kind, f"{kind!r} layers, which ponder's paged attention does not run"))
    state = _FAMILY_STATE.get(model_type)
    if state is not None and state not in missing:
        missing.append(state)
    if getattr(text, "use_bidirectional_attention", None) in ("all", True):
        missing.append("bidirectional attention, where ponder's paged attention is causal")
    return missing


def refusal(config, path: str) -> str | None:
    """The one line refusing the model at `path`, or None when ponder serves it exactly."""
    missing = lacks(config)
    if not missing:
        return None
    return f"{path}: {family(config)}: {'; '.join(missing)}; ponder refuses it rather than serve wrong tokens"


def stateful_modules(model) -> list[str]:
    """The classes of the loaded decoder's modules that carry state across tokens outside its attention:
    those holding a `torch.nn.Conv1d` (a causal convolution keeps its last inputs; every Mamba, Gated
    DeltaNet and short-convolution layer has one), which catches a family the config tables above do
    not name (remote code included). Empty for a family ponder holds the recurrent state of."""
    import torch

    if family(model.config) in RECURRENT_SERVED:
        return []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    owners = []
    for module in decoder.modules():
        if any(isinstance(child, torch.nn.Conv1d) for child in module.children()):
            owners.append(type(module).__name__)
    return list(dict.fromkeys(owners))


class UnsupportedModel(RuntimeError):
    """A model ponder cannot run exactly (`refusal`); the message is one line naming what it lacks."""


def check(config, path: str) -> None:
    """Raise `UnsupportedModel` for a model ponder cannot run exactly."""
    line = refusal(config, path)
    if line is not None:
        raise UnsupportedModel(line)


def check_loaded(model, path: str) -> None:
    """`check` on the loaded model: its config, then its modules (`stateful_modules`)."""
    check(model.config, path)
    owners = stateful_modules(model)
    if owners:
        raise UnsupportedModel(f"{path}: {family(model.config)}: its {', '.join(owners)} layers keep a convolution "
                               "state across tokens that ponder does not hold; ponder refuses it rather than serve "
                               "wrong tokens")
