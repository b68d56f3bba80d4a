"""The client's stages of secure aggregation (SecAgg+); see handlers/secure_aggregation.py.

A client keeps one round's secrets on its worker (`client.secagg`): two fresh
X25519 key pairs (one to encrypt shares, one for pairwise masks), its
self-mask seed, its quantized input until it is masked, the neighbours' shares
that verified, and who it masked with. It trusts nothing the server says
about another client without that client's signature (algorithms/secagg_identity.py):
a neighbour key, a share or a survivor list that fails is refused, logged, and
the round aborted (`secagg_abort`); a share that is signed but bad (it does not
decrypt, or fails its Feldman check) is the dealer's fault, and is reported
with the masked input. A message for another round, or one that does not fit
the stage, is logged and ignored.
"""
from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcore.algorithms.secure_sum import mask_sign, pair_key, pair_mask
from fedcore.kernel.message import SERVER_ID
from fedcore.kernel.shamir import (SHARE_BYTES, commitments_from_bytes, commitments_to_bytes, random_secret,
                            share_from_bytes, share_to_bytes, split, verify_share)
from fedcore.kernel.worker import Stopwatch

__all__ = ["train_and_advertise", "advertise", "share_keys", "mask_input", "sign_survivors", "reveal_shares", "SHARE_INFO"]

log = logging.getLogger("fedcore.secagg")

SHARE_INFO = b"fedcore secagg share encryption"
_PAIR = struct.Struct(">II")


@dataclass
class ClientRound:
    round: int
    vector: np.ndarray | None            # w * quantize(delta) ++ [w], mod p, until masked
    cipher_key: Any                      # X25519 private keys, fresh each round
    mask_key: Any
    weight: int = 0
    threshold: int = 0
    neighbours: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # v -> (cipher pk, mask pk)
    seed: bytes = b""
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # v -> (share of v's mask key, of v's seed)
    partners: set[int] = field(default_factory=set)   # neighbours whose pairwise mask is in my input
    survivors: tuple[int, ...] | None = None          # the set I signed, with its key digest
    digest: bytes = b""
    revealed: bool = False
    aborted: bool = False


def _settings(client):
    from fedcore.algorithms.secagg_settings import Settings
    return Settings.of(client.course.cfg)


def _identity(client):
    from fedcore.algorithms.secagg_identity import course_identity
    return course_identity(client.course)


def _current(client, msg, stage: str) -> ClientRound | None:
    st = getattr(client, "secagg", None)
    if st is None or st.round != msg.round or st.aborted:
        log.info("client %d: %s for round %d ignored (no secure round open)", client.id, stage, msg.round)
        return None
    return st


def _abort(client, st: ClientRound, why: str) -> None:
    """Refuse the rest of the round: nothing more is sent for it, and the server is told why."""
    log.warning("client %d: round %d: secure aggregation refused: %s", client.id, st.round, why)
    st.aborted, st.vector = True, None
    client.send("secagg_abort", SERVER_ID, {"reason": why[:200]}, round_=st.round)


def _aad(round_: int, sender: int, receiver: int) -> bytes:
    return b"fedcore secagg round " + struct.pack(">III", round_, sender, receiver)


def train_and_advertise(client, msg) -> None:
    """Client `receiving_models`: train, quantize the update (kept here), advertise two public keys
    and the weight, signed."""
    from fedcore.algorithms.secagg_crypto import quantize
    s = _settings(client)
    client.round = msg.round
    with Stopwatch() as sw:
        result = client.course.trainer.fit(client.id, client.data, msg.content, msg.round)
    client.spend(result.work, sw.seconds)
    content = result.content
    extra = set(content) - {"model", "num_samples"}
    if extra:
        raise RuntimeError(f"secure aggregation sums model deltas only, but this algorithm's update "
                           f"also carries {sorted(extra)}")
    received = msg.content["model"]
    names = s.names(content["model"])
    delta = np.concatenate([(content["model"][n].to(torch.float64) - received[n].to(torch.float64))
                            .reshape(-1).numpy() for n in names]) if names else np.zeros(0)
    weight = s.client_weight(content["num_samples"])
    if s.dp_clip is not None:  # central DP: the server cannot clip what it cannot see
        norm = float(np.linalg.norm(delta))
        if norm > s.dp_clip:
            delta = delta * (s.dp_clip / norm)
    s.check_headroom(weight)
    q = quantize(delta, s.clip, s.bits)
    advertise(client, msg.round, np.append((q * np.uint64(weight)) % np.uint64(s.modulus), np.uint64(weight)),
              weight)


