"""A GGUF loaded tensor by tensor into int layers (runtime.model.gguf_load): the same model as
transformers' float load followed by `apply_quantize`, bit for bit, and in the memory its file takes."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from torch import nn

from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.cached_model import _tensors, gguf_config
from runtime.model.gguf_load import load_gguf_blocks
from runtime.model.loader import CheckpointMismatch, load_causal_lm, resolve_model
from runtime.model.quantize import Int4Linear, apply_quantize
from tests.gguf_model import write_tiny_gguf
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

pytestmark = pytest.mark.skipif(q4_unavailable() is not None, reason="int layers need ponder's CPU kernel")

MIXED = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q4_0", "ffn_down": "Q8_0"}
# As llama-quantize's Q4_K_M mixes them (plus the other K and IQ4 types), on 256-wide rows.
K_MIXED = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_output": "Q5_K", "ffn_up": "IQ4_XS", "attn_k": "IQ4_NL"}


def both_ways(path):
    source = resolve_model(str(path))
    reference = load_causal_lm(source, torch.device("cpu"), torch.float32, "sdpa")
    expected = apply_quantize(reference, "auto", source.path)
    model, quantized = load_gguf_blocks(source, gguf_config(source), torch.float32, "sdpa")
    return reference, expected, model, quantized


@pytest.mark.parametrize("kind,kinds,hidden", [("Q4_1", None, 64), ("Q8_0", None, 64), ("Q5_1", MIXED, 64),
                                                ("Q4_K", K_MIXED, 256)])
def test_the_streamed_model_is_transformers_model_with_its_blocks_kept_bit_for_bit(tmp_path, kind, kinds, hidden):
    reference, expected, model, quantized = both_ways(write_tiny_gguf(tmp_path, kind, kinds=kinds, hidden=hidden,
                                                                      ffn=2 * hidden))
    assert quantized == expected and quantized.mode == "int4" and quantized.layers == 15
    a, b = _tensors(reference), _tensors(model)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert [type(m).__name__ for m in model.modules()] == [type(m).__name__ for m in reference.modules()]
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_k_quant_file_serves_the_tokens_generate_gives_on_the_same_int_layers(tmp_path):
    path = write_tiny_gguf(tmp_path, "Q4_K", kinds=K_MIXED, hidden=256, ffn=512)
    engine = engine_for(path, batch_invariant=False)  # quantize left at its default, auto
    assert engine.quantized.describe() == (
        "model.quantize = auto: int4 (15 layers keep the GGUF's blocks (2 IQ4_NL, 2 IQ4_XS, 4 Q4_K, 2 Q5_K, "
        "4 Q6_K, 1 Q8_0); linear tensors in the file: 2 IQ4_NL, 2 IQ4_XS, 4 Q4_K, 2 Q5_K, 4 Q6_K, 1 Q8_0)")
    reference = load_causal_lm(resolve_model(str(path)), torch.device("cpu"), torch.float32, "sdpa")
    apply_quantize(reference, "auto", str(path))
    prompts = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, prompt, 10)


def test_a_mixed_file_runs_the_whole_stack_kernel_and_serves_the_tokens_generate_gives(tmp_path):
    # q Q5_0, k Q5_1 and v Q8_0 fuse (widened to 8-bit codes), so every layer is the int kernel's.
    path = write_tiny_gguf(tmp_path, "Q5_1", kinds=MIXED)
    engine = engine_for(path, batch_invariant=False)
    assert engine.runner.decoder.int4
    assert engine.quantized.block_types == ("Q4_0", "Q5_0", "Q5_1", "Q8_0")  # what /v1/models shows
    reference = load_causal_lm(resolve_model(str(path)), torch.device("cpu"), torch.float32, "sdpa")
    apply_quantize(reference, "auto", str(path))
    prompts = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]
    results = run(engine, [request(str(i), p, max_tokens=10) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert results[str(i)]["choices"][0] == hf_greedy(reference, prompt, 10)


def test_the_mixed_file_s_start_up_line_names_every_type_kept(tmp_path):
    _, _, _, quantized = both_ways(write_tiny_gguf(tmp_path, "Q5_1", kinds=MIXED))
    assert quantized.describe() == (
        "model.quantize = auto: int4 (15 layers keep the GGUF's blocks (2 Q4_0, 2 Q5_0, 6 Q5_1, 5 Q8_0); "
        "linear tensors in the file: 2 Q4_0, 2 Q5_0, 6 Q5_1, 5 Q8_0)")  # the tied head is the Q8_0 embedding


def test_a_layer_of_a_type_the_kernel_does_not_run_alone_keeps_float_weights(tmp_path):
    reference, expected, model, quantized = both_ways(write_tiny_gguf(tmp_path, "Q4_1", kinds={"ffn_up": "F16"}))
    assert quantized.describe() == (
        "model.quantize = auto: int4 (13 layers keep the GGUF's blocks (12 Q4_1, 1 Q8_0), 2 keep float weights "
        "(no int kernel for F16); linear tensors in the file: 2 F16, 12 Q4_1, 1 Q8_0)")
    floats = sorted(name for name, m in model.named_modules() if isinstance(m, nn.Linear))
    assert floats == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 13
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_file_that_does_not_load_tensor_by_tensor_loads_through_transformers(tmp_path, monkeypatch, caplog):
    from runtime import startup_cache
    from runtime.model import cached_model

    def mismatch(source, *args):
        raise CheckpointMismatch(f"{source.path}: 1 model parameter(s) missing from the checkpoint (x)")

    monkeypatch.setattr(startup_cache, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr("runtime.model.gguf_load.load_gguf_blocks", mismatch)
    path = write_tiny_gguf(tmp_path, "Q4_1")
    model, quantized = cached_model.load_quantized_model(resolve_model(str(path)), torch.device("cpu"),
                                                         torch.float32, "sdpa", "auto")
    assert "does not load tensor by tensor" in caplog.text and "loading it through transformers" in caplog.text
    reference, expected, streamed, _ = both_ways(path)
    assert quantized == expected
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, streamed(ids).logits)


# 7B-class shapes (llama 2 7B's hidden and intermediate sizes and heads), four layers; a small vocabulary
# (the embedding stays float32 for its row lookup: 32000 x 4096 of it would be 0.5 GB beside these four
# layers' 0.5 GB of blocks, where a 7B's 32 layers make it an eighth of the file).
HIDDEN, FFN, LAYERS, HEADS, VOCAB = 4096, 11008, 4, 32, 2048
CODE_ALLOWANCE = 256 * 2 ** 20  # the modeling code imported and the config parsed on the way: not the model's


def write_7b_shaped(path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>".encode() for i in range(VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([1] * VOCAB)

    def blocks(name, rows, cols, qtype):
        # gguf's quantizer on 64 rows, repeated: the file's bytes are what it writes, in a fraction of the time
        data = quantize((rng.standard_normal((64, cols)) * 0.02).astype(np.float32), qtype)
        data = np.tile(data, (rows // 64, 1))
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    q4, q8 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
    blocks("token_embd.weight", VOCAB, HIDDEN, q4)
    blocks("output.weight", VOCAB, HIDDEN, q8)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            blocks(f"blk.{i}.{name}.weight", HIDDEN, HIDDEN, q4)
        blocks(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, q4)
        blocks(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, q4)
        blocks(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_MEASURE = """
