"""`ponder serve` and `ponder bench ...`."""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import logging
import os
import sys

from pydantic import ValidationError


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    p.add_argument("--model", help="a Hugging Face model directory (safetensors), a .gguf file, or a hub id "
                                   "from the local cache; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--config", help="a TOML settings file (see config.example.toml)")
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantize", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization of the model's linear layers, CPU only (default auto: a "
                        "GGUF's own quantized blocks kept on a CPU, float weights otherwise, run in ponder's "
                        "float kernel on a CPU; none: torch's matmul)")
    p.add_argument("--max-model-len", type=int, dest="max_model_len")
    p.add_argument("--generation-config", choices=["auto", "none"], dest="generation_config",
                   help="auto (default): the sampling defaults of the model's generation_config.json apply where a "
                        "request leaves them unset, as vLLM's; none: ponder's own (model.generation_config)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="refuse to start where results cannot be the same bits however requests are batched "
                        "(scheduler.batch_invariant = true; the default, auto, serves without them there)")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false", default=None,
                   help="opt out of batch invariance (scheduler.batch_invariant = false): long prompts prefill "
                        "up to about 10 %% faster on a CPU, and seeds repeat only for requests alone in the server")
    p.add_argument("--api-key", dest="api_key", help="require `Authorization: Bearer KEY` on every route but /health")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="run a benchmark (prints JSON and a table)")
    p.add_argument("name", choices=["decode", "search", "accuracy", "kv", "simulate", "headwise", "serving", "load", "quantize", "example", "startup", "router", "timeout", "serving-load", "structured", "gguf-memory", "family-replicas", "gpu"])
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see --help of each)")


def settings_from_args(args: argparse.Namespace):
    """The settings `ponder serve` runs with: its flags over the environment over the config file."""
    from server.config import Settings

    return Settings.load(
        args.config,
        server={"host": args.host, "port": args.port, "api_key": args.api_key},
        model={"path": args.model, "device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
               "quantize": args.quantize, "generation_config": args.generation_config},
        scheduler={"batch_invariant": args.deterministic})


def serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        print(f"ponder: invalid settings: {_one_line(exc)}", file=sys.stderr)
        return 2
    from runtime.wire.client import SpawnedRuntime

    # The runtime process starts now: its imports and its settings check run while this process
    # imports the HTTP side, and no port is bound before it has said the settings hold.
    # (its logs at the server's level: PONDER_LOG_LEVEL, where set, is the runtime's own)
    os.environ.setdefault("PONDER_LOG_LEVEL", settings.server.log_level)
    runtime = SpawnedRuntime(settings.runtime_options())
    import uvicorn

    from server.app import create_app

    verdict = runtime.settings_checked()
    if verdict.problem is not None:
        runtime.close()
        # Status 3: a checkpoint refused by strict loading (runtime.preflight.CHECKPOINT_REFUSED); 4: an
        # architecture ponder cannot run exactly (runtime.preflight.MODEL_REFUSED).
        kind = {3: "refusing the checkpoint", 4: "refusing the model"}.get(verdict.status, "invalid settings:")
        print(f"ponder: {kind} {verdict.problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.server.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("ponder")
    host = settings.server.host
    if settings.server.api_key is None and not _is_loopback(host):
        log.warning("binding %s without an API key: anyone who can reach this address can use the server; "
                    "set --api-key or PONDER_SERVER__API_KEY", host)
    failures: list[str] = []

    def load_failed(message: str) -> None:
        """The model cannot load: stop serving and exit non-zero (as vLLM and llama-server do), so
        `make run`, Docker and systemd see the failure instead of a server answering 503."""
        failures.append(message)
        server.should_exit = True

    app = create_app(settings, runtime=runtime, on_load_failed=load_failed)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=settings.server.port,
                                           log_level=settings.server.log_level.lower(), timeout_graceful_shutdown=5))
    server.run()
    if failures:
        print(f"ponder: cannot load the model: {' '.join(failures[0].split())}", file=sys.stderr)
        return 1
    return 0 if server.started else 3  # 3: uvicorn's own status where it could not start (a port in use)


def _one_line(exc: Exception) -> str:
    """A settings error as one line naming each bad key, e.g. `model.quantize: Input should be ...`."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(part) for part in error['loc'])}: {error['msg']}" for error in exc.errors())
    return str(exc)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ponder", description="OpenAI-compatible server with verifier-guided search")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    module = importlib.import_module(f"bench.{args.name.replace('-', '_')}")  # serving-load: bench.serving_load
    return module.main(args.args)


if __name__ == "__main__":
    sys.exit(main())
