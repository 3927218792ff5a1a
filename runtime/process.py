"""The runtime process: `python -m runtime.process --fd N`.

Reads `RuntimeOptions` then requests from the socket inherited as fd N, checks the settings and
says so (`SettingsChecked`; it ends there on a problem), loads the model, answers `Ready`, and runs
the engine loop: drain incoming messages, run one step, send what it produced.
Statistics go out every `stats_interval_s`. The process exits when the socket closes.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback

from runtime.wire.framing import recv_frame, send_frame, send_frames
from runtime.wire.protocol import (
    AbortRequest, DetokenizeRequest, GenerateRequest, LoadFailed, Ready, RequestError, RewardRequest, Shutdown,
    TokenizeRequest, decode_to_runtime, encode,
)
from runtime.wire.options import decode_options

log = logging.getLogger("ponder.runtime")

DEVICE_FAILURE_EXIT = 70  # EX_SOFTWARE: the runtime ended itself after an unrecoverable device error


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, message) -> None:
        send_frame(self.sock, encode(message))

    def send_all(self, messages) -> None:
        send_frames(self.sock, [encode(message) for message in messages])

    def poll(self, timeout: float) -> bool:
        readable, _, _ = select.select([self.sock], [], [], timeout)
        return bool(readable)


def serve(channel: Channel) -> None:
    raw = recv_frame(channel.sock)
    if raw is None:
        return
    options = decode_options(raw)
    from runtime.preflight import problem

    with quiet():
        verdict = problem(options)
    channel.send(verdict)
    if verdict.problem is not None:
        return
    try:
        from runtime.bootstrap import build_engine, engine_paths
        from runtime.model.generation_config import sampling_defaults

        engine, source = build_engine(options)
        defaults = sampling_defaults(source, options.generation_config)
        paths = engine_paths(engine)
    except Exception as exc:  # noqa: BLE001 - reported to the server, which shows it to the user
        log.error("model load failed: %s", exc)
        channel.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    channel.send(Ready(model=source.name, max_model_len=engine.config.max_model_len,
                       dtype=str(engine.cache.dtype).removeprefix("torch."), device=str(engine.device),
                       num_blocks=engine.config.num_blocks, block_size=engine.config.block_size,
                       verifiers=tuple(sorted(engine.scorers)), quantize=engine.quantized.mode,
                       tool_call_format=engine.gate.tool_format, reasoning_format=engine.reasoning_format,
                       block_types=engine.quantized.block_types, sampling_defaults=defaults,
                       paths=paths))
    log.info("runtime ready: %s", source.name)
    from runtime.search.answers import warm_up

    # After Ready, so start-up does not wait for it; a first search finding it under way waits on the GIL.
    threading.Thread(target=warm_up, name="ponder-warm-up", daemon=True).start()
    try:
        _loop(channel, engine, options)
    except DeviceFailure:
        raise  # the device is gone: closing would touch it again; the server restarts this process
    except BaseException:
        engine.close()
        raise
    engine.close()


class DeviceFailure(Exception):
    """The accelerator failed in a way no later step recovers from: the process must end."""


def is_device_failure(exc: BaseException, device) -> bool:
    """Whether `exc` left the device unusable.

    A CUDA error (an illegal memory access, a device-side assert) is sticky: the context is broken
    and every later kernel fails too, so failing the running requests and serving on would fail
    every request after them. Out-of-memory is not sticky and is not counted here. Where the
    exception alone does not tell, a synchronisation does: it raises again on a broken context.
    """
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, torch.AcceleratorError) or "CUDA error" in str(exc):
        return True
    if getattr(device, "type", None) != "cuda":
        return False
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return True
    return False


class Stop(Exception):
    """SIGTERM: leave the loop and close the engine (which keeps its prefix cache on disk)."""


def _loop(channel: Channel, engine, options) -> None:
    from runtime.requests.state import detokenize, tokenize  # imports torch: only once the model loaded

    last_stats = 0.0
    while True:
        timeout = 0.0 if engine.has_work else 0.05
        while channel.poll(timeout):
            raw = recv_frame(channel.sock)
            if raw is None:
                return
            message = decode_to_runtime(raw)
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AbortRequest):
                engine.abort(message.request_id)
            elif isinstance(message, GenerateRequest):
                for out in engine.add_request(message):
                    channel.send(out)
            elif isinstance(message, RewardRequest):
                for out in engine.add_rewards(message):
                    channel.send(out)
            elif isinstance(message, TokenizeRequest):
                channel.send(tokenize(message, engine.tokenizer, engine.config.max_model_len))
            elif isinstance(message, DetokenizeRequest):
                channel.send(detokenize(message, engine.tokenizer, engine.vocab_size))
            timeout = 0.0
        if engine.has_work:
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug: fail the running requests, keep serving
                if is_device_failure(exc, engine.device):
                    raise DeviceFailure(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
                detail = traceback.format_exc()
                log.error("engine step failed:\n%s", detail)
                for request_id in [*engine.requests, *engine.searches, *engine.rewards]:
                    engine.abort(request_id)
                    channel.send(RequestError(request_id=request_id, status=500, type="server_error",
                                              message="internal error in the runtime step"))
                continue
            channel.send_all(outputs)
            if not engine.has_work:
                check_when_idle(engine)
        now = time.monotonic()
        if now - last_stats >= options.stats_interval_s:
            channel.send(engine.runtime_stats())
            last_stats = now


@contextlib.contextmanager
def quiet():
    """The settings check speaks only through its verdict: no progress bars, and no log records
    (transformers sends its load report to the root logger where `CI` is set). The load that follows
    logs what it finds."""
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def check_when_idle(engine) -> bool:
    """The engine's invariants (its block pool against the sequences holding blocks, the verifier
    stores' pools, the tiers below compute), checked each time the engine runs out of work: True when
    they hold. A broken one is a bug: it is logged with its reason, and serving goes on."""
    try:
        engine.check_integrity()
    except AssertionError as exc:
        log.error("the engine's integrity check failed when idle: %s", exc or "an invariant does not hold")
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.process")
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PONDER_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = socket.socket(fileno=args.fd)

    def stop(signum, frame):
        raise Stop()

    signal.signal(signal.SIGTERM, stop)
    try:
        serve(Channel(sock))
    except (BrokenPipeError, ConnectionResetError, Stop):
        pass
    except DeviceFailure as exc:
        # Exiting closes the socket: the server fails every open request and restarts the runtime.
        log.critical("the device failed and cannot recover (%s): exiting so the server restarts the runtime", exc)
        sys.exit(DEVICE_FAILURE_EXIT)
    finally:
        # The server ends this process once its socket closes: a SIGTERM now has nothing left to stop.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sock.close()


if __name__ == "__main__":
    main()