def advertise(client, round_: int, vector: np.ndarray, weight: int) -> None:
    """Keep `vector` (the input to mask, mod p, its last entry the weight) for the round, and
    advertise two fresh public keys and the weight, signed: the protocol's first client stage,
    whatever the vector sums (a model update's quantized delta, or analytics' integer sums)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from fedcore.algorithms.secagg_crypto import new_private_key, public_bytes
    from fedcore.algorithms.secagg_identity import keys_statement, sign
    # the mask key is a field element, so that its Feldman commitments can be checked
    cipher_key, mask_key = new_private_key(), X25519PrivateKey.from_private_bytes(random_secret())
    client.secagg = ClientRound(round_, vector, cipher_key, mask_key, weight)
    ck, mk = public_bytes(cipher_key), public_bytes(mask_key)
    signature = sign(_identity(client).signing_key(client.id), keys_statement(round_, client.id, ck, mk, weight))
    client.send("secagg_public_keys", SERVER_ID,
                {"cipher_key": ck, "mask_key": mk, "weight": weight, "signature": signature}, round_=round_)


def share_keys(client, msg) -> None:
    """`receiving_secagg_neighbour_keys`: check each neighbour's keys against its signature,
    then Shamir-share the mask key and a fresh self-mask seed among the neighbours, each
    share pair encrypted for its holder and signed with the commitments it lies on."""
    from fedcore.algorithms.secagg_crypto import agree, encrypt, private_bytes
    from fedcore.algorithms.secagg_identity import keys_statement, shares_statement, sign, verify
    st = _current(client, msg, "neighbour keys")
    if st is None or st.neighbours:
        return
    c, ident = msg.content, _identity(client)
    for v, ck, mk, w, sig in zip(c["ids"], c["cipher_keys"], c["mask_keys"], c["weights"], c["signatures"]):
        if v == client.id or v in st.neighbours:
            return _abort(client, st, f"neighbour list names client {v} twice or names me")
        if not verify(ident.roster, v, keys_statement(msg.round, v, ck, mk, w), sig):
            return _abort(client, st, f"client {v}'s keys are not signed by client {v} (roster)")
        st.neighbours[v] = (ck, mk)
    holders, s = sorted(st.neighbours), _settings(client)
    st.threshold = s.threshold(len(holders))
    floor = s.threshold(s.neighbours if 0 < s.neighbours < s.per_round - 1 else s.per_round - 1)
    if len(holders) < max(st.threshold, floor):    # a server cannot shrink my threshold at will
        return _abort(client, st, f"{len(holders)} neighbour(s), fewer than the threshold "
                      f"{max(st.threshold, floor)} the configuration gives")
    st.seed = random_secret()
    key_shares, key_commit = split(private_bytes(st.mask_key), holders, st.threshold)
    seed_shares, seed_commit = split(st.seed, holders, st.threshold)
    commitments = commitments_to_bytes(key_commit + seed_commit)
    key = ident.signing_key(client.id)
    ciphertexts, signatures = [], []
    for v in holders:
        shared = agree(st.cipher_key, st.neighbours[v][0], SHARE_INFO)
        plain = _PAIR.pack(client.id, v) + share_to_bytes(key_shares[v]) + share_to_bytes(seed_shares[v])
        ciphertexts.append(encrypt(shared, plain, _aad(msg.round, client.id, v)))
        signatures.append(sign(key, shares_statement(msg.round, client.id, v, ciphertexts[-1], commitments)))
    client.send("secagg_encrypted_shares", SERVER_ID, {"to": holders, "ciphertexts": ciphertexts,
                                                      "signatures": signatures, "commitments": commitments},
                round_=msg.round)


def _open_share(client, st: ClientRound, v: int, ct: bytes, commitments: bytes) -> tuple[int, int] | str:
    """v's share pair for me, or why it is bad (it does not decrypt, or fails Feldman's check)."""
    from cryptography.exceptions import InvalidTag
    from fedcore.algorithms.secagg_crypto import agree, decrypt
    try:
        plain = decrypt(agree(st.cipher_key, st.neighbours[v][0], SHARE_INFO), ct, _aad(st.round, v, client.id))
        if len(plain) != _PAIR.size + 2 * SHARE_BYTES or _PAIR.unpack_from(plain) != (v, client.id):
            return "wrong length or ids"
        body = plain[_PAIR.size:]
        pair = (share_from_bytes(body[:SHARE_BYTES]), share_from_bytes(body[SHARE_BYTES:]))
        polys = commitments_from_bytes(commitments, 2 * st.threshold)
    except (InvalidTag, ValueError) as exc:
        return f"does not decrypt or parse ({exc or type(exc).__name__})"
    if not (verify_share(client.id, pair[0], polys[:st.threshold])
            and verify_share(client.id, pair[1], polys[st.threshold:])):
        return "fails its check against the dealer's commitments"
    return pair


def mask_input(client, msg) -> None:
    """`receiving_secagg_routed_shares`: check each share (the dealer's signature, then the share
    itself), keep the good ones, and send the input masked by the self mask and one pairwise
    mask per neighbour that shared; neighbours whose share was bad are named with it. Fewer
    than t neighbours' shares (a server withholding them) and the round is refused instead."""
    from fedcore.algorithms.secagg_crypto import field_add, field_sub, prg_field
    from fedcore.algorithms.secagg_identity import shares_statement, verify
    st = _current(client, msg, "routed shares")
    if st is None or st.vector is None or not st.seed:
        return
    c, roster, bad = msg.content, _identity(client).roster, []
    for v, ct, sig, commitments in zip(c["from"], c["ciphertexts"], c["signatures"], c["commitments"]):
        if v not in st.neighbours or v in st.partners:
            return _abort(client, st, f"a share from client {v}, not a neighbour or sent twice")
        if not verify(roster, v, shares_statement(msg.round, v, client.id, ct, commitments), sig):
            return _abort(client, st, f"the share routed as client {v}'s is not signed by it")
        st.partners.add(v)
        pair = _open_share(client, st, v, ct, commitments)
        if isinstance(pair, str):
            log.warning("client %d: round %d: the share from client %d %s; reported", client.id, msg.round, v, pair)
            bad.append(v)
        else:
            st.held[v] = pair
    if len(st.held) < st.threshold:
        # masked with fewer than t pairwise masks of dealers whose shares held (the others'
        # are excluded, their masks taken out), the input would rest on the self mask alone,
        # whose seed shares the others reveal once this client is a survivor
        return _abort(client, st, f"good shares from {len(st.held)} neighbour(s) reached me, fewer "
                                  f"than the threshold {st.threshold}: my input would not be masked")
    p = _settings(client).modulus
    n = st.vector.size
    y = field_add(st.vector, prg_field(st.seed, n, p), p)
    for v in sorted(st.partners):
        mask = pair_mask(st.mask_key, st.neighbours[v][1], n, p)
        y = field_add(y, mask, p) if mask_sign(client.id, v) > 0 else field_sub(y, mask, p)
    st.vector = None  # the plain input is gone once masked
    client.send("secagg_masked_input", SERVER_ID, {"masked": torch.from_numpy(y.astype(np.int64)), "bad_shares": bad},
                round_=msg.round)


