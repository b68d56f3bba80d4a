"""A large received message kept in an unlinked file (wire/spooled.py): what arrives is what
decodes, the file leaves nothing behind, a failed or cut message frees it, pages read a
slice at a time go back, and a server whose disk cannot take the file goes on in memory."""
import gc
import logging
import os

import pytest
import torch

from fedcore.algorithms.streaming import RunningMean
from fedcore.comm.chunking import Reassembler, chunk_frames
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire import large, spooled
from fedcore.wire.codec import WireError, decode_envelope, from_value
from fedcore.wire.serialization import encode_envelope
from fedcore.wire.tensor_forms import get_form
from tests.deploy_helpers import mapping_rss_kib

MIB = 2 ** 20


def _content(seed=3):
    g = torch.Generator().manual_seed(seed)
    # odd key lengths put the tensors' data at unaligned offsets: decoding moves them in place
    # 17 MiB and more: an envelope the large-message decoder reads (spool_bytes is at least 16 MiB)
    return {"model": {"a": torch.randn(17 * MIB // 4 + 1, generator=g),
                      "bbb": torch.randn(MIB // 8 + 3, generator=g, dtype=torch.float64),
                      "small": torch.randn(5, generator=g)},
            "num_samples": 7}


def _frames(data: bytes, chunk=2 * MIB):
    return [pb.Frame.FromString(f).chunk for f in chunk_frames([data], 1, chunk)]


def _feed(reasm, chunks):
    out = None
    for c in chunks:
        out = reasm.feed(c)
    return out


def _open_files(folder) -> int:
    """Descriptors of this process open on files in `folder` (unlinked ones included)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(folder))
    return n


def _mapped(folder) -> int:
    """Mappings of this process on files in `folder`."""
    with open("/proc/self/maps") as maps:
        return sum(str(folder) in line for line in maps)


def test_a_spooled_message_decodes_as_sent_its_tensors_viewing_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(large, "MOVE_PIECE", MIB + 3)     # a tensor aligned in place, piece by piece
    content = _content()
    data = encode_envelope("updates", 2, (0,), 1, 0.5, content)
    reasm = Reassembler(len(data) + 1, 2 * MIB, spool_at=16 * MIB, spool_dir=str(tmp_path))
    got = _feed(reasm, _frames(data))
    assert isinstance(got, spooled.mmap.mmap) and len(got) == len(data)
    assert os.listdir(tmp_path) == []               # unlinked from the start: nothing left behind
    assert _open_files(tmp_path) == 1               # the mapping's own (CPython's mmap keeps one)
    env = decode_envelope(got, consume=True)
    model = from_value(env.content)["model"]
    base = torch.frombuffer(got, dtype=torch.uint8).data_ptr()
    for name, t in content["model"].items():
        assert torch.equal(model[name], t), name
        big = t.numel() * t.element_size() >= large.IN_PLACE_BYTES
        assert (base <= model[name].data_ptr() < base + len(got)) == big, name   # a view, not a copy
        assert model[name].data_ptr() % t.element_size() == 0, name
    assert got[:] != data                            # moved to be aligned: in the file, not in memory
    assert _mapped(tmp_path) == 1
    del got, env, model
    gc.collect()
    assert _mapped(tmp_path) == 0 and _open_files(tmp_path) == 0     # gone with its last tensor
    assert spooled.mapped_bytes() == 0


def test_a_message_below_the_threshold_or_with_spooling_off_stays_in_memory(tmp_path):
    data = encode_envelope("updates", 2, (0,), 1, 0.5, _content())
    for reasm in (Reassembler(len(data), 2 * MIB, spool_at=len(data) + 1, spool_dir=str(tmp_path)),
                  Reassembler(len(data), 2 * MIB)):
        got = _feed(reasm, _frames(data))
        assert isinstance(got, bytearray) and got == data


def test_a_spooled_message_that_fails_its_check_or_is_cut_frees_its_file(tmp_path):
    data = encode_envelope("updates", 2, (0,), 1, 0.5, _content())
    chunks = _frames(data)
    bad = pb.Chunk()
    bad.CopyFrom(chunks[-1])
    bad.data = bytes([bad.data[0] ^ 1]) + bad.data[1:]      # one bit flipped in the last chunk
    reasm = Reassembler(len(data), 2 * MIB, spool_at=16 * MIB, spool_dir=str(tmp_path))
    with pytest.raises(WireError, match="SHA-256 mismatch"):
        _feed(reasm, chunks[:-1] + [bad])
    assert _open_files(tmp_path) == 0 and not reasm.in_progress
    _feed(reasm, chunks[:3])
    assert _open_files(tmp_path) == 1 and reasm.in_progress
    with pytest.raises(WireError, match="stream ended inside message 1"):
        reasm.end_of_stream()
    assert _open_files(tmp_path) == 0
    _feed(reasm, chunks[:3])
    reasm.drop()                                             # the stream closed by the server
    assert _open_files(tmp_path) == 0
    assert reasm.stalled(1.0, 1.0) is None


def test_a_spool_folder_that_cannot_take_the_file_leaves_the_message_in_memory(tmp_path, caplog, monkeypatch):
    data = encode_envelope("updates", 2, (0,), 1, 0.5, _content())
    monkeypatch.setattr("fedcore.comm.chunking._said", [])
    gone = tmp_path / "gone"                                  # no such folder: the file cannot be made
    with caplog.at_level(logging.WARNING, logger="fedcore.deploy"):
        got = _feed(Reassembler(len(data), 2 * MIB, spool_at=16 * MIB, spool_dir=str(gone)), _frames(data))
    assert isinstance(got, bytearray) and got == data
    assert "could not be kept in a file" in caplog.text
    # a file that cannot be mapped (no address space left): read back whole
    real_map = spooled.mmap.mmap

    def no_room(*a, **k):
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(spooled.mmap, "mmap", no_room)
    got = _feed(Reassembler(len(data), 2 * MIB, spool_at=16 * MIB, spool_dir=str(tmp_path)), _frames(data))
    assert isinstance(got, bytearray) and got == data and _open_files(tmp_path) == 0
    monkeypatch.setattr(spooled.mmap, "mmap", real_map)
    # a write that fails half way (a full disk): what was written comes back, the rest follows
    writes = []

    def full_disk(self, chunk):
        if writes:
            raise OSError(28, "No space left on device")
        writes.append(len(chunk))
        return real(self, chunk)
    real = spooled.Spool.write
    monkeypatch.setattr(spooled.Spool, "write", full_disk)
    got = _feed(Reassembler(len(data), 2 * MIB, spool_at=16 * MIB, spool_dir=str(tmp_path)), _frames(data))
    assert isinstance(got, bytearray) and got == data and writes
    assert _open_files(tmp_path) == 0


def test_pages_read_a_slice_at_a_time_go_back_and_read_again_unchanged(tmp_path):
    values = torch.arange(16 * MIB // 4, dtype=torch.float32)
    spool = spooled.Spool(str(tmp_path))
    spool.write(values.numpy().tobytes())
    mm = spool.mapping()
    t = torch.frombuffer(mm, dtype=torch.float32)

    address = t.data_ptr()

    def resident_kib() -> int:
        return mapping_rss_kib(address)
    assert bool(torch.equal(t, values))                      # read whole: every page resident
    assert resident_kib() >= 16 * 1024 - 64
    assert get_form("torch").all_finite(t)                   # the check reads a slice at a time
    assert resident_kib() <= 8 * 1024                        # ... and gives each slice back
    running = RunningMean()
    running.fold({"w": t}, 2.0)                              # the fold too
    assert resident_kib() <= 8 * 1024
    assert torch.equal(running.mean()["w"], values)          # the sum read every value as written
    assert torch.equal(t, values)                            # released pages read back unchanged
    del t
    mm.close()
    spooled.release(torch.zeros(3))                          # any other memory: left alone
