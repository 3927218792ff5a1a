"""The runtime process's step loop: a bug in a step fails the running requests and serving goes on;
a sticky device error (CUDA's illegal memory access, a device-side assert) ends the process, so the
server's supervisor restarts it instead of every later step failing the same way."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from runtime import process
from runtime.wire.framing import recv_frame, send_frame, send_frames
from runtime.wire.params import SamplingParams
from runtime.wire.protocol import (
    GenerateRequest, Ready, RequestError, SettingsChecked, decode_from_runtime, encode,
)
from runtime.wire.options import RuntimeOptions


class FakeEngine:
    """Two running requests; every step raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.requests = {"a": object(), "b": object()}
        self.searches: dict = {}
        self.rewards: dict = {}
        self.aborted: list[str] = []
        self.device = torch.device("cpu")

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self):
        raise self.error

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def runtime_stats(self):
        return RuntimeOptions()  # any wire message will do


class Recorder:
    """A channel that records what is sent and ends the loop once the engine is idle."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)

    def send_all(self, messages) -> None:
        self.sent.extend(messages)

    def poll(self, timeout: float) -> bool:
        if not self.engine.has_work:
            raise process.Stop()  # the loop went back to waiting: it kept serving
        return False


def test_a_failing_step_fails_the_running_requests_and_serving_goes_on():
    engine = FakeEngine(RuntimeError("shape mismatch in a bug"))
    channel = Recorder(engine)
    with pytest.raises(process.Stop):
        process._loop(channel, engine, SimpleNamespace(stats_interval_s=1e9))
    errors = [m for m in channel.sent if isinstance(m, RequestError)]
    assert [(e.request_id, e.status) for e in errors] == [("a", 500), ("b", 500)]
    assert engine.aborted == ["a", "b"]


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered"),
])
def test_a_sticky_device_error_ends_the_loop(error):
    engine = FakeEngine(error)
    channel = Recorder(engine)
    with pytest.raises(process.DeviceFailure, match="CUDA error"):
        process._loop(channel, engine, SimpleNamespace(stats_interval_s=1e9))
    assert not [m for m in channel.sent if isinstance(m, RequestError)]  # the server fails them on exit


def test_out_of_memory_is_not_a_device_failure():
    assert not process.is_device_failure(torch.OutOfMemoryError("CUDA out of memory"), torch.device("cuda"))
    assert not process.is_device_failure(RuntimeError("index out of range"), torch.device("cpu"))


SCRIPT = textwrap.dedent("""
    import sys, torch
    from types import SimpleNamespace
    import runtime.bootstrap
    from runtime import process

    class Engine:
        device = torch.device("cpu")
        config = SimpleNamespace(max_model_len=64, num_blocks=4, block_size=16)
        cache = SimpleNamespace(dtype=torch.float32)
        quantized = SimpleNamespace(mode="none", block_types=())
        gate = SimpleNamespace(tool_format="hermes")
        model = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
        runner = SimpleNamespace(decoder=None, attention_kernel=None, recurrent=None)
        reasoning_format = "none"
        scorers = {}
        requests = {}
        searches = {}
        closed = False
        @property
        def has_work(self):
            return bool(self.requests)
        def add_request(self, request):
            self.requests[request.request_id] = request
            return []
        def step(self):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        def close(self):
            print("closed", file=sys.stderr)
        def runtime_stats(self):
            raise AssertionError("no statistics are due")

    runtime.bootstrap.build_engine = lambda options: (Engine(), SimpleNamespace(name="fake", directory="", gguf_file="fake.gguf"))
    process.main(sys.argv[1:])
""")


def test_the_process_exits_with_a_clear_line_on_a_device_failure():
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, "--fd", str(child.fileno())],
                            pass_fds=[child.fileno()], stderr=subprocess.PIPE)
    child.close()
    try:
        send_frame(parent, encode(RuntimeOptions(stats_interval_s=1e9)))
        assert decode_from_runtime(recv_frame(parent)) == SettingsChecked()  # first: the settings hold
        assert isinstance(decode_from_runtime(recv_frame(parent)), Ready)
        send_frame(parent, encode(GenerateRequest(request_id="r", endpoint="completion", prompt_token_ids=(1, 2),
                                                  sampling=SamplingParams(max_tokens=4))))
        assert recv_frame(parent) is None  # the process ended: the server sees the socket close
        assert proc.wait(timeout=60) == process.DEVICE_FAILURE_EXIT
        stderr = proc.stderr.read().decode()
    finally:
        parent.close()
        if proc.poll() is None:
            proc.kill()
    assert "the device failed and cannot recover (CUDA error: an illegal memory access" in stderr
    assert "closed" not in stderr  # nothing touches the broken device on the way out


class IdleEngine:
    """One step of work, then idle; its integrity check fails with `broken` (None: it holds)."""

    def __init__(self, broken: str | None) -> None:
        self.broken = broken
        self.steps = 0
        self.checks = 0
        self.requests: dict = {}
        self.searches: dict = {}
        self.rewards: dict = {}
        self.device = torch.device("cpu")

    @property
    def has_work(self) -> bool:
        return self.steps == 0

    def step(self):
        self.steps += 1
        return []

    def check_integrity(self) -> None:
        self.checks += 1
        if self.broken is not None:
            raise AssertionError(self.broken)

    def runtime_stats(self):
        return RuntimeOptions()


@pytest.mark.parametrize("broken", [None, "ref_counts do not match the block tables holding them"])
def test_the_loop_checks_the_engine_each_time_it_runs_out_of_work_and_serving_goes_on(broken, caplog):
    engine = IdleEngine(broken)
    with pytest.raises(process.Stop), caplog.at_level("ERROR", logger="ponder.runtime"):
        process._loop(Recorder(engine), engine, SimpleNamespace(stats_interval_s=1e9))
    assert (engine.steps, engine.checks) == (1, 1)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert errors == ([] if broken is None else [f"the engine's integrity check failed when idle: {broken}"])


def test_a_real_engine_passes_its_idle_check_after_a_search_and_a_plain_request(tiny_llama):
    from tests.runtime.engine_helpers import engine_for
    from runtime.wire.params import SearchParams

    engine = engine_for(tiny_llama, num_blocks=128)
    for request_id, search in (("plain", None), ("search", SearchParams(strategy="beam", n=4, max_steps=2,
                                                                        max_step_tokens=4))):
        engine.add_request(GenerateRequest(request_id=request_id, endpoint="completion", prompt="w1 w2 w3",
                                           sampling=SamplingParams(max_tokens=8, temperature=1.0, seed=3),
                                           search=search))
        while engine.has_work:
            engine.step()
        assert process.check_when_idle(engine)
    engine.pool.ref_counts[0] += 1  # a block nobody holds
    assert not process.check_when_idle(engine)


def test_a_step_s_outputs_go_in_one_write_and_arrive_as_frames():
    """send_frames: several frames in one write, read back one by one as if sent apart."""
    parent, child = socket.socketpair()
    with parent, child:
        payloads = [b"first", b"", b"x" * 70000]
        send_frames(child, payloads)
        send_frames(child, [])  # nothing to send: nothing written
        send_frame(child, b"last")
        assert [recv_frame(parent) for _ in range(4)] == [*payloads, b"last"]
