"""Settings: CLI flags, then `PONDER_*` environment variables, then the TOML file, then defaults.

Read once at start-up and frozen; `config.example.toml` documents every key. Nested keys use `__`
in the environment (`PONDER_SERVER__API_KEY`, `PONDER_CACHE__BLOCK_SIZE`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from runtime.wire.protocol import check_template_kwargs

from runtime.wire.options import RuntimeOptions


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    cors_origins: list[str] = []
    max_body_bytes: int = Field(8 << 20, ge=1024)
    log_level: str = "INFO"
    stats_interval_s: float = Field(1.0, gt=0)  # how often the runtime reports statistics
    public_metrics: bool = False  # serve /metrics without the API key (for a Prometheus on a private network)
    sse_keepalive_s: float = Field(4.0, gt=0, le=60)  # a comment on every stream at least this often
    access_log_probes: bool = False  # log GET /health and GET /metrics in the access log too
    # A request field no schema declares: error, a 400 naming it (OpenAI's behaviour); warn, one logged
    # warning and the field ignored (for clients that send extras of their own).
    unknown_fields: Literal["error", "warn"] = "error"

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        """One of Python's logging levels, in any case (`warning` is `WARNING`)."""
        level = value.upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"log_level {value!r} is not one of {', '.join(LOG_LEVELS)}")
        return level


class ModelSettings(_Section):
    path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    served_name: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    trust_remote_code: bool = False
    # Weight-only quantization of the generator's linear layers on a CPU (runtime.model.quantize); auto keeps
    # a GGUF's own quantized blocks (Q4_0 to Q8_0, K-quants, IQ4) on a CPU and float weights otherwise, which
    # on a CPU run in ponder's float kernel (each output summed in one fixed order: no padding for batch
    # invariance); none keeps torch's nn.Linear.
    quantize: Literal["auto", "none", "int8", "int4"] = "auto"
    # The int4 and float kernels' instruction set on an x86-64 CPU: auto runs AVX512 (AVX512-VNNI for int4)
    # where the CPU has it; avx2 keeps to the AVX2 path most desktop CPUs run (to time it on a server CPU).
    # The same bits either way.
    cpu_isa: Literal["auto", "avx2"] = "auto"
    # On a CUDA GPU, pure decode steps replay a CUDA graph captured at start-up for each padded batch size
    # (runtime.model.graphs; needs batch invariance's row padding); false runs every step eagerly.
    cuda_graphs: bool = True
    # On a CUDA GPU, a GGUF's block layers' GEMM tiles for each layer shape: tune times the kernel's tiles
    # there at start-up (at 1, 4 and 16 rows, each checked to keep a row's bits; float or int8 inputs) and
    # keeps the fastest, one tile or int8 tiles of the same bits a row count each (runtime.model.gpu_tiles;
    # cached, so a restart reads it); default keeps the kernel's default tile.
    gpu_tiles: Literal["tune", "default"] = "tune"
    # auto: the sampling defaults of the model's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty where they differ from transformers' defaults) apply where a request leaves them
    # unset, as vLLM's `--generation-config auto`; none: ponder's own defaults (vLLM's `vllm`).
    generation_config: Literal["auto", "none"] = "auto"
    # Variables every chat request's template gets (vLLM's --default-chat-template-kwargs), e.g.
    # {"enable_thinking": false}; a request's own chat_template_kwargs win key by key.
    chat_template_kwargs: dict[str, Any] = {}
    # How the model's thinking is told from its answer (runtime.wire.reasoning): auto, the format its chat
    # template names; think, `<think>...</think>`; none, no parsing (thinking stays in `content`).
    reasoning_parser: Literal["auto", "none", "think"] = "auto"

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_template_kwargs(value)
        return value


class CacheSettings(_Section):
    block_size: int = Field(16, ge=1, le=1024)
    # KV cache in the compute tier. Unset: 2 GiB on a CPU; on a GPU what gpu_memory_fraction leaves.
    compute_memory_gib: float | None = Field(None, gt=0)
    # On a GPU with neither compute_memory_gib nor num_blocks set: the share of the device's memory ponder
    # may use (weights, activations and KV); the KV pool takes what the loaded models leave of it.
    gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    verifier_memory_gib: float = Field(0.5, gt=0)  # each reward model's own KV store
    host_memory_gib: float = Field(0.0, ge=0)  # host tier below the compute tier (pinned on a GPU); 0: none
    disk_dir: str | None = None  # disk tier directory (created 0700, files 0600); None: none
    disk_gib: float = Field(16.0, gt=0)
    num_blocks: int | None = Field(None, ge=1)
    enable_prefix_cache: bool = True
    # Models with linear-attention layers (Qwen3.5, Qwen3-Next): recurrent states kept at block boundaries,
    # so a cached prompt or a fork resumes there instead of recomputing (docs/serving.md).
    recurrent_snapshot_gib: float = Field(0.25, ge=0)
    # static: the generator gets compute_memory_gib and each reward model verifier_memory_gib.
    # roofline: their sum is one budget, split between generator and verifier by a roofline latency model.
    kv_split: Literal["static", "roofline"] = "static"


