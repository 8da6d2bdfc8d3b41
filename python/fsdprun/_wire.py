"""The wires of fsdprun's snapshots: the node's agent over its abstract Unix socket (JSON
requests, a piece's memfd passed with SCM_RIGHTS), another node's agent over TCP (length-prefixed
JSON frames, then a piece's bytes)."""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import threading
from typing import Any, Dict, Optional, Tuple

MAX_MESSAGE = 1 << 18


class Keeper:
    """The node's agent, over its Unix socket; one request at a time."""

    def __init__(self, name: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._sock.settimeout(120)
        self._sock.connect("\0" + name)
        self._lock = threading.Lock()

    def ask(self, request: Dict[str, Any], fd: Optional[int] = None) -> Tuple[Dict[str, Any], Optional[int]]:
        with self._lock:
            payload = json.dumps(request).encode()
            if fd is None:
                self._sock.send(payload)
            else:
                socket.send_fds(self._sock, [payload], [fd])
            data, fds, _, _ = socket.recv_fds(self._sock, MAX_MESSAGE, 1)
        if not data:
            raise ConnectionError("the agent's snapshot keeper closed the connection")
        return json.loads(data), (fds[0] if fds else None)


def write_frame(sock: socket.socket, text: str) -> None:
    data = text.encode()
    sock.sendall(struct.pack("=I", len(data)) + data)


def read_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer keeper closed the stream")
        out += chunk
    return bytes(out)


def read_frame(sock: socket.socket) -> Dict[str, Any]:
    (length,) = struct.unpack("=I", read_exact(sock, 4))
    if length > 65536:
        raise ConnectionError(f"a frame of {length} bytes from the peer keeper")
    return json.loads(read_exact(sock, length))


def connect(endpoint: str, timeout: float) -> socket.socket:
    host, _, port = endpoint.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_piece(sock: socket.socket, fd: int, size: int) -> None:
    """The first `size` bytes of the file `fd` down `sock`, with the kernel's sendfile.

    socket.sendfile, not os.sendfile: a socket with a timeout is non-blocking underneath, and
    os.sendfile gives EAGAIN once the send buffer (a few MB) is full."""
    with open(fd, "rb", closefd=False) as piece:
        if sock.sendfile(piece, 0, size) != size:
            raise ConnectionError("the piece was not sent whole")


def receive_piece(sock: socket.socket, size: int) -> int:
    """The next `size` bytes of `sock`, received straight into a new memfd (no copy in between:
    a piece can be most of a node's memory); returns the memfd."""
    fd = os.memfd_create("fsdprun-fetched", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        if size > 0:
            with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                with memoryview(m) as view:
                    got = 0
                    while got < size:
                        n = sock.recv_into(view[got:], min(size - got, 1 << 24))
                        if n == 0:
                            raise ConnectionError(f"the peer keeper closed the stream after {got} of {size} bytes")
                        got += n
    except BaseException:
        os.close(fd)
        raise
    return fd
