"""The device check's models of random 4-bit blocks made on the device (bench/gpu.py), each against the limit
of the bytes a step reads:

- `llama_8b_q4_blocks`: the 8B-shaped llama, every linear layer in Q4_K's form;
- `qwen3_moe_q4_blocks`: Qwen3-30B-A3B's shapes, its experts stacked for the routed Triton kernels
  (runtime.model.gpu_experts) as a Q4_K file's are on a GPU, decoded through the Triton loop and its
  CUDA graphs like the dense models; a step reads every weight but the experts, and of each layer's
  experts those its tokens are routed to. The float skeleton is built on the meta device, so the 61 GB
  of bfloat16 experts it describes are never made.
"""

from __future__ import annotations

import torch
from torch import nn

from bench.gpu_models import EIGHT_B, empty_cache, random_llama, random_q4, random_q4_blocks

# Qwen/Qwen3-30B-A3B's published config (transformers' Qwen3MoeConfig fields); every layer routed
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY_MOE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, max_position_embeddings=512)  # --dry-run's stand-in


def random_stack(experts: int, outs: int, ins: int, device: torch.device):
    """`StackedBlocks` of random 4-bit blocks (bench.gpu_models.random_q4) an expert a slice, and a
    `GpuBlockLinear` an expert over its slice."""
    from runtime.kernels.gpu.routed import StackedBlocks
    from runtime.model.gpu_blocks import GpuBlockLinear

    codes, sub, m, d_super, m_super = random_q4(outs, ins, device, (experts,))
    layers = [GpuBlockLinear(codes[e], sub[e], m[e], packed=True, d_super=d_super[e], m_super=m_super[e])
              for e in range(experts)]
    return StackedBlocks(codes, sub, m, True, d_super, m_super), layers


def random_moe_q4(device: torch.device, shapes: dict = QWEN3_30B_A3B, dtype: torch.dtype = torch.bfloat16):
    """A Qwen3-MoE of `shapes` on `device`: every linear layer (the head too) and every expert random 4-bit
    blocks, each layer's experts stacked (`GpuExperts`), its router random float weights in the Triton
    float GEMV; embeddings random, norms ones. Returns (model, the experts' bytes)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from runtime.model.experts import KernelRouter, Routing
    from runtime.model.gpu_experts import GpuExperts, GpuFloatLinear

    config = Qwen3MoeConfig(**shapes)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config).to(dtype)
    experts, top_k, hidden = config.num_experts, config.num_experts_per_tok, config.hidden_size
    expert_bytes = 0
    for layer in model.model.layers:
        gate_up, gate_up_layers = random_stack(experts, 2 * config.moe_intermediate_size, hidden, device)
        down, down_layers = random_stack(experts, hidden, config.moe_intermediate_size, device)
        layer.mlp.experts = GpuExperts(gate_up_layers, down_layers, nn.SiLU(), stacks=(gate_up, down))
        expert_bytes += layer.mlp.experts.nbytes
        router = GpuFloatLinear(torch.randn(experts, hidden, device=device, dtype=dtype) * 0.02)
        layer.mlp.gate = KernelRouter(router, top_k, config.norm_topk_prob, Routing(top_k, config.norm_topk_prob))
    random_q4_blocks(model, device)
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None and parameter.is_meta:
                fill = torch.ones if "norm" in type(module).__name__.lower() else \
                    lambda shape, **kw: torch.randn(shape, **kw) * 0.02
                module._parameters[name] = nn.Parameter(fill(parameter.shape, device=device, dtype=dtype),
                                                        requires_grad=False)
    with torch.device(device):  # (its tables in float32, as transformers makes them)
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    empty_cache()
    return model.eval(), expert_bytes


def q4_figures(steps: int, bandwidth: float, report: dict, device: torch.device, shapes: dict = EIGHT_B,
               dtype: torch.dtype = torch.bfloat16) -> None:
    """The 8B-shaped model from 4-bit blocks: its limit at the file's 4.5 bits a weight (the issue's
    mark), and at the bytes the kernel reads (two codes a byte, int8 sub-scales, float32 super-block
    scales: 4.75 bits a weight) beside it."""
    from bench.decode import step_weight_bytes
    from bench.gpu import figures
    from runtime.model.gpu_blocks import GpuBlockLinear

    model = random_llama(device, shapes, dtype)
    file_bytes = random_q4_blocks(model)
    layout = step_weight_bytes(model)  # (before the lean decoder fuses the layers)
    rest = layout - sum(m.nbytes for m in model.modules() if isinstance(m, GpuBlockLinear))
    figures("llama_8b_q4_blocks", model, steps, bandwidth, report, weights=file_bytes + rest)
    entry = report["models"]["llama_8b_q4_blocks"]
    entry["layout_weight_bytes"] = layout
    entry["limit_note"] = "weight_bytes: the file's Q4_K (4.5 bits a weight); layout_weight_bytes: what the kernel reads"


def moe_figures(steps: int, bandwidth: float, report: dict, device: torch.device, shapes: dict = QWEN3_30B_A3B,
                dtype: torch.dtype = torch.bfloat16) -> None:
    """bench.gpu's decode figures for the random Qwen3-MoE, each stream count's limit from the bytes its
    step reads: the weights but the experts, and a layer's experts at the share of them that `streams`
    tokens routed uniformly at random hit (1 - (1 - k / experts) ** streams; k / experts for one)."""
    from bench.decode import step_weight_bytes
    from bench.gpu import figures

    model, expert_bytes = random_moe_q4(device, shapes, dtype)
    rest = step_weight_bytes(model) - expert_bytes
    share = shapes["num_experts_per_tok"] / shapes["num_experts"]
    figures("qwen3_moe_q4_blocks", model, steps, bandwidth, report,
            weights=lambda streams: rest + round(expert_bytes * (1 - (1 - share) ** streams)))
    entry = report["models"]["qwen3_moe_q4_blocks"]
    entry.update(all_weight_bytes=rest + expert_bytes, expert_bytes=expert_bytes,
                 limit_note="weight_bytes: one stream's (its tokens' experts); each stream count's limit from its "
                            "expected share of the experts (routing taken as uniform)")