class SchedulerSettings(_Section):
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=16)
    # How a search step's paths share the compute tier: lbs (locality-aware beam groups, shared blocks
    # once), lbs_no_prefix (groups that ignore sharing) or token (every path advances token by token).
    policy: Literal["lbs", "lbs_no_prefix", "token"] = "lbs"
    # block: a request whose KV exceeds the compute tier is refused. head: a lone such request (one
    # choice, no search) streams (layer, KV-head group) pieces through it from the host and disk tiers.
    kv_granularity: Literal["block", "head"] = "block"
    # Paths done with their step keep decoding into the next one in idle batch slots while others finish.
    # auto: as many rows as the measured step cost and the decode steps speculation saved say pay
    # (scheduler.step_cost): on a GPU a row is nearly free; on a CPU every row costs and few pay.
    speculative_extension: bool | Literal["auto"] = "auto"
    # A result is the same bits whatever shares its steps, however its prompt was chunked or found in the
    # prefix cache (runtime.model.row_padding). auto: wherever the start-up probe shows the device
    # computes each row on its own, else one warning and served without; true: refuse to start instead
    # (`ponder serve --deterministic`); false: opt out (`--no-deterministic`; docs/serving.md "Seeds").
    batch_invariant: bool | Literal["auto"] = "auto"


class DeviceSettings(_Section):
    """The compute device's peaks for the roofline model; unset: measured at start-up."""

    peak_tflops: float | None = Field(None, gt=0)
    bandwidth_gbps: float | None = Field(None, gt=0)


class LimitSettings(_Section):
    max_n: int = Field(16, ge=1)
    max_stop_strings: int = Field(32, ge=0)
    max_stop_string_length: int = Field(256, ge=1)


class SearchSettings(_Section):
    """Caps on what one search request may ask for; over a cap is a 400."""

    max_paths: int = Field(64, ge=1)
    max_beam_width: int = Field(16, ge=1)
    max_steps: int = Field(100, ge=1)
    max_total_tokens: int = Field(262_144, ge=1)  # search.n x max_tokens
    max_timeout_s: float = Field(600.0, ge=1)  # search.timeout_s cap, and the timeout when a request sets none


class UISettings(_Section):
    """The live search-tree page (`GET /ui`)."""

    max_trees: int = Field(32, ge=0)  # searches kept, running and recent; 0: no page, no tree events


class ResponsesSettings(_Section):
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}` (OpenAI's Responses API)."""

    store: bool = True  # false: nothing is written; every response answers with store false
    # The SQLite file; None: responses.sqlite3 in ponder's data directory, $XDG_DATA_HOME/ponder
    # (~/.local/share/ponder).
    path: str | None = None
    max_stored: int = Field(10_000, ge=1)  # past it the oldest are deleted
    max_age_days: float = Field(30.0, gt=0)  # older ones are deleted


class VerifierSettings(_Section):
    """A reward model loaded at start-up and usable as `search.verifier = "<name>"`."""

    kind: Literal["math-shepherd", "rlhflow", "qwen-prm", "skywork", "orm", "judge"]
    path: str  # a local directory with safetensors weights
    trust_remote_code: bool = False


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PONDER_", env_nested_delimiter="__", frozen=True,
                                      extra="forbid", nested_model_default_partial_update=True)

    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    cache: CacheSettings = CacheSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    device: DeviceSettings = DeviceSettings()
    limits: LimitSettings = LimitSettings()
    search: SearchSettings = SearchSettings()
    ui: UISettings = UISettings()
    responses: ResponsesSettings = ResponsesSettings()
    verifiers: dict[str, VerifierSettings] = {}

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource):
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        toml_file = settings_cls.model_config.get("toml_file")
        if toml_file:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> "Settings":
        """Settings from `config_file` (TOML) under the environment under `overrides`
        (nested dicts, e.g. `server={"port": 9000}`; None values are ignored)."""
        overrides = {k: {kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v
                     for k, v in overrides.items() if v is not None}
        target: type[Settings] = cls
        if config_file is not None:
            path = Path(config_file)
            if not path.is_file():
                raise FileNotFoundError(f"config file {path} does not exist")
            target = type("Settings", (cls,), {"model_config": {**cls.model_config, "toml_file": path}})
        return target(**overrides)

    def runtime_options(self) -> RuntimeOptions:
        return RuntimeOptions(
            model=self.model.path, served_model_name=self.model.served_name, device=self.model.device,
            dtype=self.model.dtype, max_model_len=self.model.max_model_len,
            trust_remote_code=self.model.trust_remote_code, quantize=self.model.quantize, cpu_isa=self.model.cpu_isa,
            cuda_graphs=self.model.cuda_graphs,
            gpu_tiles=self.model.gpu_tiles,
            generation_config=self.model.generation_config,
            block_size=self.cache.block_size,
            kv_memory_bytes=int((self.cache.compute_memory_gib or 2.0) * (1 << 30)), num_blocks=self.cache.num_blocks,
            gpu_memory_fraction=self.cache.gpu_memory_fraction if self.cache.compute_memory_gib is None else None,
            verifier_kv_memory_bytes=int(self.cache.verifier_memory_gib * (1 << 30)),
            host_kv_memory_bytes=int(self.cache.host_memory_gib * (1 << 30)), disk_kv_dir=self.cache.disk_dir,
            disk_kv_bytes=int(self.cache.disk_gib * (1 << 30)),
            enable_prefix_cache=self.cache.enable_prefix_cache,
            recurrent_snapshot_bytes=int(self.cache.recurrent_snapshot_gib * (1 << 30)), max_num_seqs=self.scheduler.max_num_seqs,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            scheduler_policy=self.scheduler.policy, kv_granularity=self.scheduler.kv_granularity,
            speculative_extension=self.scheduler.speculative_extension,
            batch_invariant=self.scheduler.batch_invariant,
            kv_split=self.cache.kv_split,
            peak_flops=self.device.peak_tflops * 1e12 if self.device.peak_tflops else None,
            memory_bandwidth=self.device.bandwidth_gbps * 1e9 if self.device.bandwidth_gbps else None,
            stats_interval_s=self.server.stats_interval_s,
            verifiers={name: {"kind": v.kind, "path": v.path, "trust_remote_code": str(v.trust_remote_code).lower()}
                       for name, v in self.verifiers.items()})
