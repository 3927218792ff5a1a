"""The memory a GGUF's load takes: a 7B-shaped file (hidden 4096, intermediate 11008), loaded as
`ponder serve` loads it, against its size.

    ponder bench gguf-memory [--shape q4_1|q4_k_m] [--layers 32] [--dir DIR] [--json PATH]
    ponder bench gguf-memory --model FILE.gguf [--json PATH]

`--shape q4_1` (the default) writes Q4_1 and Q8_0 linear tensors as a Q4_1 download holds them and a
2048-token vocabulary; `--shape q4_k_m` writes the types llama-quantize's Q4_K_M gives a llama of these
widths (Q4_K, with Q6_K for attn_v and ffn_down) and SmolLM2's vocabulary of 49152 tokens in a Q6_K
embedding the head is tied to (llama-quantize gives a tied embedding the head's type, Q6_K), so the
token embedding is a fifth of a 3-layer file. The file is written with gguf's own writer and quantizer
(64 rows quantized, then repeated: the bytes are the types' real layout, made in seconds; the K-quants,
which gguf cannot quantize, as random codes and sub-scales with small float16 scales, a valid block
of the type's layout); with `--layers 32` it is a 7B's shape, 4.0 GB. `--model` measures a file you
made instead (e.g. with llama.cpp's converter and llama-quantize). Each load
runs in a fresh process that imports everything loading needs first, resets Linux's peak resident size
(VmHWM) and loads with `quantize = auto` on the CPU (no KV pool): once from the file (the first start,
which also writes the start-up cache) and once from that cache. Reported: the file's bytes, what the
served tensors hold, and per load the peak resident memory the load added, as bytes and as a multiple
of the file. The baseline is the runtime ready to load: every import loading needs done first,
transformers' auto classes and the file's modeling module included (about 130 MB of Python code,
whatever the model's size, reported as `code_bytes`); what the modeling code allocates on the way
is counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.report import columns, emit

HIDDEN, FFN, HEADS, VOCAB = 4096, 11008, 32, 2048
SMOLLM2_VOCAB = 49152
# Where a K-quant block holds its float16 super-block scales (d, dmin); the rest may be any bytes.
_K_SCALES = {"Q4_K": (0, 2), "Q6_K": (208,)}

MEASURE = """
import importlib, json, sys, torch

def status(field):  # kB
    return int(next(line for line in open("/proc/self/status") if line.startswith(field)).split()[1])

from runtime.kernels.cpu_kernels import q4_kernel
from runtime.model.cached_model import load_quantized_model
from runtime.model.loader import resolve_model
import transformers, gguf  # every import loading needs, before the baseline
started = status("VmRSS:")
from transformers import AutoConfig, AutoModelForCausalLM  # the modeling code (code, whatever the model's size)
from runtime.model.gguf_config import MODEL_TYPES, Metadata
model_type = MODEL_TYPES.get(Metadata(sys.argv[1]).architecture)
if model_type is not None:
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
q4_kernel()

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident size (VmHWM) starts again from the current one
before = status("VmRSS:")
source = resolve_model(sys.argv[1])
model, quantized = load_quantized_model(source, torch.device("cpu"), torch.float32, "sdpa", "auto")
after = status("VmHWM:")
held = sum(t.numel() * t.element_size() for t in {id(t): t for t in
           [*model.parameters(), *model.buffers()]}.values())
