"""The vertical course with logistic regression on Paillier-encrypted residuals (`vertical.method:
he_lr`): after alignment (handlers/vertical.py), per mini-batch step s

  passive `partial_logits` (s) -> active step, `encrypted_residuals` (s) -> passive
  `masked_gradient` (s) -> active decrypts, `decrypted_gradient` (s) -> passive unmasks, steps,
  and sends step s+1's `partial_logits`; at an epoch's end also `test_logits`.

The active party holds the Paillier key; a passive party receives the public modulus n
(`public_key`), ciphertexts, and the decryption of its own masked sums, nothing else.
"""
from __future__ import annotations

from fedcore.handlers import vertical as v
from fedcore.kernel.registry import components, courses

__all__ = ["install"]

ACTIVE = v.ACTIVE


def _width(n: int) -> int:
    return ((n * n).bit_length() + 7) // 8


def setup_active(active, _event=None) -> None:
    """`aligned` (active): weights at zero, a fresh key pair; send the public modulus."""
    course, cfg = active.course, active.course.cfg
    active.model = components.get("lr_active")(cfg, active.train_rows.x, active.test_rows.x,
                                               active.train_rows.y, active.test_rows.y,
                                               active.table.num_classes)
    active.per_epoch = components.get("batches_per_epoch")(len(active.train_rows.ids), cfg["train.batch_size"])
    active.acts, active.test_acts, active.trained, active.losses, active.party_time = {}, {}, set(), [], {}
    active.grads_pending = {}
    active.aggregator.states = lambda: {**active.model.state(), **{
        f"w{p}": c.model.w.clone() for p, c in course.clients.items() if hasattr(c, "model")}}   # set up
    n = active.model.n
    active.send("public_key", course.client_ids, {"n": n.to_bytes((n.bit_length() + 7) // 8, "big")})
    if v.resume_round(active) >= cfg["federate.total_round_num"]:
        v.finish(active)   # resumed from the last round's snapshot: nothing left to train


def setup_passive(party, _event=None) -> None:
    """`aligned` (passive): weights at zero; send the first batch's partial logits."""
    party.model = components.get("lr_passive")(party.course.cfg, party.id, party.train_rows.x,
                                               party.test_rows.x, party.table.num_classes)
    v.start_passive(party, party.model, send_partial)


def send_partial(party, step: int) -> None:
    u = party.model.partial(step)
    party.spend(float(len(u)))
    party.send("partial_logits", ACTIVE, {"step": step, "h": u}, round_=step // party.per_epoch + 1)


def learn_key(party, msg) -> None:
    """`receiving_public_key`: the modulus n (all of the key a passive party holds)."""
    n = int.from_bytes(bytes(msg.content["n"]), "big")
    party.model.key = components.get("paillier")().PublicKey(n)


def residuals(active, step: int) -> None:
    """`all_activations`: the active party's step; the batch's residuals, encrypted, to every party."""
    enc, loss = active.model.step(step, active.acts.pop(step))
    active.losses.append(loss)
    width, round_ = _width(active.model.n), step // active.per_epoch + 1
    wire = components.get("paillier")().to_bytes(enc, width)
    active.send("encrypted_residuals", active.course.client_ids, {"step": step, "c": wire}, round_=round_)
    if (step + 1) % active.per_epoch == 0:
        active.course.checkpointer.capture(active, round_)
        active.trained.add(round_)
        active.trigger("round_ready", round_)


def masked_gradient(party, msg) -> None:
    """`receiving_encrypted_residuals`: [[X^T R + M]] back to the key holder."""
    pl, key = components.get("paillier")(), party.model.key
    enc = pl.from_bytes(list(msg.content["c"]), key.nsquare)
    out = party.model.masked_gradient(enc)
    party.spend(float(len(enc)))
    party.send("masked_gradient", ACTIVE, {"step": msg.content["step"], "c": pl.to_bytes(out, _width(key.n))},
               round_=msg.round)


def decrypt(active, msg) -> None:
    """`receiving_masked_gradient`: decrypt the masked sums (uniform modulo n) and return them."""
    if not v.fresh(active, msg):
        return
    pl, n = components.get("paillier")(), active.model.n
    plain = active.model.decrypt(pl.from_bytes(list(msg.content["c"]), n * n))
    width = (n.bit_length() + 7) // 8
    active.send("decrypted_gradient", msg.sender, {"step": msg.content["step"], "v": pl.to_bytes(plain, width)},
                round_=msg.round)


def step_passive(party, msg) -> None:
    """`receiving_decrypted_gradient`: unmask, step; test logits at an epoch's end; next batch."""
    pl = components.get("paillier")()
    step = int(msg.content["step"])
    party.model.unmask_and_step(pl.from_bytes(list(msg.content["v"]), party.model.key.n))
    if (step + 1) % party.per_epoch == 0:
        party.durable.save(party.model, (step + 1) // party.per_epoch)
        party.send("test_logits", ACTIVE, {"h": party.model.test_partial()}, round_=msg.round)
    if step + 1 < party.total_steps:
        send_partial(party, step + 1)


@courses.register("vertical_he_lr")
def install(course) -> None:
    v.install_alignment(course)
    s, c = course.server_table, course.client_table
    s.register("aligned", setup_active, sends=("public_key",))
    c.register("aligned", setup_passive, sends=("partial_logits",))
    c.register("receiving_public_key", learn_key)
    s.register("receiving_partial_logits", v.collect_activations, sends=("all_activations",))
    s.register("all_activations", residuals, sends=("encrypted_residuals", "round_ready"))
    c.register("receiving_encrypted_residuals", masked_gradient, sends=("masked_gradient",))
    s.register("receiving_masked_gradient", decrypt, sends=("decrypted_gradient",))
    c.register("receiving_decrypted_gradient", step_passive, sends=("partial_logits", "test_logits"))
    s.register("receiving_test_logits", v.collect_test, sends=("round_ready",))
    s.register("round_ready", v.record, sends=("finish",))

