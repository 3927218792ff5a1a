"""Which lean decoder serves a model: Qwen3.5's text model (runtime.model.qwen35_layers) or the llama-family
one (runtime.model.decoder), None where transformers' forward must. A model has one, built once: the
generator's runner, the judge's and the row-padding probe share it (and its fused weights)."""

from __future__ import annotations

from torch import nn

from runtime.model.decoder import LeanDecoder
from runtime.model.qwen35_layers import HYBRID_ARCHITECTURES, HybridDecoder


def build_decoder(model: nn.Module) -> LeanDecoder | HybridDecoder | None:
    if getattr(getattr(model, "config", None), "model_type", None) not in HYBRID_ARCHITECTURES:
        return LeanDecoder.build(model)
    built = getattr(model, "_ponder_lean_decoder", None)
    if built is None:
        built = HybridDecoder.build(model)
        if built is not None:
            model._ponder_lean_decoder = built
    return built