print(json.dumps({"code": (before - started) * 1024, "before": before * 1024, "peak": after * 1024, "held": held, "detail": quantized.describe()}))
"""


def write_7b_shaped(path: Path, layers: int, shape: str = "q4_1") -> None:
    """A llama GGUF of a 7B's widths with `layers` layers and float norms: Q4_1 linear tensors, Q8_0
    down projections and head, a 2048-token vocabulary (`shape="q4_1"`); or Q4_K_M's types and
    SmolLM2's vocabulary in the Q6_K embedding the head is tied to (`shape="q4_k_m"`)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    vocab = SMOLLM2_VOCAB if shape == "q4_k_m" else VOCAB
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>".encode() for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types([1] * vocab)

    def blocks(name, rows, cols, qtype):
        # 64 rows of the type, repeated: the file's bytes are its layout, in a fraction of the time
        if qtype.name in _K_SCALES:
            block, size = GGML_QUANT_SIZES[qtype]
            data = rng.integers(0, 256, (64, cols // block, size), dtype=np.uint8)
            for offset in _K_SCALES[qtype.name]:
                scales = (rng.random((64, cols // block)) * 0.002 + 0.0002).astype(np.float16)
                data[..., offset:offset + 2] = scales.view(np.uint8).reshape(64, -1, 2)
            data = data.reshape(64, -1)
        else:
            data = quantize((rng.standard_normal((64, cols)) * 0.02).astype(np.float32), qtype)
        data = np.tile(data, (rows // 64, 1))
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    types = GGMLQuantizationType
    if shape == "q4_k_m":
        embedding, head, linear, more_bits = types.Q6_K, None, types.Q4_K, types.Q6_K
    else:
        embedding, head, linear, more_bits = types.Q4_1, types.Q8_0, types.Q4_1, types.Q8_0
    blocks("token_embd.weight", vocab, HIDDEN, embedding)
    if head is not None:
        blocks("output.weight", vocab, HIDDEN, head)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name in ("attn_q", "attn_k", "attn_output"):
            blocks(f"blk.{i}.{name}.weight", HIDDEN, HIDDEN, linear)
        blocks(f"blk.{i}.attn_v.weight", HIDDEN, HIDDEN, more_bits if shape == "q4_k_m" else linear)
        blocks(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, linear)
        blocks(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, linear)
        blocks(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, more_bits)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def measure_loads(path: Path, cache_dir: Path) -> list[dict]:
    """Two loads of `path` in fresh processes (from the file, then from the start-up cache it wrote)."""
    runs = []
    for _ in range(2):
        env = {"XDG_CACHE_HOME": str(cache_dir), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1"}
        result = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True,
                                timeout=1800, cwd=Path(__file__).parents[1], env=env)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-2000:])
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    return runs


def run(layers: int, directory: Path, shape: str = "q4_1", model: Path | None = None) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    path = model
    if path is None:
        path = directory / f"seven-b-shaped-{shape}-{layers}.gguf"
        write_7b_shaped(path, layers, shape)
    size = path.stat().st_size
    runs = measure_loads(path, directory / "cache")
    loads = [{"from": origin, "added_bytes": r["peak"] - r["before"], "of_file": round((r["peak"] - r["before"]) / size, 3),
              "detail": r["detail"]} for origin, r in zip(("file", "start-up cache"), runs)]
    name = str(model) if model is not None else f"a 7B-shaped GGUF ({shape}) with {layers} layers"
    return {"file": name, "layers": None if model else layers, "shape": None if model else shape, "file_bytes": size, "held_bytes": runs[0]["held"],
            "code_bytes": runs[0]["code"], "loads": loads}


def table(results: dict) -> str:
    gb = 1e9
    body = [[load["from"], f"{load['added_bytes'] / gb:.2f}", f"{load['of_file']:.2f}x"] for load in results["loads"]]
    return "\n".join([f"gguf-memory: {results['file']}, {results['file_bytes'] / gb:.2f} GB; modeling code imported before "
                      f"the baseline {results['code_bytes'] / gb:.2f} GB; "
                      f"served tensors {results['held_bytes'] / gb:.2f} GB",
                      *columns(["load from", "peak added GB", "of the file"], body, 16)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ponder bench gguf-memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32, help="layers of the 7B-shaped file (32: a 7B's)")
    parser.add_argument("--shape", choices=("q4_1", "q4_k_m"), default="q4_1",
                        help="the file's types and vocabulary (see above)")
    parser.add_argument("--model", default=None, help="measure this GGUF file instead of writing one")
    parser.add_argument("--dir", default=None, help="where the file and its start-up cache go (default: a temporary folder)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error("--layers: at least 1")
    model = None if args.model is None else Path(args.model).resolve()
    if model is not None and not model.is_file():
        parser.error(f"--model: no file at {model}")
    if args.dir is not None:
        results = run(args.layers, Path(args.dir), args.shape, model)
    else:
        with tempfile.TemporaryDirectory(prefix="ponder-gguf-memory-") as scratch:
            results = run(args.layers, Path(scratch), args.shape, model)
    emit(results, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
