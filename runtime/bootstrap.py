"""Build an engine from the runtime's start options: resolve, load and size everything."""

from __future__ import annotations

import logging
import time

import torch

from runtime.model import attention, families, paths
from runtime.model.decoders import build_decoder
from runtime.kv.device_memory import activation_reserve, kv_pool_blocks, sizes_from_device
from runtime.engine import Engine, EngineConfig
from storage.kv_cache import kv_shape_of
from runtime.kv.residency import tier_payload
from runtime.kv.kv_split import KVSplitter, default_workload, device_peaks, model_cost
from runtime.kernels.cpu_kernels import use_isa
from runtime.model.cached_model import load_quantized_model
from runtime.model.loader import ModelSource, SettingError, load_tokenizer, pick_device, pick_dtype, resolve_model
from runtime.startup_cache import file_identity
from runtime.wire.options import RuntimeOptions
from runtime.model.quantize_setting import check_mode
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier
from storage.tiers import TierChain
from runtime.verify.verifiers.registry import load_verifier

log = logging.getLogger("ponder.runtime")


def build_engine(options: RuntimeOptions) -> tuple[Engine, ModelSource]:
    source = resolve_model(options.model, options.served_model_name)
    device = pick_device(options.device)
    dtype = pick_dtype(options.dtype, device)
    check_mode(options.quantize)  # an unknown mode fails before anything loads
    if options.cpu_isa != "auto" and device.type == "cpu":
        log.info("the int4 kernel keeps to %s (model.cpu_isa = %s)", use_isa(options.cpu_isa), options.cpu_isa)
    log.info("loading tokenizer from %s", source.directory)
    started = time.perf_counter()
    try:
        tokenizer = load_tokenizer(source, options.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - transformers' message names neither the file nor the model
        raise RuntimeError(f"the tokenizer of {source.path} cannot be read: {exc}") from exc
    log.info("tokenizer loaded in %.2f s", time.perf_counter() - started)
    log.info("loading model %s (%s on %s)", source.name, str(dtype).removeprefix("torch."), device)
    started = time.perf_counter()
    model, quantized = load_quantized_model(source, device, dtype, attention.register(), options.quantize,
                                            options.trust_remote_code)
    log.info("model loaded in %.2f s; %s", time.perf_counter() - started, quantized.describe())
    families.check_loaded(model, source.path)  # the settings check read the config; this reads the modules too
    text_config = model.config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None) or 2048
    max_model_len = min(options.max_model_len or limit, limit)
    shape = kv_shape_of(model.config, options.block_size)
    # Reward models load before any pool is sized: a roofline split sizes the pools from all models.
    verifiers = {name: _load_verifier(name, spec, device, dtype) for name, spec in options.verifiers.items()}
    kv_bytes = options.kv_memory_bytes
    if sizes_from_device(options, device):
        kv_bytes = device_kv_bytes(options, device, model, verifiers, max_model_len)
    splitter = _roofline_splitter(options, model, verifiers, max_model_len, kv_bytes) \
        if options.kv_split == "roofline" else None
    if splitter is not None:
        num_blocks = splitter.generator_blocks
    else:
        num_blocks = options.num_blocks or max(1, kv_bytes // shape.bytes_per_block(dtype))
    model_key = f"{source.name}|{dtype}|{source.directory}|{source.gguf_file}".encode()
    if quantized.mode != "none":  # a quantized model writes other KV than the float one
        model_key += f"|quantize={quantized.mode}|{quantized.detail}".encode()
    config = EngineConfig(max_model_len=max_model_len, num_blocks=num_blocks, block_size=options.block_size,
                          max_num_seqs=options.max_num_seqs,
                          max_num_batched_tokens=max(options.max_num_batched_tokens, options.block_size),
                          enable_prefix_cache=options.enable_prefix_cache,
                          recurrent_snapshot_bytes=options.recurrent_snapshot_bytes, policy=options.scheduler_policy,
                          kv_granularity=options.kv_granularity,
                          speculative_extension=speculates(options.speculative_extension, device),
                          batch_invariant=options.batch_invariant,
                          invariance_cache={"model": file_identity(source.path),
                                            "key": model_key.decode(errors="replace")})
    log.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, options.block_size,
             num_blocks * shape.bytes_per_block(dtype) / 2**20)
    tiers = None
    if options.host_kv_memory_bytes > 0 or options.disk_kv_dir:
        tiers = _tier_chain(options, tier_payload(shape, config.policy), next(model.parameters()).dtype, device,
                            model_key)
    reward_models = {name: (verifier, splitter.verifier_blocks[name] if splitter is not None else
                            max(1, options.verifier_kv_memory_bytes
                                // kv_shape_of(verifier.model.config, options.block_size).bytes_per_block(dtype)))
                     for name, verifier in verifiers.items()}
    if device.type == "cuda" and options.gpu_tiles == "tune" and quantized.mode == "gpu_blocks":
        tune_tiles(model)
    engine = Engine(model, tokenizer, config, model_key, quantized=quantized, kv_split=splitter, tiers=tiers,
                    reward_models=reward_models)
    if options.cuda_graphs and device.type == "cuda" and engine.runner.use_graphs():
        log.info("CUDA graphs: pure decode steps of 1 to %d sequences replay one of %d graphs (padded sizes %s)",
                 engine.runner.graphs.max_rows, len(engine.runner.graphs.sizes), engine.runner.graphs.sizes)
    log.info("paths: %s", paths.describe(engine_paths(engine)))
    return engine, source


def tune_tiles(model) -> None:
    """Time the block GEMM's tiles for each layer shape the decoder launches (runtime.model.gpu_tiles),
    before the first step and any CUDA graph."""
    from runtime.model.gpu_tiles import tune

    started = time.perf_counter()
    chosen = tune(model, build_decoder(model), next(model.parameters()).dtype)
    log.info("block GEMM tiles: %d layer shapes in %.1f s (model.gpu_tiles = tune)", len(chosen),
             time.perf_counter() - started)


def engine_paths(engine: Engine) -> dict[str, str]:
    """Which code computes each part of the engine's steps (runtime.model.paths)."""
    runner = engine.runner
    return paths.step_paths(engine.model, runner.decoder, runner.attention_kernel, engine.quantized.mode,
                            runner.recurrent)


def speculates(setting: bool | str, device) -> bool | str:
    """Whether search paths decode their children's next steps in idle slots (runtime.search.speculation),
    said at start-up. `auto`: decided per step by the engine's measured step cost (scheduler.step_cost):
    rows are added only while they pay, which on a GPU is nearly always (an extra row is nearly free
    until the batch is compute-bound) and on a CPU rarely (each row costs compute)."""
    if setting == "auto":
        log.info("speculative extension: auto, decided per step by the measured step cost (fixed against per "
                 "row, scheduler.step_cost); no speculative rows until decode steps of two sizes were timed (%s)",
                 device.type)
        return "auto"
    log.info("speculative extension: %s", "on" if setting else "off")
    return bool(setting)


def device_kv_bytes(options: RuntimeOptions, device: torch.device, model, verifiers: dict, max_model_len: int) -> int:
    """The generator's KV memory on a GPU: what `gpu_memory_fraction` of the device leaves once every
    model is loaded (and the generator's layers fused, as they will be served), less one step's
    activations and the reward models' KV pools (runtime.kv.device_memory)."""
    build_decoder(model)  # fuse now: the weights measured are the weights served
    torch.cuda.empty_cache()  # the unfused layers' memory goes back to the device, for the pool
    free, total = torch.cuda.mem_get_info(device)
    parameter = next(model.parameters())
    shape = kv_shape_of(model.config, options.block_size)
    bytes_per_block = shape.bytes_per_block(parameter.dtype)
    max_batched_tokens = max(options.max_num_batched_tokens, options.block_size)
    activations = max(activation_reserve(m.config.get_text_config(), max_batched_tokens, options.max_num_seqs,
                                         max_model_len, parameter.element_size())
                      for m in [model] + [v.model for v in verifiers.values()])
    verifier_pools = len(verifiers) * options.verifier_kv_memory_bytes
    fraction = options.gpu_memory_fraction
    if not 0 < fraction <= 1:
        raise SettingError(f"cache.gpu_memory_fraction = {fraction} is not in (0, 1]")
    num_blocks = kv_pool_blocks(free, total, fraction, activations + verifier_pools, bytes_per_block)
    used = total - free
    if num_blocks < 2:
        raise SettingError(
            f"cache.gpu_memory_fraction = {fraction}: of {fraction * total / 2**30:.2f} GiB, the loaded models "
            f"and everything else on {device} use {used / 2**30:.2f} GiB and a step's activations and the "
            f"verifier pools need {(activations + verifier_pools) / 2**30:.2f} GiB, which leaves no KV cache; "
            "raise it, or set cache.compute_memory_gib or cache.num_blocks")
    log.info("KV cache from gpu_memory_fraction %.2f of %.2f GiB on %s: %.2f GiB in use, %.2f GiB held for "
             "activations and %.2f GiB for verifier pools leave %d bytes: %d blocks, %d tokens",
             fraction, total / 2**30, device, used / 2**30, activations / 2**30, verifier_pools / 2**30,
             num_blocks * bytes_per_block, num_blocks, num_blocks * options.block_size)
    return num_blocks * bytes_per_block


def _load_verifier(name: str, spec: dict[str, str], device, dtype):
    log.info("loading verifier %s (%s) from %s", name, spec["kind"], spec["path"])
    verifier = load_verifier(spec["kind"], spec["path"], device=device, dtype=dtype,
                             trust_remote_code=spec.get("trust_remote_code") == "true")
    families.check_loaded(verifier.model, spec["path"])  # it attends through the same paged attention
    verifier.model.set_attn_implementation(attention.ATTENTION_NAME)
    return verifier


def _roofline_splitter(options: RuntimeOptions, model, verifiers: dict, max_model_len: int,
                       kv_bytes: int) -> KVSplitter | None:
    """One budget, the generator's KV memory and every reward model's, split by the roofline model."""
    if not verifiers:
        log.info("kv_split = roofline but no reward-model verifier is configured: the generator keeps its KV memory")
        return None
    generator = model_cost(model, options.block_size, with_head=True)
    costs = {name: model_cost(v.model, options.block_size, with_head=False) for name, v in verifiers.items()}
    generator_bytes = options.num_blocks * generator.block_bytes if options.num_blocks else kv_bytes
    budget = generator_bytes + len(verifiers) * options.verifier_kv_memory_bytes
    parameter = next(model.parameters())
    peaks = device_peaks(options.peak_flops, options.memory_bandwidth, parameter.device, parameter.dtype)
    splitter = KVSplitter(budget, generator, costs, peaks, default_workload(max_model_len))
    log.info("%s", splitter.describe())
    return splitter


def _tier_chain(options: RuntimeOptions, payload: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                model_key: bytes) -> TierChain:
    chain = tier_chain(payload, dtype, device, model_key, options.host_kv_memory_bytes, options.disk_kv_dir,
                       options.disk_kv_bytes)
    if chain.disk is not None:
        log.info("disk KV tier at %s: %d blocks found", chain.disk.path, chain.disk.num_blocks)
    return chain


def tier_chain(payload: tuple[int, ...], dtype: torch.dtype, device: torch.device, model_key: bytes,
               host_bytes: int, disk_dir: str | None, disk_bytes: int, uncached_reads: bool = False) -> TierChain:
    """The host and disk tiers to attach below an engine's compute pool on `device`, holding its
    policy's `payload` (`runtime.kv.residency.tier_payload`: a block, or under `token` one layer of one) of
    `dtype`; no host tier for 0 bytes, no disk tier without a dir."""
    compute = "gpu" if device.type == "cuda" else "cpu"
    host = None
    if host_bytes > 0:
        host = HostTier(payload, dtype, host_bytes, pin_memory=True, name="host")
    disk = None
    if disk_dir:
        # Blocks of another model, dtype or layout must never be read: the namespace names all three.
        namespace = f"{model_key.decode(errors='replace')}|{payload}|{dtype}"
        disk = DiskTier(disk_dir, namespace, disk_bytes, name="disk", uncached_reads=uncached_reads)
    return TierChain(host, disk, compute_name=compute)
