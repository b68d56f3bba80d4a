"""Who signed what in secure aggregation: each client's long-term Ed25519 signing key, and
the operator's roster of their public keys, which the server can neither forge nor change.

What binds a key to an identity is the roster: a JSON file `{client id: public key hex}`
that the operator hands to every client out of band, beside its token (fedcore.launch
writes a fresh one per course, with one private key file per client, mode 0600, and
deletes them at the end). A client trusts a neighbour's keys, a survivor list or a
share only under a signature that verifies against the roster entry of the id it
claims. In simulation the course makes every key in-process. A deployed secure course
without a roster is refused (see `_check` in secagg_settings): with keys the server
relays, an active server could sign for everyone, and the consistency check would hold
against an honest server only.

The statements signed are domain-separated byte strings that carry the round, so a
signature from one round or one stage is no signature in another.
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fedcore.comm.stream import write_secret
from fedcore.kernel.files import write_atomic

__all__ = ["SIGNATURE_BYTES", "new_signing_key", "sign", "verify", "public_hex", "write_roster",
           "load_roster", "load_signing_key", "keys_statement", "shares_statement", "survivors_statement",
           "key_digest", "Identity", "course_identity", "main"]

SIGNATURE_BYTES = 64


def new_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def public_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes_raw().hex()


def sign(key: Ed25519PrivateKey, statement: bytes) -> bytes:
    return key.sign(statement)


def verify(roster: dict[int, bytes], signer: int, statement: bytes, signature: bytes) -> bool:
    """Whether `signature` is `signer`'s (by the roster) on `statement`."""
    public = roster.get(signer)
    if public is None or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, statement)
        return True
    except (InvalidSignature, ValueError):
        return False


# ---------------------------------------------------------------- files
def write_roster(folder: str | Path, ids: list[int]) -> tuple[Path, dict[int, Path]]:
    """One private key file per client (0600) and the roster of their public keys."""
    folder = Path(folder)
    roster, paths = {}, {}
    for k in ids:
        key = new_signing_key()
        roster[str(k)] = public_hex(key)
        paths[k] = folder / f"secagg_client_{k}.key"
        write_secret(paths[k], key.private_bytes_raw().hex() + "\n")
    path = folder / "secagg_roster.json"
    write_atomic(path, json.dumps(roster, indent=1) + "\n")   # a link planted there is replaced, not followed
    return path, paths


def load_roster(path: str | Path) -> dict[int, bytes]:
    """The roster's {id: 32-byte Ed25519 public key}; ValueError with the reason if malformed."""
    try:
        raw = json.loads(Path(path).read_text())
        roster = {int(k): bytes.fromhex(v) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"secure_aggregation.roster: cannot read {path}: {exc}") from None
    if not roster or any(len(v) != 32 for v in roster.values()):
        raise ValueError(f"secure_aggregation.roster: {path} must map client ids to 32-byte public keys (hex)")
    return roster


def load_signing_key(path: str | Path) -> Ed25519PrivateKey:
    try:
        return Ed25519PrivateKey.from_private_bytes(bytes.fromhex(Path(path).read_text().strip()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"secure_aggregation.signing_key: cannot read {path}: {exc}") from None


# ---------------------------------------------------------------- statements
def keys_statement(round_: int, client: int, cipher_key: bytes, mask_key: bytes, weight: int) -> bytes:
    """A client's round keys and declared weight, as it advertises them."""
    return b"fedcore secagg keys" + struct.pack(">IIQ", round_, client, weight) + cipher_key + mask_key


def shares_statement(round_: int, dealer: int, holder: int, ciphertext: bytes, commitments: bytes) -> bytes:
    """What a dealer sent one holder: the encrypted share pair and the commitments it lies on."""
    return (b"fedcore secagg shares" + struct.pack(">III", round_, dealer, holder)
            + hashlib.sha256(ciphertext).digest() + hashlib.sha256(commitments).digest())


def key_digest(keys: list[bytes]) -> bytes:
    return hashlib.sha256(b"".join(keys)).digest()


def survivors_statement(round_: int, survivors: list[int], digest: bytes) -> bytes:
    """The survivor set a client was shown, bound to the round keys of its members (`digest`),
    so that a signature from another course or round never vouches for this one."""
    return (b"fedcore secagg survivors" + struct.pack(">II", round_, len(survivors))
            + b"".join(struct.pack(">I", s) for s in survivors) + digest)


# ---------------------------------------------------------------- the course's keys
class Identity:
    """The roster, and the signing keys this process holds: every client's in simulation,
    its own in a deployed client, none in a deployed server."""

    def __init__(self, roster: dict[int, bytes], keys: dict[int, Ed25519PrivateKey]):
        self.roster, self.keys = roster, keys

    def signing_key(self, client_id: int) -> Ed25519PrivateKey:
        key = self.keys.get(client_id)
        if key is None or key.public_key().public_bytes_raw() != self.roster.get(client_id):
            raise ValueError(f"secure_aggregation.signing_key: not client {client_id}'s key in the roster")
        return key


def course_identity(course) -> Identity:
    """The course's identity keys, made on first use: generated in-process in simulation (the
    simulated operator hands out the roster), read from the configured files in deployment."""
    ident = getattr(course, "secagg_identity", None)
    if ident is not None:
        return ident
    cfg = course.cfg
    if cfg["distribute.role"] is None:
        keys = {k: new_signing_key() for k in range(1, cfg["federate.client_num"] + 1)}
        ident = Identity({k: key.public_key().public_bytes_raw() for k, key in keys.items()}, keys)
    else:
        roster = load_roster(cfg["secure_aggregation.roster"])
        keys = {}
        if cfg["distribute.role"] == "client":
            key = load_signing_key(cfg["secure_aggregation.signing_key"])
            keys = {k: key for k, public in roster.items() if public == key.public_key().public_bytes_raw()}
            if not keys:
                raise ValueError(f"secure_aggregation.signing_key: {cfg['secure_aggregation.signing_key']} "
                                 "is no client's key in the roster")
        ident = Identity(roster, keys)
    course.secagg_identity = ident
    return ident


def main(argv: list[str] | None = None) -> int:
    """`python -m fedcore.algorithms.secagg_identity --out DIR --clients N`: what an operator
    hands out: DIR/secagg_client_<k>.key to client k, DIR/secagg_roster.json to everyone."""
    import argparse
    parser = argparse.ArgumentParser(prog="python -m fedcore.algorithms.secagg_identity")
    parser.add_argument("--out", required=True, help="folder for the key files and the roster")
    parser.add_argument("--clients", type=int, required=True, help="client ids 1..N")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    roster, _ = write_roster(args.out, list(range(1, args.clients + 1)))
    print(roster)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
