"""Which code computes each part of a step, said at start-up and shown by `/v1/models` (`paths`).

- `family`: the architecture (transformers' `model_type` of the text model, runtime.model.families);
- `layers`: `lean` (ponder's lean decoder, runtime.model.decoder: transformers' arithmetic with fused
  projections), `int_kernel` or `float_kernel` (the lean decoder, whose decode-only steps run the whole
  layer stack as one call of ponder's int4 or float kernel), or `transformers` (transformers' own
  forward, ponder's paged attention plugged into its attention registry);
- `linear`: `int4_kernel`, `int8` (torch's int8 matmul), `float_kernel` (ponder's float kernel),
  `triton_blocks` (a GGUF's own blocks on a GPU in ponder's Triton block GEMM, runtime.model.gpu_blocks)
  or `torch` (torch's matmul): what computes the projections;
- `attention`: `cpu_kernel` (ponder's CPU decode attention kernel, prompts prefilled by SDPA) or `torch`
  (ponder's paged attention in torch: batched matmuls per window, SDPA or plain arithmetic for prompts);
- `recurrent`, for a model with linear-attention layers (runtime.model.recurrent): `cpu_kernel` (ponder's
  Gated DeltaNet kernel), `triton` (its Triton twin, on a GPU) or `torch` (the same recurrent form,
  token by token in torch).
"""

from __future__ import annotations

from runtime.model import families

_LINEAR = {"int4": "int4_kernel", "int8": "int8", "float": "float_kernel", "gpu_blocks": "triton_blocks", "none": "torch"}


def step_paths(model, decoder, attention_kernel, quantize_mode: str, recurrent=None) -> dict[str, str]:
    """The paths of a model served by a runner whose lean decoder is `decoder` (None: transformers'
    forward) and whose decode attention kernel is `attention_kernel` (None: torch), its linear layers as
    `quantize_mode` (runtime.model.quantize.Quantized.mode) made them."""
    if decoder is None:
        layers = "transformers"
    elif decoder.gpu is not None:
        layers = "triton"
    elif decoder.stack is not None:
        layers = "int_kernel" if decoder.int4 else "float_kernel"
    else:
        layers = "lean"
    paths = {"family": families.family(model.config), "layers": layers,
             "linear": _LINEAR.get(quantize_mode, quantize_mode),
             "attention": "torch" if attention_kernel is None else _kernel(attention_kernel)}
    if recurrent is not None:
        paths["recurrent"] = "torch" if recurrent.kernel is None else _kernel(recurrent.kernel)
    return paths


def _kernel(kernel) -> str:
    """`triton` for one of ponder's Triton kernels (runtime/kernels/gpu), else `cpu_kernel`."""
    return "triton" if getattr(kernel, "__module__", "").startswith("runtime.kernels.gpu") else "cpu_kernel"


def describe(paths: dict[str, str]) -> str:
    """One log line's worth: `family llama: layers lean, linear torch, attention cpu_kernel`."""
    rest = ", ".join(f"{part} {path}" for part, path in paths.items() if part != "family")
    return f"family {paths.get('family', 'unknown')}: {rest}"
