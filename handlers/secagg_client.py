"""The client's stages of secure aggregation (SecAgg+); see handlers/secure_aggregation.py.

A client keeps one round's secrets on its worker (`client.secagg`): two fresh
X25519 key pairs (one to encrypt shares, one for pairwise masks), its
self-mask seed, its quantized input until it is masked, and the shares its
neighbours entrusted to it. A message for another round, or one that does
not fit the stage, is logged and ignored.
"""
from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcore.algorithms.secure_sum import SEED_BYTES, mask_sign, pair_mask
from fedcore.message import SERVER_ID
from fedcore.shamir import SHARE_BYTES, share_from_bytes, share_to_bytes, split
from fedcore.worker import Stopwatch

__all__ = ["train_and_advertise", "share_keys", "mask_input", "reveal_shares", "SHARE_INFO"]

log = logging.getLogger("fedcore.secagg")

SHARE_INFO = b"fedcore secagg share encryption"
_PAIR = struct.Struct(">II")


@dataclass
class ClientRound:
    round: int
    vector: np.ndarray | None            # w * quantize(delta) ++ [w], mod p, until masked
    cipher_key: Any                      # X25519 private keys, fresh each round
    mask_key: Any
    threshold: int = 0
    neighbours: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # v -> (cipher pk, mask pk)
    seed: bytes = b""
    held: dict[int, tuple[int, int]] = field(default_factory=dict)  # v -> (share of v's mask key, of v's seed)
    revealed: bool = False


def _settings(client):
    from fedcore.algorithms.secagg_settings import Settings
    return Settings.of(client.course.cfg)


def _current(client, msg, stage: str) -> ClientRound | None:
    st = getattr(client, "secagg", None)
    if st is None or st.round != msg.round:
        log.info("client %d: %s for round %d ignored (no secure round open)", client.id, stage, msg.round)
        return None
    return st


def _aad(round_: int, sender: int, receiver: int) -> bytes:
    return b"fedcore secagg round " + struct.pack(">III", round_, sender, receiver)


def train_and_advertise(client, msg) -> None:
    """Client `receiving_models`: train, quantize the update (kept here), advertise two public keys."""
    from fedcore.algorithms.secagg_crypto import new_private_key, public_bytes, quantize
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
    vector = np.append((q * np.uint64(weight)) % np.uint64(s.modulus), np.uint64(weight))
    cipher_key, mask_key = new_private_key(), new_private_key()
    client.secagg = ClientRound(msg.round, vector, cipher_key, mask_key)
    client.send("secagg_public_keys", SERVER_ID,
                {"cipher_key": public_bytes(cipher_key), "mask_key": public_bytes(mask_key)},
                round_=msg.round)


def share_keys(client, msg) -> None:
    """`receiving_secagg_neighbour_keys`: Shamir-share the mask key and a fresh self-mask seed
    among the neighbours, each share encrypted for its holder, all sent through the server."""
    from fedcore.algorithms.secagg_crypto import agree, encrypt, private_bytes
    st = _current(client, msg, "neighbour keys")
    if st is None or st.neighbours:
        return
    c = msg.content
    st.neighbours = {v: (ck, mk) for v, ck, mk in zip(c["ids"], c["cipher_keys"], c["mask_keys"])
                     if v != client.id}
    holders = sorted(st.neighbours)
    st.threshold = _settings(client).threshold(len(holders))
    if st.threshold > len(holders):
        log.warning("client %d: round %d: %d neighbour(s), fewer than the threshold %d; not sharing",
                    client.id, msg.round, len(holders), st.threshold)
        return
    st.seed = os.urandom(SEED_BYTES)
    key_shares = split(private_bytes(st.mask_key), holders, st.threshold)
    seed_shares = split(st.seed, holders, st.threshold)
    ciphertexts = []
    for v in holders:
        key = agree(st.cipher_key, st.neighbours[v][0], SHARE_INFO)
        plain = _PAIR.pack(client.id, v) + share_to_bytes(key_shares[v]) + share_to_bytes(seed_shares[v])
        ciphertexts.append(encrypt(key, plain, _aad(msg.round, client.id, v)))
    client.send("secagg_encrypted_shares", SERVER_ID, {"to": holders, "ciphertexts": ciphertexts},
                round_=msg.round)


def mask_input(client, msg) -> None:
    """`receiving_secagg_routed_shares`: keep the neighbours' shares, then send the input masked
    by the self mask and one pairwise mask per neighbour that shared."""
    from cryptography.exceptions import InvalidTag
    from fedcore.algorithms.secagg_crypto import agree, decrypt, field_add, field_sub, prg_field
    st = _current(client, msg, "routed shares")
    if st is None or st.vector is None or not st.seed:
        return
    for v, ct in zip(msg.content["from"], msg.content["ciphertexts"]):
        if v not in st.neighbours:
            log.warning("client %d: round %d: a share from non-neighbour %s ignored", client.id, msg.round, v)
            continue
        key = agree(st.cipher_key, st.neighbours[v][0], SHARE_INFO)
        try:
            plain = decrypt(key, ct, _aad(msg.round, v, client.id))
        except (InvalidTag, ValueError):
            log.warning("client %d: round %d: the share from client %d does not decrypt; ignored",
                        client.id, msg.round, v)
            continue
        body = plain[_PAIR.size:]
        try:
            if len(plain) != _PAIR.size + 2 * SHARE_BYTES or _PAIR.unpack_from(plain) != (v, client.id):
                raise ValueError("wrong length or ids")
            st.held[v] = (share_from_bytes(body[:SHARE_BYTES]), share_from_bytes(body[SHARE_BYTES:]))
        except ValueError as exc:
            log.warning("client %d: round %d: malformed share from client %d ignored (%s)",
                        client.id, msg.round, v, exc)
    p = _settings(client).modulus
    n = st.vector.size
    y = field_add(st.vector, prg_field(st.seed, n, p), p)
    for v in sorted(st.held):
        mask = pair_mask(st.mask_key, st.neighbours[v][1], n, p)
        y = field_add(y, mask, p) if mask_sign(client.id, v) > 0 else field_sub(y, mask, p)
    st.vector = None  # the plain input is gone once masked
    client.send("secagg_masked_input", SERVER_ID, {"masked": torch.from_numpy(y.astype(np.int64))},
                round_=msg.round)


def reveal_shares(client, msg) -> None:
    """`receiving_secagg_unmask_request`: for each neighbour, the share of its seed if it
    survived or of its mask key if it dropped, never both, and only once per round."""
    st = _current(client, msg, "unmask request")
    if st is None or st.revealed or not st.held:
        return
    dropped, survivors = set(msg.content["dropped"]), set(msg.content["survivors"])
    if dropped & survivors or len(survivors) < st.threshold:
        log.warning("client %d: round %d: unmask request refused (%s)", client.id, msg.round,
                    "a client listed as both dropped and surviving" if dropped & survivors
                    else f"{len(survivors)} survivor(s), fewer than the threshold {st.threshold}")
        return
    st.revealed = True
    ids, shares = [], []
    for v in sorted(st.held):
        key_share, seed_share = st.held[v]
        if v in dropped:
            ids.append(v)
            shares.append(share_to_bytes(key_share))
        elif v in survivors:
            ids.append(v)
            shares.append(share_to_bytes(seed_share))
    client.send("secagg_unmask_shares", SERVER_ID, {"ids": ids, "shares": shares}, round_=msg.round)
