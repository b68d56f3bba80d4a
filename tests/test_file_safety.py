"""Writing a run's files safely (fedcore/kernel/files.py), tested as the attacker who can write
the outdir, the checkpoint folder or a client's state_dir but not the victim file: a link
planted at a temporary name or at an output's own name never gets its target written; a
folder others may write is refused; files are 0600 in 0700 folders (outputs.private); a
client's state file that is not finite, or (with the operator's HMAC key) altered, untagged
or tagged under another key, is refused in one line and the previous one used."""
import logging
import os
import stat

import pytest
import torch

from fedcore.comm.client_state import ClientStateDir, DurableClientState
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.file_tag import tag
from fedcore.kernel.files import write_atomic
from fedcore.kernel.state import MemoryStateStore
from fedcore.runtime.course import Course
from tests.conftest import small_cfg

CID = 3
VICTIM = b"the victim's own bytes\n"


def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM)
    return victim


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_link_planted_at_the_temporary_name_is_removed_not_followed(tmp_path):
    victim = _victim(tmp_path)
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "summary.json.tmp").symlink_to(victim)
    write_atomic(folder / "summary.json", "{}\n")
    assert victim.read_bytes() == VICTIM
    assert (folder / "summary.json").read_text() == "{}\n" and not (folder / "summary.json.tmp").exists()


def test_a_link_at_the_final_name_is_replaced_not_written_through(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "out.txt").symlink_to(victim)
    write_atomic(tmp_path / "out.txt", b"new")
    assert victim.read_bytes() == VICTIM
    assert not (tmp_path / "out.txt").is_symlink() and (tmp_path / "out.txt").read_bytes() == b"new"


def test_a_folder_at_the_temporary_name_makes_the_write_fail_cleanly(tmp_path):
    (tmp_path / "x.tmp").mkdir()
    with pytest.raises(OSError):
        write_atomic(tmp_path / "x", b"data")
    assert not (tmp_path / "x").exists()


def test_a_course_writes_no_file_through_links_planted_in_its_outdir(tmp_path):
    """Links at every temporary name a course's server uses, and at its outputs' own names."""
    victim = _victim(tmp_path)
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    planted = [out / "checkpoints" / "round_1.tmp", out / "checkpoints" / "round_2.tmp",
               out / "checkpoints" / "latest.tmp", out / "final_model.pt.tmp", out / "summary.json.tmp",
               out / "metrics.jsonl.tmp", out / "config.yaml.tmp", out / "handlers.txt.tmp",
               out / "message_flow.graphml.tmp", out / "final_model.pt", out / "metrics.jsonl",
               out / "summary.json", out / "config.yaml"]
    for link in planted:
        link.symlink_to(victim)
    Course(small_cfg(out, checkpoint__every=1)).run()
    assert victim.read_bytes() == VICTIM
    for name in ("final_model.pt", "metrics.jsonl", "summary.json", "config.yaml",
                 "checkpoints/round_2.pt", "checkpoints/latest"):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert torch.load(out / "final_model.pt", weights_only=True)


def test_outputs_are_private_by_default(tmp_path):
    out = tmp_path / "run"
    Course(small_cfg(out, checkpoint__every=1)).run()
    assert _mode(out) == 0o700 and _mode(out / "checkpoints") == 0o700
    for name in ("final_model.pt", "summary.json", "metrics.jsonl", "config.yaml", "config_sources.yaml",
                 "handlers.txt", "message_flow.graphml", "checkpoints/round_1.pt", "checkpoints/latest"):
        assert _mode(out / name) == 0o600, name


def test_outputs_private_false_leaves_the_modes_to_the_umask(tmp_path):
    out = tmp_path / "run"
    umask = os.umask(0o022)
    try:
        Course(small_cfg(out, checkpoint__every=1, outputs__private=False)).run()
    finally:
        os.umask(umask)
        Course(small_cfg(None))   # the process's setting back to the default for later tests
    assert _mode(out) == 0o755 and _mode(out / "final_model.pt") == 0o644
    assert _mode(out / "checkpoints" / "round_1.pt") == 0o644


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_checkpoint_folder_others_may_write_is_refused(tmp_path, mode):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(ConfigError) as err:
        Course(small_cfg(tmp_path / "r", checkpoint__every=1, checkpoint__path=str(folder))).build()
    assert str(err.value).startswith(f"checkpoint.path: folder '{folder}' is writable by others "
                                     f"(mode {mode:04o})") and "\n" not in str(err.value)


def test_a_snapshot_in_a_folder_others_may_write_is_not_resumed(tmp_path):
    Course(small_cfg(tmp_path / "full", checkpoint__every=1)).run()
    folder = tmp_path / "full" / "checkpoints"
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match="resume_from: folder .* is writable by others"):
        Course(small_cfg(tmp_path / "r", resume_from=str(folder / "round_1.pt"),
                         federate__total_round_num=3)).build()


# ------------------------------------------------------------------ a client's state on its disk

