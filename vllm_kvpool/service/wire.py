"""The pool service's wire protocol: length-prefixed, versioned, size-capped JSON messages over a
Unix stream socket, with file descriptors (the shared host pools) passed as ``SCM_RIGHTS``.

A frame is a 12-byte header ``b"KVPS" | version u16 | flags u16 | length u32`` (network order)
followed by ``length`` bytes of UTF-8 JSON: one object with a string ``op`` (requests) or a
boolean ``ok`` (replies). A frame whose header is wrong, whose length is over ``MAX_MESSAGE`` or
that ends early cannot be resynchronised: the service answers with the reason and closes the
connection. A well-framed body that is not a valid message gets an error reply and the
connection goes on. Block hashes travel as hex strings. Nothing here touches the pool.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping, Sequence
from typing import Any

MAGIC = b"KVPS"
VERSION = 1
HEADER = struct.Struct("!4sHHI")
MAX_MESSAGE = 16 * 2**20  # a lookup of a 1M-token prompt in 16-token blocks is ~4.5 MiB of hex
MAX_FDS = 64


class WireError(ValueError):
    """A message that breaks the protocol; ``fatal``: the stream cannot be read on."""

    def __init__(self, reason: str, fatal: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fatal = fatal


def encode(message: Mapping[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise WireError(f"message of {len(body)} bytes is over the {MAX_MESSAGE}-byte limit")
    return HEADER.pack(MAGIC, VERSION, 0, len(body)) + body


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = encode(message)
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int, what: str, fds: list[int] | None = None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if fds is not None:
            chunk, got, flags, _ = socket.recv_fds(sock, n - len(buf), MAX_FDS)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise WireError("too many file descriptors in one message", fatal=True)
        else:
            chunk = sock.recv(n - len(buf))
        if not chunk:
            if not buf and what == "header":
                raise EOFError("peer closed the connection")
            raise WireError(f"truncated {what}: {len(buf)} of {n} bytes", fatal=True)
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket, with_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """One message and the fds that came with it. ``EOFError`` on a clean close between
    messages, ``WireError`` on anything else that is not a message."""
    fds: list[int] | None = [] if with_fds else None
    header = _recv_exact(sock, HEADER.size, "header", fds)
    magic, version, _flags, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r} (not a kvpool service message)", fatal=True)
    if version != VERSION:
        raise WireError(f"protocol version {version}, this service speaks {VERSION}", fatal=True)
    if length > MAX_MESSAGE:
        raise WireError(f"message of {length} bytes is over the {MAX_MESSAGE}-byte limit",
                        fatal=True)  # fmt: skip
    body = _recv_exact(sock, length, "body", fds)
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"body is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise WireError(f"body is a {type(message).__name__}, not an object")
    return message, list(fds or [])


def close_fds(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- typed fields: every request field is checked here, a bad one named in the error ----------
def field(msg: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
          default: Any = ...) -> Any:  # fmt: skip
    if name not in msg:
        if default is ...:
            raise WireError(f"field {name!r} is missing")
        return default
    value = msg[name]
    if isinstance(value, bool) and kind in (int, float):
        raise WireError(f"field {name!r}: expected {kind.__name__}, got bool")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise WireError(f"field {name!r}: expected {want}, got {type(value).__name__}")
    return value


def int_list(msg: Mapping[str, Any], name: str) -> list[int]:
    values = field(msg, name, list)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise WireError(f"field {name!r}: expected a list of integers")
    return values


def hash_of(value: Any, name: str) -> bytes:
    if not isinstance(value, str) or len(value) > 256:
        raise WireError(f"field {name!r}: expected a hex block hash")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise WireError(f"field {name!r}: {value[:40]!r} is not hex") from None


def hashes(msg: Mapping[str, Any], name: str) -> list[bytes]:
    values = field(msg, name, list)
    return [hash_of(v, f"{name}[{i}]") for i, v in enumerate(values)]


def hexes(values: Sequence[bytes]) -> list[str]:
    return [v.hex() for v in values]

