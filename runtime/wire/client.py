"""The HTTP process's handle on the runtime process: spawn, handshake, typed messages, restarts.

Imports no torch: the runtime is a child process (`python -m runtime.process`) that talks over a
socket pair. If it dies, every open request ends with an error at once and the runtime is started
again with exponential backoff; `state` tells the health endpoint where things stand.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

from runtime.wire.framing import HEADER, recv_frame, send_frame
from runtime.wire.protocol import (
    AbortRequest, Accepted, Delta, Detokenized, DetokenizeRequest, Finished, FromRuntime, GenerateRequest, LoadFailed,
    LoadProgress, Ready, RequestError, Rewarded, RewardRequest, RuntimeStats, SearchEvent, SearchTree,
    SettingsChecked, Shutdown, Tokenized, TokenizeRequest, decode_from_runtime, encode,
)
from runtime.wire.options import RuntimeOptions

log = logging.getLogger("ponder.client")

LOADING, READY, DEAD, STOPPED = "loading", "ready", "dead", "stopped"


class RuntimeUnavailable(RuntimeError):
    pass


class RequestHandle:
    """Messages for one request, in order, ending with `Finished` or `RequestError`."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[FromRuntime] = asyncio.Queue()
        self.done = False

    async def messages(self) -> AsyncIterator[Accepted | Delta | SearchEvent | Finished | RequestError]:
        while True:
            message = await self.queue.get()
            yield message
            if isinstance(message, (Finished, RequestError)):
                self.done = True
                return


def runtime_environment() -> dict[str, str]:
    """The environment for a runtime child process: it imports `runtime` from where this one did."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


class SpawnedRuntime:
    """A runtime process started, and sent its options, before there is an event loop: `ponder serve`
    starts it first, so that its imports and its settings check run while the HTTP side imports, and
    reads its verdict (`settings_checked`) before binding a port. The client then adopts it."""

    def __init__(self, options: RuntimeOptions) -> None:
        self.sock, child = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.process", "--fd", str(child.fileno())],
                                     pass_fds=[child.fileno()], env=runtime_environment())
        child.close()
        send_frame(self.sock, encode(options))

    def settings_checked(self) -> SettingsChecked:
        """The runtime's verdict on the settings (blocks until it has imported and checked them)."""
        raw = recv_frame(self.sock)
        message = decode_from_runtime(raw) if raw is not None else None
        if isinstance(message, SettingsChecked):
            return message
        status = self.proc.wait()
        return SettingsChecked(problem=f"the runtime process exited with status {status} before checking the "
                                       "settings", status=1)

    def close(self, grace_s: float = 10.0) -> None:
        """End the process: after a refused verdict it ends by itself (a signal during its exit would
        print a traceback under the verdict's one line); it is terminated if it has not in `grace_s`."""
        self.sock.close()
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            self.proc.wait()