def _survivor_problem(client, st: ClientRound, survivors: list[int], keys: list[bytes]) -> str | None:
    from fedcore.algorithms.secagg_crypto import public_bytes
    if survivors != sorted(set(survivors)) or len(keys) != len(survivors) or client.id not in survivors:
        return "the survivor list is not a sorted set that includes me, with one key pair each"
    known = {v: ck + mk for v, (ck, mk) in st.neighbours.items()}
    known[client.id] = public_bytes(st.cipher_key) + public_bytes(st.mask_key)
    for s, k in zip(survivors, keys):
        if s in known and k != known[s]:
            return f"client {s}'s keys in the survivor list are not the ones it signed"
    masked_with = len(st.partners & set(survivors))
    if masked_with < st.threshold:
        return (f"{masked_with} survivor(s) masked their input with mine, fewer than the "
                f"threshold {st.threshold}")
    return None


def sign_survivors(client, msg) -> None:
    """`receiving_secagg_consistency_check`: sign the survivor set shown (once per round, ever),
    after checking it against what this client knows: its own keys and its neighbours'."""
    from fedcore.algorithms.secagg_identity import key_digest, sign, survivors_statement
    st = _current(client, msg, "consistency check")
    if st is None or st.vector is not None or st.survivors is not None:
        return
    survivors, keys = list(msg.content["survivors"]), list(msg.content["keys"])
    problem = _survivor_problem(client, st, survivors, keys)
    if problem is None and msg.round <= getattr(client, "secagg_signed_round", 0):
        problem = f"a survivor set for round {msg.round} was signed already"
    if problem is not None:
        return _abort(client, st, problem)
    client.secagg_signed_round = msg.round
    st.survivors, st.digest = tuple(survivors), key_digest(keys)
    signature = sign(_identity(client).signing_key(client.id),
                     survivors_statement(msg.round, survivors, st.digest))
    client.send("secagg_survivor_signature", SERVER_ID, {"signature": signature}, round_=msg.round)