import json, sys, torch
from runtime.kernels.cpu_kernels import q4_kernel
from runtime.model.cached_model import load_quantized_model
from runtime.model.loader import resolve_model
import transformers, gguf  # every import loading needs, before the baseline
q4_kernel()

def status(field):  # kB
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size (VmHWM) starts again from the current one
before = status("VmRSS:")
source = resolve_model(sys.argv[1])
model, quantized = load_quantized_model(source, torch.device("cpu"), torch.float32, "sdpa", "auto")
after = status("VmHWM:")
held = sum(t.numel() * t.element_size() for t in {id(t): t for t in
           [*model.parameters(), *model.buffers()]}.values())
print(json.dumps({"before": before * 1024, "peak": after * 1024, "held": held, "detail": quantized.describe()}))
"""


def test_a_7b_shaped_gguf_loads_within_1_3x_its_file_size(tmp_path):
    path = tmp_path / "seven-b-shaped.gguf"
    write_7b_shaped(path)
    size = path.stat().st_size
    runs = []
    for _ in range(2):  # from the file (and writing the start-up cache), then from the cache
        env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
        result = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], capture_output=True, text=True,
                                timeout=600, cwd=Path(__file__).parents[3], env=env)
        assert result.returncode == 0, result.stderr[-2000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    print(json.dumps({"file": size, "runs": runs}))
    for run in runs:
        assert "int4 (29 layers keep the GGUF's blocks (24 Q4_1, 5 Q8_0)" in run["detail"]
        # Peak resident memory the load added (Linux's VmHWM, reset before loading), against the file
        # (no KV pool is made here), beside a fixed allowance that does not grow with the model.
        assert run["peak"] - run["before"] < 1.3 * size + CODE_ALLOWANCE, (run, size)
        assert run["held"] < 1.1 * size  # the served tensors: the file's blocks, float norms and embedding