class RuntimeClient:
    def __init__(self, options: RuntimeOptions, on_stats: Callable[[RuntimeStats], None] | None = None,
                 on_state: Callable[[str], None] | None = None, max_backoff_s: float = 30.0,
                 load_timeout_s: float = 600.0, on_tree: Callable[[SearchTree], None] | None = None,
                 spawned: SpawnedRuntime | None = None) -> None:
        self.options = options
        self._spawned = spawned  # a first runtime already started (its settings checked): adopted, not spawned
        self.on_stats = on_stats
        self.on_state = on_state
        self.on_tree = on_tree  # search trees go here, never to the request's own messages
        self.max_backoff_s = max_backoff_s
        self.load_timeout_s = load_timeout_s
        self.state = STOPPED
        self.info: Ready | None = None
        self.load_error: str | None = None
        self.num_restarts = 0
        self._handles: dict[str, RequestHandle] = {}
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._supervisor: asyncio.Task | None = None
        self._ready = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, wait: bool = True) -> None:
        self._supervisor = asyncio.create_task(self._supervise())
        if wait:
            await self.wait_ready()

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout or self.load_timeout_s)
        if self.state != READY:
            raise RuntimeUnavailable(self.load_error or "the runtime did not start")

    async def stop(self) -> None:
        """Ask the runtime to shut down cleanly (it keeps its disk-tier prefix cache), then end it."""
        proc = self._proc
        if proc is not None and self._writer is not None:
            with contextlib.suppress(Exception):
                self._send(Shutdown())
                await self._writer.drain()
            for _ in range(100):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        self._set_state(STOPPED)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _set_state(self, state: str) -> None:
        self.state = state
        if self.on_state is not None:
            self.on_state(state)

    async def _supervise(self) -> None:
        backoff = 1.0
        try:
            while True:
                self.load_error = None
                loaded = await self._run_once()
                if not loaded and self.load_error is not None:
                    self._ready.set()  # the model cannot load: say so instead of retrying forever
                    return
                if loaded:
                    backoff = 1.0  # it ran: start the backoff over
                self.num_restarts += 1
                log.warning("runtime exited; restarting in %.0f s", backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
        finally:
            await self._kill()

    async def _run_once(self) -> bool:
        """Run one runtime process until it exits. Returns whether it became ready."""
        self._set_state(LOADING)
        spawned, self._spawned = self._spawned, None
        if spawned is None:
            spawned = SpawnedRuntime(self.options)
        parent, self._proc = spawned.sock, spawned.proc
        reader, self._writer = await asyncio.open_unix_connection(sock=parent)
        became_ready = False
        try:
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                    payload = await reader.readexactly(HEADER.unpack(header)[0])
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                message = decode_from_runtime(payload)
                if isinstance(message, Ready):
                    self.info = message
                    became_ready = True
                    self._set_state(READY)
                    self._ready.set()
                elif isinstance(message, LoadFailed):
                    self.load_error = message.message
                    log.error("the runtime could not load the model: %s", message.message)
                elif isinstance(message, SettingsChecked):
                    if message.problem is not None:  # settings that held at start-up no longer do
                        self.load_error = message.problem
                        log.error("the runtime refused its settings: %s", message.problem)
                elif isinstance(message, LoadProgress):
                    log.info("%s", message.message)
                elif isinstance(message, RuntimeStats):
                    if self.on_stats is not None:
                        self.on_stats(message)
                elif isinstance(message, SearchTree):
                    self._dispatch_tree(message)
                else:
                    self._dispatch(message)
        finally:
            self._writer = None
            with contextlib.suppress(Exception):
                parent.close()
            await self._kill()
            self._fail_all(became_ready)
            self._set_state(DEAD)
        return became_ready

    async def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            for _ in range(50):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            else:
                proc.kill()
                proc.wait()

    def _fail_all(self, was_ready: bool) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            handle.queue.put_nowait(RequestError(
                request_id=handle.request_id, status=503, type="server_error", code="runtime_unavailable",
                message="the inference runtime stopped while serving this request; it is being restarted"))

    def _dispatch(self, message: FromRuntime) -> None:
        handle = self._handles.get(message.request_id)
        if handle is None:
            return  # aborted earlier; late messages are dropped
        if isinstance(message, (Finished, RequestError, Tokenized, Detokenized, Rewarded)):  # a request's last message
            del self._handles[message.request_id]
        handle.queue.put_nowait(message)

    def _dispatch_tree(self, message: SearchTree) -> None:
        if self.on_tree is None or message.request_id not in self._handles:
            return  # nobody watches, or the request was aborted
        try:
            self.on_tree(message)
        except Exception:  # a fault in the page's store must not end the runtime's stream
            log.exception("could not apply a search tree update")

    def _send(self, message) -> None:
        if self._writer is None:
            raise RuntimeUnavailable("the inference runtime is not running")
        payload = encode(message)
        self._writer.write(HEADER.pack(len(payload)) + payload)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request: GenerateRequest | TokenizeRequest | DetokenizeRequest | RewardRequest) -> RequestHandle:
        if self.state != READY:
            raise RuntimeUnavailable("the inference runtime is not ready")
        self._send(request)  # first: a request that cannot be sent leaves no handle behind
        handle = RequestHandle(request.request_id)
        self._handles[request.request_id] = handle  # the reader runs on this loop, after we return
        return handle

    async def ask(self, request: TokenizeRequest | DetokenizeRequest | RewardRequest
                  ) -> Tokenized | Detokenized | Rewarded | RequestError:
        """A request with one answer (tokenize, detokenize, rewards): the answer, or the RequestError."""
        handle = self.submit(request)
        try:
            return await handle.queue.get()
        finally:
            self.abort(request.request_id)  # asked while still open: the client went away (its answer came: a no-op)

    def abort(self, request_id: str) -> None:
        if self._handles.pop(request_id, None) is not None and self._writer is not None:
            self._send(AbortRequest(request_id))

    def shutdown(self) -> None:
        if self._writer is not None:
            self._send(Shutdown())
