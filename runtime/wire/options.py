"""What the runtime process is started with: the options the server (or a test, a benchmark) hands it
as the first frame it reads (runtime.process), and their decoder."""

from __future__ import annotations

from typing import Literal

import msgspec


class RuntimeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What the runtime process is started with (the first frame it reads)."""

    model: str | None = None
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    trust_remote_code: bool = False
    quantize: str = "auto"  # auto | none | int8 | int4: the generator's linear layers (runtime.model.quantize)
    cpu_isa: str = "auto"  # auto | avx2: the int4 kernel's instruction set (runtime.kernels.cpu_kernels.use_isa)
    cuda_graphs: bool = True  # pure decode steps replay CUDA graphs on a CUDA GPU (runtime.model.graphs)
    gpu_tiles: str = "tune"  # tune | default: a GGUF's block GEMM tiles on a GPU (runtime.model.gpu_tiles)
    generation_config: str = "auto"  # auto | none: the model's sampling defaults (runtime.model.generation_config)
    block_size: int = 16
    kv_memory_bytes: int = 2 << 30
    num_blocks: int | None = None  # overrides kv_memory_bytes
    enable_prefix_cache: bool = True
    recurrent_snapshot_bytes: int = 256 << 20  # linear-attention states kept at block boundaries
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    stats_interval_s: float = 1.0
    # name -> {"kind", "path", "trust_remote_code"}: reward models to load next to the generator
    verifiers: dict[str, dict[str, str]] = {}
    verifier_kv_memory_bytes: int = 512 << 20  # each reward model's own KV store
    host_kv_memory_bytes: int = 0  # the host tier below the compute tier (0: none)
    disk_kv_dir: str | None = None  # the disk tier (None: none)
    disk_kv_bytes: int = 16 << 30
    scheduler_policy: str = "lbs"  # lbs | lbs_no_prefix | token
    kv_granularity: str = "block"  # block | head (a lone request over the compute pool streams head-wise)
    speculative_extension: bool | Literal["auto"] = "auto"  # auto: rows the step-cost model says pay (runtime.bootstrap)
    # true | auto | false: results the same bits whatever the batch (runtime.model.row_padding.padding_for)
    batch_invariant: bool | Literal["auto"] = "auto"
    kv_split: str = "static"  # static | roofline
    peak_flops: float | None = None  # FLOP/s; None: measured
    memory_bandwidth: float | None = None  # bytes/s; None: measured
    # On CUDA with num_blocks unset: None keeps kv_memory_bytes; a fraction sizes the generator's KV pool
    # to what that fraction of the device's memory leaves once the models are loaded (runtime.kv.device_memory).
    gpu_memory_fraction: float | None = None


_options_decoder = msgspec.msgpack.Decoder(RuntimeOptions)


def decode_options(data: bytes) -> RuntimeOptions:
    return _options_decoder.decode(data)
