"""Mutual challenge-response over a fresh connection, keyed by the cluster secret.

    client -> server   "MCAU" | version u8 | client nonce (32 B)
    server -> client   server nonce (32 B) | HMAC-SHA256(secret, "mc-server" | cn | sn)
    client -> server   HMAC-SHA256(secret, "mc-client" | cn | sn)
    server -> client   0x01 (accepted); a refused client is logged and the socket closed

Both sides prove knowledge of the secret over nonces the other chose, so a recorded exchange
cannot be replayed, and the distinct labels keep a server's proof from being reflected back
as a client's. The secret itself never crosses the wire. Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

MAGIC = b"MCAU"
VERSION = 1
NONCE = 32
MAC = 32
HELLO_SIZE = len(MAGIC) + 1 + NONCE
ACCEPTED = b"\x01"
HANDSHAKE_TIMEOUT_S = 5.0


class AuthError(Exception):
    """The peer did not prove knowledge of the cluster secret (or spoke something else)."""


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes | bytearray) or len(secret) == 0:
        raise ValueError("the cluster secret must be non-empty bytes")
    return bytes(secret)


def proof(secret: bytes, label: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, label + client_nonce + server_nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed during handshake")
        got += k
    return bytes(buf)


def client_handshake(sock: socket.socket, secret: bytes) -> None:
    """Prove ourselves to a server and check its proof; AuthError if it fails."""
    cn = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + bytes([VERSION]) + cn)
    reply = recv_exact(sock, NONCE + MAC)
    sn, server_mac = reply[:NONCE], reply[NONCE:]
    if not hmac.compare_digest(server_mac, proof(secret, b"mc-server", cn, sn)):
        raise AuthError("server does not know the cluster secret")
    sock.sendall(proof(secret, b"mc-client", cn, sn))
    try:
        ok = recv_exact(sock, 1)
    except ConnectionError:
        raise AuthError("server refused our proof (wrong cluster secret?)") from None
    if ok != ACCEPTED:
        raise AuthError("server refused the handshake")


def server_handshake(sock: socket.socket, secret: bytes) -> None:
    """Check a client's proof and prove ourselves; AuthError if it fails (caller closes)."""
    hello = recv_exact(sock, HELLO_SIZE)
    if hello[: len(MAGIC)] != MAGIC or hello[len(MAGIC)] != VERSION:
        raise AuthError(f"not a mooncake handshake: {hello[:8]!r}")
    cn = hello[len(MAGIC) + 1 :]
    sn = secrets.token_bytes(NONCE)
    sock.sendall(sn + proof(secret, b"mc-server", cn, sn))
    client_mac = recv_exact(sock, MAC)
    if not hmac.compare_digest(client_mac, proof(secret, b"mc-client", cn, sn)):
        raise AuthError("client does not know the cluster secret")
    sock.sendall(ACCEPTED)
