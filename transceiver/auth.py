"""Who may open a transfer or shard link: the engines of this deployment, proven by its secret.

Listeners bind the node's address, so anyone who can reach the port can connect. Every link
therefore opens with a challenge–response over a per-deployment secret (the Coordinator makes
one and hands it to every engine; nothing else knows it):

    connecting side                                  accepting side
                                <------------------  Challenge(a)            a: 16 random bytes
    Hello(..., c, HMAC(secret, "connect" a c)) --->  checked before anything else is read or
                                                     done (else TransferError "unauthenticated")
                                <------------------  Hello(..., a, HMAC(secret, "accept" a c))
    checked before anything is sent

Fresh nonces on both sides make every proof good for one link only (a recorded handshake
cannot be replayed), and the role in the MAC keeps one side's proof from passing as the other's.
Until a peer has proven itself, a listener accepts at most CONTROL_MAX_BYTES per message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets

from hybridserve.transceiver.channel import Channel, TransferFailed
from hybridserve.transceiver.layout import LayoutMismatch
from hybridserve.transceiver.protocol import CONTROL_MAX_BYTES, Challenge, Hello, TransferError

NONCE_BYTES = 16
MIN_SECRET_BYTES = 16
_CONNECT, _ACCEPT = b"hybridserve-connect", b"hybridserve-accept"


class Unauthenticated(TransferFailed):
    """The peer could not prove that it holds this deployment's transfer secret."""


def new_secret() -> str:
    """A deployment's transfer secret, as the Coordinator makes it (hex)."""
    return secrets.token_hex(32)


def _proof(secret: bytes, role: bytes, accept_nonce: bytes, connect_nonce: bytes) -> bytes:
    return hmac.new(secret, role + accept_nonce + connect_nonce, hashlib.sha256).digest()


def _matches(proof: object, expected: bytes) -> bool:
    """Constant-time, and false for a proof of the wrong type (the peer's fields are as sent)."""
    return isinstance(proof, bytes) and hmac.compare_digest(proof, expected)


@dataclasses.dataclass(frozen=True)
class AcceptedHello:
    """A connecting peer's Hello whose proof held; `answer` it with ours."""

    hello: Hello
    accept_nonce: bytes


class PeerAuth:
    """Both halves of the handshake, for one deployment's secret."""

    def __init__(self, secret: str | bytes) -> None:
        key = bytes.fromhex(secret) if isinstance(secret, str) else secret
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the transfer secret has {len(key)} bytes; at least {MIN_SECRET_BYTES} are "
                "needed (auth.new_secret() makes one)"
            )
        self._key = key

    def connect(self, channel: Channel, hello: Hello) -> Hello:
        """Connecting side: answer the peer's challenge with `hello`; returns the peer's Hello
        once its proof holds (Unauthenticated otherwise; LayoutMismatch if it refused ours)."""
        challenge = channel.receive(max_bytes=CONTROL_MAX_BYTES)
        if not isinstance(challenge, Challenge) or len(challenge.nonce) != NONCE_BYTES:
            raise TransferFailed(f"expected a Challenge from the transfer peer, got {challenge!r}")
        accept_nonce, connect_nonce = challenge.nonce, secrets.token_bytes(NONCE_BYTES)
        proof = _proof(self._key, _CONNECT, accept_nonce, connect_nonce)
        channel.send(dataclasses.replace(hello, nonce=connect_nonce, proof=proof))
        reply = channel.receive(max_bytes=CONTROL_MAX_BYTES)
        if isinstance(reply, TransferError):
            kind = Unauthenticated if reply.code == "unauthenticated" else LayoutMismatch
            raise kind(reply.message)
        if not isinstance(reply, Hello):
            raise TransferFailed(f"expected a Hello from the transfer peer, got {reply.type}")
        expected = _proof(self._key, _ACCEPT, accept_nonce, connect_nonce)
        if reply.nonce != accept_nonce or not _matches(reply.proof, expected):
            raise Unauthenticated(
                "the transfer peer could not prove that it belongs to this deployment (a "
                "different transfer secret, or not a hybridserve engine of ours)"
            )
        return reply

    def accept(self, channel: Channel) -> AcceptedHello:
        """Accepting side: challenge the peer; its Hello once its proof holds. A peer that
        fails is told so and Unauthenticated raised; nothing of its Hello is acted on."""
        accept_nonce = secrets.token_bytes(NONCE_BYTES)
        channel.send(Challenge(accept_nonce))
        hello = channel.receive(max_bytes=CONTROL_MAX_BYTES)
        if not isinstance(hello, Hello):
            raise TransferFailed(f"expected a Hello from the transfer peer, got {hello.type}")
        nonce = hello.nonce if isinstance(hello.nonce, bytes) else b""
        expected = _proof(self._key, _CONNECT, accept_nonce, nonce)
        if len(nonce) != NONCE_BYTES or not _matches(hello.proof, expected):
            message = (
                "this link's peer could not prove that it belongs to the deployment "
                "(a different transfer secret?)"
            )
            channel.send(TransferError("", "unauthenticated", message))
            raise Unauthenticated(message)
        return AcceptedHello(hello, accept_nonce)

    def answer(self, channel: Channel, accepted: AcceptedHello, hello: Hello) -> None:
        """Accepting side: our Hello, with our proof for this link."""
        proof = _proof(self._key, _ACCEPT, accepted.accept_nonce, accepted.hello.nonce)
        channel.send(dataclasses.replace(hello, nonce=accepted.accept_nonce, proof=proof))


__all__ = ["AcceptedHello", "PeerAuth", "Unauthenticated", "new_secret"]
