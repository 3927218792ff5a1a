"""Length-prefixed frames over a stream socket: a 4-byte little-endian length, then the payload."""

from __future__ import annotations

import socket
import struct

HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(HEADER.pack(len(payload)) + payload)


def send_frames(sock: socket.socket, payloads: list[bytes]) -> None:
    """Several frames in one write: the reader sees them as one after another, as sent one at a time
    (a decode step's outputs, one a stream: one system call and one wake-up of the reader, not 16)."""
    if payloads:
        sock.sendall(b"".join(HEADER.pack(len(payload)) + payload for payload in payloads))


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> bytes | None:
    """The next frame, or None when the peer closed the connection."""
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes is over the limit")
    return _recv_exactly(sock, size) if size else b""
