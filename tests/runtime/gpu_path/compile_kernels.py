"""Every Triton kernel of ponder's GPU path compiled for a Hopper GPU (sm_90) by Triton's own compiler and
ptxas, with no GPU at hand: what Triton's interpreter forgives (a loop-carried type, a pointer select, an
unsupported operator) fails here. Run as a script in a process without `TRITON_INTERPRET` (the test
suite's kernels are interpreted): prints one JSON line, each case's name and its error or None."""

from __future__ import annotations

import json
import os

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from runtime.kernels.gpu import elementwise, gated_delta, int8_linear, linear, paged, routed

HOPPER = GPUTarget("cuda", 90, 32)
P32, P16, P8, PI32, PI64, I32, F32 = "*fp32", "*bf16", "*i8", "*i32", "*i64", "i32", "fp32"


def compiled(kernel, types: dict, constexprs: dict) -> str | None:
    """None where `kernel` compiles with these argument types and constants, else the error."""
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else types[name] for name in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    try:
        triton.compile(source, target=HOPPER)
    except Exception as error:  # (any compiler error is the finding)
        return f"{type(error).__name__}: {error}"[:2000]
    return None


def cases():
    yield "gated_delta", gated_delta._gated_delta, dict(
        mixed_ptr=P32, taps_ptr=P32, bias_ptr=P32, a_ptr=P32, b_ptr=P32, dt_ptr=P32, alog_ptr=P32, conv_ptr=P32,
        state_ptr=P32, rows_ptr=PI32, lengths_ptr=PI32, slots_ptr=PI32, core_ptr=P32, final_ptr=P32, snap_ptr=P32,
        channels=I32, root=F32), dict(HV=32, REPEAT=2, DK=128, DV=128, KEY_DIM=2048, TAPS=4, BV=64, HAS_BIAS=True)
    yield "conv_tails", gated_delta._conv_tails, dict(
        mixed_ptr=P32, conv_ptr=P32, rows_ptr=PI32, lengths_ptr=PI32, out_ptr=P32, channels=I32), dict(TAPS=4, BLOCK=1024)
    for norm, offset in ((False, False), (True, False), (True, True)):
        yield f"attention_inputs norm={norm} offset={offset}", paged._attention_inputs, dict(
            qkv_ptr=P16, cos_ptr=P16, sin_ptr=P16, norms_ptr=P32 if offset else P16, eps=F32, q_ptr=P16, rows_ptr=PI64,
            cache_ptr=P16, layer_offset=I32, rows_stride=I32, rows_token_stride=I32, qkv_stride=I32), dict(
            HEADS=32, KV_HEADS=8, D=128, BLOCK=128, HAS_NORM=norm, OFFSET=offset, HAS_ROTARY=True)
    for sinks in (False, True):
        yield f"decode_attention sinks={sinks}", paged._decode_attention, dict(
            q_ptr=P16, rows_ptr=PI64, kv_ptr=P16, tables_ptr=PI64, ctx_ptr=PI64, out_ptr=P16, sinks_ptr=P16, layer=I32,
            scale=F32, softcap=F32, window=I32, q_stride=I32, q_head_stride=I32, out_stride=I32, table_stride=I32,
            num_layers=I32), dict(HEADS=32, KV_HEADS=8, BLOCK_SIZE=16, D=128, BLOCK_D=128, HAS_SINKS=sinks,
                                  HAS_SOFTCAP=sinks)
    for gemma in (False, True):
        yield f"rms_norm gemma={gemma}", elementwise._rms_norm, dict(
            x_ptr=P16, res_ptr=P16, w_ptr=P32 if gemma else P16, pre_ptr=P32, out_ptr=P16, res_out_ptr=P16, n=I32,
            x_stride=I32, res_stride=I32, out_stride=I32, eps=F32, pre_eps=F32), dict(
            HAS_RES=True, HAS_PRE=gemma, OFFSET=gemma, BLOCK=4096)
        yield f"act_mul gelu={gemma}", elementwise._act_mul, dict(x_ptr=P16, out_ptr=P16, n=I32, x_stride=I32), dict(
            GELU=gemma, BLOCK=1024)
    # (the last: Q6_K's 6-bit codes, the inputs SiLU(gate) * up as loaded: a down projection's)
    for splits, per_super, high in ((1, 0, False), (4, 8, False), (1, 16, True)):
        yield f"linear splits={splits} super={per_super} high={high}", linear._linear, dict(
            x_ptr=P16, w_ptr="*u8", h_ptr="*u8", d_ptr=P8 if per_super else P32, m_ptr=P8 if per_super else P32,
            ds_ptr=P32, ms_ptr=P32, out_ptr=P32 if splits > 1 else P16, outs=I32, rows=I32, x_stride=I32, w_stride=I32,
            h_stride=I32, d_stride=I32, ds_stride=I32, out_stride=I32), dict(
            INS=4096, GROUP=16 if high else 32, BLOCKS=True, HAS_M=not high, SUPER=per_super, PACKED=True, HIGH=high,
            OFFSET=32 if high else 0, BLOCK_N=8, BLOCK_K=512, SPLITS=splits, CHUNK=4096 // splits, ACT=int(high))
    # the tensor-core tile: Q4_K's packed codes and compact scales, Q6_K's 6-bit codes, Q8_0's bytes, bf16 weights
    for name, packed, high, per_super, codes in (("q4_k", True, False, 8, "*u8"), ("q6_k", True, True, 16, "*u8"),
                                                 ("q8_0", False, False, 0, P8), ("bf16", False, False, 0, P16)):
        blocks = name != "bf16"
        yield f"tile_linear {name}", linear._tile_linear, dict(
            x_ptr=P16, w_ptr=codes, h_ptr="*u8", d_ptr=P8 if per_super else P32, m_ptr=P8 if per_super else P32,
            ds_ptr=P32, ms_ptr=P32, out_ptr=P32 if name == "q4_k" else P16, outs=I32, rows=I32, x_stride=I32,
            w_stride=I32, h_stride=I32, d_stride=I32, ds_stride=I32, out_stride=I32), dict(
            INS=4096, GROUP=(16 if high else 32) if blocks else 1, BLOCKS=blocks, HAS_M=name == "q4_k",
            SUPER=per_super, PACKED=packed, HIGH=high, OFFSET=32 if high else 0, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
            SPLITS=2 if name == "q4_k" else 1, CHUNK=2048 if name == "q4_k" else 4096, ACT=2 if name == "q6_k" else 0,
            DOT=triton.language.bfloat16, IEEE=False)
    # int8 inputs: a GEMV (one row a program) and the integer tensor cores' tile over Q4_K's packed codes and
    # compact scales (split in two), Q6_K's 6-bit codes in groups of 16 (inputs SiLU(gate) * up), Q8_0's bytes
    for name, packed, high, per_super, codes in (("q4_k", True, False, 8, "*u8"), ("q6_k", True, True, 16, "*u8"),
                                                 ("q8_0", False, False, 0, P8)):
        for rows in (1, 16):
            yield f"int8_linear {name} rows={rows}", int8_linear._int8_linear, dict(
                x_ptr=P16, w_ptr=codes, h_ptr="*u8", d_ptr=P8 if per_super else P32, m_ptr=P8 if per_super else P32,
                ds_ptr=P32, ms_ptr=P32, out_ptr=P32 if name == "q4_k" else P16, outs=I32, rows=I32, x_stride=I32,
                w_stride=I32, h_stride=I32, d_stride=I32, ds_stride=I32, out_stride=I32), dict(
                INS=4096, GROUP=16 if high else 32, HAS_M=name == "q4_k", SUPER=per_super, PACKED=packed, HIGH=high,
                OFFSET=32 if high else 0, BLOCK_M=rows, BLOCK_N=64 if rows > 1 else 16, BLOCK_K=256,
                SPLITS=2 if name == "q4_k" else 1, CHUNK=2048 if name == "q4_k" else 4096, ACT=1 if name == "q6_k" else 0)
    blocks = dict(w_ptr="*u8", t_ptr="*u8", d_ptr=P8, m_ptr=P8, ds_ptr=P32, ms_ptr=P32, w_expert=I32, t_expert=I32,
                  d_expert=I32, ds_expert=I32, w_stride=I32, t_stride=I32, d_stride=I32,
                  ds_stride=I32)  # (a Q5_K's experts: 6-bit codes, compact scales)
    form = dict(INS=2048, GROUP=32, BLOCKS=True, HAS_M=True, SUPER=8, PACKED=True, HIGH=True, OFFSET=0, BLOCK_N=8,
                BLOCK_K=512, CHUNK=2048)
    yield "routed gate_up", routed._gate_up, dict(x_ptr=P16, experts_ptr=PI32, h_ptr=P16, inner=I32, x_stride=I32,
                                                  **blocks), dict(TOP_K=8, **form)
    yield "routed down", routed._down, dict(h_ptr=P16, experts_ptr=PI32, weights_ptr=P16, out_ptr=P16, outs=I32,
                                            **blocks), dict(TOP_K=8, **form)
    yield "routed route", routed._route, dict(logits_ptr=P16, experts_ptr=PI32, weights_ptr=P16, num_experts=I32,
                                              logits_stride=I32), dict(TOP_K=8, RENORMALISE=True, BLOCK=128)
    yield "sum_splits", linear._sum_splits, dict(part_ptr=P32, out_ptr=P16, outs=I32, rows=I32, out_stride=I32), dict(
        SPLITS=4, BLOCK=1024)


if __name__ == "__main__":
    assert not os.environ.get("TRITON_INTERPRET"), "run without Triton's interpreter: it compiles the kernels"
    print(json.dumps({name: compiled(kernel, types, constexprs) for name, kernel, types, constexprs in cases()}))
