"""Snapshots are inputs: an attacker who can write the checkpoint folder rewrites a snapshot
with the project's own writer (torch.save of the state, its config fingerprint left intact)
and one entry changed. Such a snapshot is refused in one line naming the file and what is
wrong, and the snapshot before it resumes the course (the uninterrupted course's model at
the end); in a simulation and in a deployed server's resume alike. With an operator's HMAC
key (checkpoint.hmac_key_file), a byte flipped anywhere, an untagged snapshot or one tagged
under another key is refused, and the untampered one resumes bit-identically."""
import json
import logging
import os
import shutil

import pytest
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.runtime.course import Course
from fedcore.runtime.snapshot import write_snapshot
from tests.conftest import small_cfg

COMMON = dict(federate__total_round_num=4, algorithm__name="scaffold", eval__clients=False)


def _final(out):
    return torch.load(out / "final_model.pt", weights_only=True)


def _rounds(out):
    return [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _key_file(folder, name="hmac.key", data=None):
    path = folder / name
    path.write_bytes(data if data is not None else os.urandom(32))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted course, a snapshot after every round (all kept)."""
    out = tmp_path_factory.mktemp("full")
    Course(small_cfg(out, checkpoint__every=1, **COMMON)).run()
    return out


def _first(d):
    return next(iter(d))


def _nan_model(s):
    s["global_state"][_first(s["global_state"])].view(-1)[0] = float("nan")


def _inf_control_variate(s):   # SCAFFOLD's server state: what the next round's clients get
    name, t = next((k, v) for k, v in _flat(s["aggregator"]) if torch.is_floating_point(v))
    t.view(-1)[0] = float("inf")


def _wrong_shaped_control_variate(s):
    control = s["aggregator"]["control"]
    name = _first(control)
    control[name] = torch.zeros(control[name].numel() + 1)


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            yield f"{prefix}{k}", v


def _nan_client_state(s):
    cid = _first(s["client_states"])
    name, t = next((k, v) for k, v in _flat(s["client_states"][cid]) if torch.is_floating_point(v))
    t.view(-1)[0] = float("nan")


def _wrong_shape(s):
    name = _first(s["global_state"])
    t = s["global_state"][name]
    s["global_state"][name] = torch.zeros(t.shape[0] + 1, *t.shape[1:], dtype=t.dtype)


TAMPERED = {
    "nan model": (_nan_model, "holds NaN or infinite values"),
    "no sampler_rng": (lambda s: s.pop("sampler_rng"), "is incomplete (no entry 'sampler_rng')"),
    "no client_states": (lambda s: s.pop("client_states"), "is incomplete (no entry 'client_states')"),
    "wrong-shaped tensor": (_wrong_shape, "was written for another model"),
    "inf control variate": (_inf_control_variate, "holds NaN or infinite values"),
    "wrong-shaped control variate": (_wrong_shaped_control_variate, "aggregator.control"),
    "nan client state": (_nan_client_state, "client_states"),
    "sampler_rng of another generator": (
        lambda s: s.update(sampler_rng={"bit_generator": "MT19937", "state": {"key": [1], "pos": 0}}),
        "entry 'sampler_rng'"),
    "torch_rng cut short": (lambda s: s.update(torch_rng=s["torch_rng"][:10]), "entry 'torch_rng'"),
}


def _planted(full, run, change):
    """run/checkpoints holds full's round 1 and a round 2 rewritten with `change`."""
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copy(full / "checkpoints" / "round_1.pt", folder / "round_1.pt")
    state = torch.load(full / "checkpoints" / "round_2.pt", weights_only=True)
    change(state)
    torch.save(state, folder / "round_2.pt")
    return folder


def _refusals(caplog):
    return [r.getMessage() for r in caplog.records if "using the snapshot before it" in r.getMessage()]


@pytest.mark.parametrize("what", TAMPERED)
def test_a_tampered_newest_snapshot_is_refused_in_one_line_and_the_one_before_resumes(tmp_path, full, what,
                                                                                         caplog):
    change, needle = TAMPERED[what]
    run = tmp_path / "run"
    _planted(full, run, change)
    with caplog.at_level(logging.WARNING, logger="fedcore.checkpoint"):
        Course(small_cfg(run, resume_from="latest", **COMMON)).run()
    warned = _refusals(caplog)
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert "round_2.pt" in warned[0] and needle in warned[0], warned
    assert _rounds(run) == [1, 2, 3, 4]          # resumed from round 1: rounds 2-4 run again
    assert _same(_final(full), _final(run))      # the uninterrupted course's model, finite


def test_a_tampered_snapshot_named_alone_is_a_one_line_config_error(tmp_path, full):
    # an explicit snapshot with none older beside it: nothing to fall back on, exit 2's error
    folder = tmp_path / "ckpt"
    folder.mkdir()
    state = torch.load(full / "checkpoints" / "round_2.pt", weights_only=True)
    del state["sampler_rng"]
    torch.save(state, folder / "round_2.pt")
    with pytest.raises(ConfigError) as err:
        Course(small_cfg(tmp_path / "r", resume_from=str(folder / "round_2.pt"), **COMMON)).build()
    assert str(err.value) == (f"resume_from: '{folder / 'round_2.pt'}' is incomplete (no entry "
                              "'sampler_rng')")


@pytest.mark.parametrize("what", ["nan model", "no sampler_rng"])
def test_a_deployed_servers_automatic_resume_skips_a_tampered_snapshot(tmp_path, full, what, caplog):
    """The deployed server's resume (its networking not started: building it is enough) takes
    round 1's snapshot and runs round 2 next."""
    from fedcore.deployment.distributed import ServerCourse
    change, needle = TAMPERED[what]
    folder = _planted(full, tmp_path / "run", change)
    cfg = small_cfg(None, resume_from="latest", distribute__role="server", distribute__server_host="127.0.0.1",
                    distribute__server_port=0, distribute__insecure=True, checkpoint__path=str(folder),
                    **COMMON)
    with caplog.at_level(logging.WARNING, logger="fedcore.checkpoint"):
        course = ServerCourse(cfg).build()
    warned = _refusals(caplog)
    assert len(warned) == 1 and needle in warned[0] and "round_2.pt" in warned[0], warned
    assert course.server.round == 2
    restored = course.server.aggregator.global_state
    assert _same({k: v.cpu() for k, v in restored.items()},
                 torch.load(folder / "round_1.pt", weights_only=True)["global_state"])


# ------------------------------------------------------------------ the operator's key

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """The uninterrupted course with snapshots tagged under a key."""
    root = tmp_path_factory.mktemp("keyed")
    key = _key_file(root)
    out = root / "out"
    Course(small_cfg(out, checkpoint__every=1, checkpoint__hmac_key_file=str(key), **COMMON)).run()
    return out, key


def test_tagged_snapshots_resume_bit_identically(tmp_path, keyed):
    out, key = keyed
    snapshot = out / "checkpoints" / "round_2.pt"
    assert snapshot.read_bytes().startswith(b"FCTAG1 ")
    run = tmp_path / "run"
    Course(small_cfg(run, resume_from=str(snapshot), checkpoint__hmac_key_file=str(key), **COMMON)).run()
    assert _rounds(run) == [1, 2, 3, 4]
    assert _same(_final(out), _final(run))
    full_records = (out / "metrics.jsonl").read_text().splitlines()
    resumed = (run / "metrics.jsonl").read_text().splitlines()
    drop = lambda line: {k: v for k, v in json.loads(line).items() if "wall" not in k}
    assert list(map(drop, resumed)) == list(map(drop, full_records))


def _with_key_folder(keyed, run, change_newest):
    """run/checkpoints: keyed's rounds 1 and 2, the newest passed through `change_newest(path)`."""
    out, _ = keyed
    folder = run / "checkpoints"
    folder.mkdir(parents=True)
    for k in (1, 2):
        shutil.copy(out / "checkpoints" / f"round_{k}.pt", folder / f"round_{k}.pt")
    change_newest(folder / "round_2.pt")
    return folder


def _flip_a_byte(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _forged_under_another_key(path):
    # the attacker uses fedcore's own writer, with a key of their own (they cannot read the
    # operator's) and a snapshot that is otherwise the real one
    state = torch.load(__import__("io").BytesIO(path.read_bytes()[72:]), weights_only=True)
    write_snapshot(state, path.parent, 2, keep=0, key=os.urandom(32))


def _stripped_of_its_tag(path):
    path.write_bytes(path.read_bytes()[72:])   # a valid torch file, the real snapshot's content


@pytest.mark.parametrize("change, needle", [
    (_flip_a_byte, "fails its HMAC check"),
    (_forged_under_another_key, "fails its HMAC check"),
    (_stripped_of_its_tag, "carries no HMAC tag"),
])
def test_with_the_key_a_changed_snapshot_is_refused_and_the_one_before_resumes(tmp_path, keyed, change, needle,
                                                                               caplog):
    out, key = keyed
    run = tmp_path / "run"
    _with_key_folder(keyed, run, change)
    with caplog.at_level(logging.WARNING, logger="fedcore.checkpoint"):
        Course(small_cfg(run, resume_from="latest", checkpoint__hmac_key_file=str(key), **COMMON)).run()
    warned = _refusals(caplog)
    assert len(warned) == 1 and "\n" not in warned[0] and needle in warned[0] and "round_2.pt" in warned[0]
    assert _rounds(run) == [1, 2, 3, 4]
    assert _same(_final(out), _final(run))


def test_an_untagged_snapshot_is_refused_under_a_key_and_a_tagged_one_without(tmp_path, full, keyed):
    _, key = keyed
    with pytest.raises(ConfigError, match="carries no HMAC tag, and checkpoint.hmac_key_file is set"):
        Course(small_cfg(tmp_path / "a", resume_from=str(full / "checkpoints" / "round_1.pt"),
                         checkpoint__hmac_key_file=str(key), **COMMON)).build()
    with pytest.raises(ConfigError, match="carries an HMAC tag; set checkpoint.hmac_key_file"):
        Course(small_cfg(tmp_path / "b", resume_from=str(keyed[0] / "checkpoints" / "round_1.pt"),
                         **COMMON)).build()


@pytest.mark.parametrize("data, mode, needle", [
    (b"short", 0o600, "holds 5 bytes; a key needs at least 16"),
    (b"k" * 32, 0o640, "can be read or written by others (mode 0640); chmod 600 it"),
    (None, 0o600, "cannot read"),
])
def test_a_bad_key_file_is_a_config_error_naming_the_key(tmp_path, data, mode, needle):
    path = tmp_path / "key"
    if data is not None:
        path.write_bytes(data)
        path.chmod(mode)
    with pytest.raises(ConfigError) as err:
        Course(small_cfg(tmp_path / "r", checkpoint__every=1, checkpoint__hmac_key_file=str(path))).build()
    assert str(err.value).startswith("checkpoint.hmac_key_file: ") and needle in str(err.value)
    assert "\n" not in str(err.value)
    if data is not None:
        assert data.decode() not in str(err.value)   # never the key itself