class _Client:
    parent = 0

    def __init__(self, cid):
        self.id = cid


class _Course:
    def __init__(self, cfg):
        self.cfg, self.store = cfg, MemoryStateStore()


def _state(v: float) -> dict:
    return {"c_i": {"w": torch.full((2, 3), v)}, "sampler": {"epoch": 1, "offset": 4}}


def _durable(folder, cfg):
    course = _Course(cfg)
    client = _Client(CID)
    return DurableClientState(course, client, folder), course, client


def _train(durable, course, round_: int, v: float) -> None:
    durable.before_training(round_)
    course.store.save(CID, _state(v))
    durable.after_training(round_)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_link_at_a_client_states_temporary_name_is_not_followed(tmp_path):
    victim = _victim(tmp_path)
    folder = tmp_path / "state"
    durable, course, _ = _durable(folder, small_cfg())
    (folder / "round_1.state.tmp").symlink_to(victim)
    _train(durable, course, 1, 1.0)
    assert victim.read_bytes() == VICTIM
    assert _mode(folder / "round_1.state") == 0o600 and _mode(folder) == 0o700
    _, course2, client2 = _durable(folder, small_cfg())
    assert client2.state_round == 1 and torch.equal(course2.store.load(CID)["c_i"]["w"], torch.full((2, 3), 1.0))


def test_a_state_dir_others_may_write_is_refused(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(ConfigError, match=r"distribute.state_dir: folder .* is writable by others \(mode 0777\)"):
        _durable(folder, small_cfg())


def test_a_client_state_rewritten_with_nan_and_a_valid_checksum_is_refused(tmp_path, caplog):
    # the attacker rewrites round 2's file with fedcore's own writer: a checksum that matches
    folder = tmp_path / "state"
    durable, course, _ = _durable(folder, small_cfg())
    _train(durable, course, 1, 1.0)
    _train(durable, course, 2, 2.0)
    ClientStateDir(folder, small_cfg(), CID).write(2, 1, _state(float("nan")))
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        _, course2, client2 = _durable(folder, small_cfg())
    warned = _warnings(caplog)
    assert len(warned) == 1 and "\n" not in warned[0]
    assert f"{folder / 'round_2.state'} holds NaN or infinite values (in 'c_i.w')" in warned[0]
    assert client2.state_round == 1 and torch.equal(course2.store.load(CID)["c_i"]["w"], torch.full((2, 3), 1.0))


def _key(tmp_path, name="key"):
    path = tmp_path / name
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def _flip(path):
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 0x01
    path.write_bytes(bytes(raw))


def _forge_with_the_checksum_writer(path, cfg):
    # fedcore's own writer without the key: a well-formed file with a matching checksum
    ClientStateDir(path.parent, cfg.with_overrides(**{"checkpoint.hmac_key_file": None}), CID).write(
        2, 1, _state(9.0))


def _forge_under_another_key(path, tmp_path):
    body = path.read_bytes()[72:]
    path.write_bytes(tag(body, os.urandom(32)))


@pytest.mark.parametrize("attack, needle", [
    ("flip", "fails its HMAC check"),
    ("untagged", "carries no HMAC tag"),
    ("other key", "fails its HMAC check"),
])
def test_with_the_key_an_altered_client_state_is_refused_and_the_previous_one_used(tmp_path, caplog, attack,
                                                                                   needle):
    cfg = small_cfg(checkpoint__hmac_key_file=_key(tmp_path))
    folder = tmp_path / "state"
    durable, course, _ = _durable(folder, cfg)
    _train(durable, course, 1, 1.0)
    _train(durable, course, 2, 2.0)
    f = folder / "round_2.state"
    assert f.read_bytes().startswith(b"FCTAG1 ")
    {"flip": lambda: _flip(f), "untagged": lambda: _forge_with_the_checksum_writer(f, cfg),
     "other key": lambda: _forge_under_another_key(f, tmp_path)}[attack]()
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        _, course2, client2 = _durable(folder, cfg)
    warned = _warnings(caplog)
    assert len(warned) == 1 and "\n" not in warned[0] and needle in warned[0], warned
    assert client2.state_round == 1 and torch.equal(course2.store.load(CID)["c_i"]["w"], torch.full((2, 3), 1.0))


def test_with_the_key_an_untampered_client_state_comes_back_exactly(tmp_path):
    cfg = small_cfg(checkpoint__hmac_key_file=_key(tmp_path))
    folder = tmp_path / "state"
    durable, course, _ = _durable(folder, cfg)
    state = {"c_i": {"w": torch.randn(4, 5, dtype=torch.float64)}, "sampler": {"epoch": 2, "offset": 7}}
    durable.before_training(1)
    course.store.save(CID, state)
    durable.after_training(1)
    _, course2, client2 = _durable(folder, cfg)
    loaded = course2.store.load(CID)
    assert client2.state_round == 1 and torch.equal(loaded["c_i"]["w"], state["c_i"]["w"])
    assert loaded["sampler"] == state["sampler"]