def _unmask_problem(client, st: ClientRound, c: dict, quorum: int) -> str | None:
    from fedcore.algorithms.secagg_identity import survivors_statement, verify
    if tuple(c["survivors"]) != st.survivors:
        return "the survivor list differs from the one I signed"
    statement = survivors_statement(st.round, list(st.survivors), st.digest)
    signers = {s for s, sig in zip(c["signers"], c["signatures"])
               if s in st.survivors and verify(_identity(client).roster, s, statement, sig)}
    if len(signers) < quorum:
        return (f"{len(signers)} valid signature(s) from survivors on the survivor set I signed, "
                f"fewer than {quorum}: other clients may have been shown another set")
    stray = [v for v in c["dropped"] if v not in st.neighbours or v in st.survivors]
    if stray:
        return f"client(s) {stray} listed as dropped are not my neighbours or are also survivors"
    return None


def reveal_shares(client, msg) -> None:
    """`receiving_secagg_unmask_request`: reveal, only for a survivor set that a quorum of its
    members signed as I did, per neighbour the share of its seed if it survived, or its mask-key
    share and our pairwise mask key if it dropped; never both, once per round."""
    st = _current(client, msg, "unmask request")
    if st is None or st.revealed or st.survivors is None:
        return
    s = _settings(client)
    problem = _unmask_problem(client, st, msg.content, s.quorum(st.threshold))
    if problem is not None:
        return _abort(client, st, problem)
    st.revealed = True
    seeds, keys, pairs = {}, {}, {}
    for v in sorted(st.neighbours):
        if v in st.survivors and v in st.held:
            seeds[v] = share_to_bytes(st.held[v][1])
        elif v in msg.content["dropped"] and v in st.partners:
            if v in st.held:
                keys[v] = share_to_bytes(st.held[v][0])
            pairs[v] = pair_key(st.mask_key, st.neighbours[v][1])
    client.send("secagg_unmask_shares", SERVER_ID, {
        "seed_ids": list(seeds), "seed_shares": list(seeds.values()), "key_ids": list(keys),
        "key_shares": list(keys.values()), "pair_ids": list(pairs), "pair_keys": list(pairs.values())},
        round_=msg.round)
