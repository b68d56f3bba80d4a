"""Loaders read small files written here in each published on-disk format, exactly."""
from __future__ import annotations

import gzip
import hashlib
import json
import struct

import numpy as np
import pytest
import torch

from fedcore.kernel.errors import ConfigError
from fedcore.run import main
from fedcore.scenarios.data import build_federated_data, raw_dataset
from fedcore.scenarios.datasets import files, idx
from fedcore.scenarios.datasets.idx import read_idx
from fedcore.scenarios.datasets.leaf import LEAF_LETTERS
from tests.conftest import small_cfg


def write_idx(path, array: np.ndarray, code: int = 0x08, big_endian: str = ">u1"):
    """IDX: 0, 0, type code, ndim, big-endian uint32 dims, big-endian values."""
    body = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    body += array.astype(big_endian).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(body)


def mnist_files(root, prefix="", test_stem="t10k", n=(5, 3), gz=False, classes=10, label_base=0):
    rng = np.random.default_rng(0)
    out = {}
    for stem, count in (("train", n[0]), (test_stem, n[1])):
        x = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        y = rng.integers(label_base, classes + label_base, count).astype(np.uint8)
        ext = ".gz" if gz else ""
        write_idx(root / f"{prefix}{stem}-images-idx3-ubyte{ext}", x)
        write_idx(root / f"{prefix}{stem}-labels-idx1-ubyte{ext}", y)
        out[stem] = (x, y)
    return out


@pytest.mark.parametrize("gz", [False, True])
def test_idx_round_trip_uint8_and_wider_types(tmp_path, gz):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / f"a{'.gz' if gz else ''}", a)
    assert np.array_equal(read_idx(tmp_path / f"a{'.gz' if gz else ''}"), a)
    b = np.array([[-70000, 3], [5, 2**30]], dtype=np.int32)
    write_idx(tmp_path / "b", b, code=0x0C, big_endian=">i4")
    assert np.array_equal(read_idx(tmp_path / "b"), b)


def test_idx_rejects_bad_magic_and_truncation(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ConfigError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", np.zeros((4, 2), np.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-1])
    with pytest.raises(ConfigError, match="truncated"):
        read_idx(tmp_path / "short")


@pytest.mark.parametrize("dataset,gz", [("mnist", False), ("fashion_mnist", True)])
def test_mnist_family_reads_images_labels_and_official_test(tmp_path, dataset, gz):
    ref = mnist_files(tmp_path, gz=gz)
    raw = raw_dataset(small_cfg(data__type=dataset, data__root=str(tmp_path)))
    assert raw.x.shape == (5, 1, 28, 28) and raw.num_classes == 10
    assert torch.equal(raw.x[:, 0], torch.from_numpy(ref["train"][0]).float() / 255)
    assert torch.equal(raw.y, torch.from_numpy(ref["train"][1].astype(np.int64)))
    assert torch.equal(raw.test.x[:, 0] * 255, torch.from_numpy(ref["t10k"][0]).float())
    assert raw.test.y.tolist() == ref["t10k"][1].tolist()


def test_emnist_letters_are_transposed_and_relabelled_from_zero(tmp_path):
    ref = mnist_files(tmp_path, prefix="emnist-letters-", test_stem="test", classes=26, label_base=1)
    raw = raw_dataset(small_cfg(data__type="emnist", data__root=str(tmp_path),
                                data__emnist__split="letters"))
    assert raw.num_classes == 26
    assert torch.equal(raw.x[0, 0] * 255, torch.from_numpy(ref["train"][0][0].T.copy()).float())
    assert raw.y.tolist() == [int(v) - 1 for v in ref["train"][1]]
    assert raw.test.y.tolist() == [int(v) - 1 for v in ref["test"][1]]


def write_cifar(path, labels: np.ndarray, images: np.ndarray):
    """Records of label byte(s) then 3072 pixel bytes (R plane, G plane, B plane)."""
    rows = [bytes(lab.tolist()) + img.tobytes() for lab, img in zip(labels, images)]
    path.write_bytes(b"".join(rows))


def test_cifar10_binary_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    rng = np.random.default_rng(1)
    train_x, train_y = [], []
    for i in range(1, 6):
        x = rng.integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, (2, 1), dtype=np.uint8)
        write_cifar(folder / f"data_batch_{i}.bin", y, x)
        train_x.append(x)
        train_y.append(y[:, 0])
    tx = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
    ty = np.array([[9], [0], [4]], dtype=np.uint8)
    write_cifar(folder / "test_batch.bin", ty, tx)
    raw = raw_dataset(small_cfg(data__type="cifar10", data__root=str(tmp_path)))
    assert raw.x.shape == (10, 3, 32, 32)
    assert torch.equal(raw.x * 255, torch.from_numpy(np.concatenate(train_x)).float())
    assert raw.y.tolist() == np.concatenate(train_y).tolist()
    assert raw.test.y.tolist() == [9, 0, 4] and raw.test.x[1, 2, 31, 31] * 255 == tx[1, 2, 31, 31]


@pytest.mark.parametrize("labels,classes,expected", [("fine", 100, [57, 99]), ("coarse", 20, [3, 19])])
def test_cifar100_fine_and_coarse_labels(tmp_path, labels, classes, expected):
    x = np.zeros((2, 3, 32, 32), dtype=np.uint8)
    write_cifar(tmp_path / "train.bin", np.array([[3, 57], [19, 99]], np.uint8), x)
    write_cifar(tmp_path / "test.bin", np.array([[0, 1]], np.uint8), x[:1])
    raw = raw_dataset(small_cfg(data__type="cifar100", data__root=str(tmp_path),
                                data__cifar100__labels=labels))
    assert raw.num_classes == classes and raw.y.tolist() == expected


def test_cifar_rejects_partial_records(tmp_path):
    (tmp_path / "train.bin").write_bytes(b"\x00" * 3000)
    (tmp_path / "test.bin").write_bytes(b"\x00" * 3074)
    with pytest.raises(ConfigError, match="not a CIFAR binary file"):
        raw_dataset(small_cfg(data__type="cifar100", data__root=str(tmp_path)))


def write_leaf(path, users: dict[str, tuple[list, list]]):
    doc = {"users": list(users), "num_samples": [len(v[1]) for v in users.values()],
           "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def test_leaf_femnist_natural_users_and_test_files(tmp_path):
    img = [[i / 784 for i in range(784)]]
    base = tmp_path / "data"
    write_leaf(base / "train" / "a.json", {"w1": (img * 2, [3, 61]), "w2": (img, [0])})
    write_leaf(base / "train" / "b.json", {"w3": (img * 3, [5, 6, 7])})
    write_leaf(base / "test" / "a.json", {"w1": (img, [4]), "w3": (img, [8])})
    cfg = small_cfg(data__type="leaf_femnist", data__root=str(base), federate__client_num=3)
    raw = raw_dataset(cfg)
    assert raw.x.shape == (6, 1, 28, 28) and raw.num_classes == 62
    assert raw.x[0, 0, 1, 0].item() == pytest.approx(28 / 784)
    assert raw.y.tolist() == [3, 61, 0, 5, 6, 7] and raw.groups.tolist() == [0, 0, 1, 2, 2, 2]
    assert raw.test.y.tolist() == [4, 8]
    parent = raw_dataset(cfg.with_overrides(data__root=str(tmp_path)))
    assert parent.y.tolist() == raw.y.tolist()  # data/<name> works as well as data/<name>/data
    fed = build_federated_data(cfg.with_overrides(data__splits=[1.0, 0.0, 0.0]))
    assert [len(c.train) for c in fed.clients.values()] == [2, 1, 3]


def test_leaf_shakespeare_encodes_characters(tmp_path):
    write_leaf(tmp_path / "train" / "x.json", {"ROMEO": (["ab~", "Hi!"], ["c", "\n"])})
    raw = raw_dataset(small_cfg(data__type="leaf_shakespeare", data__root=str(tmp_path)))
    assert raw.num_classes == len(LEAF_LETTERS) == 80
    idx_of = LEAF_LETTERS.index
    assert raw.x.tolist() == [[idx_of("a"), idx_of("b"), idx_of(" ")],
                              [idx_of("H"), idx_of("i"), idx_of("!")]]
    assert raw.y.tolist() == [idx_of("c"), 0] and raw.x.dtype == torch.long


def test_leaf_femnist_wrong_image_size_is_a_config_error(tmp_path):
    write_leaf(tmp_path / "train" / "a.json", {"w": ([[0.0] * 783], [1])})
    with pytest.raises(ConfigError, match="784"):
        raw_dataset(small_cfg(data__type="leaf_femnist", data__root=str(tmp_path)))


def test_leaf_synthetic_and_num_samples_mismatch(tmp_path):
    write_leaf(tmp_path / "all" / "s.json", {"0": ([[1.0, 2.0]], [4]), "1": ([[3.0, 4.0]], [1])})
    raw = raw_dataset(small_cfg(data__type="leaf_synthetic", data__root=str(tmp_path / "all"),
                                data__test_size=0.0))
    assert raw.num_classes == 5 and raw.x.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    doc = json.loads((tmp_path / "all" / "s.json").read_text())
    doc["num_samples"] = [2, 1]
    (tmp_path / "all" / "s.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="num_samples 2"):
        raw_dataset(small_cfg(data__type="leaf_synthetic", data__root=str(tmp_path / "all")))


def test_csv_natural_clients_and_server_hold_out(tmp_path):
    path = tmp_path / "t.csv"
    lines = ["f1,label,site,f2"] + [f"{i},{'yes' if i % 3 else 'no'},s{i % 2},{-i}" for i in range(10)]
    path.write_text("\n".join(lines) + "\n")
    raw = raw_dataset(small_cfg(data__type="csv", data__root=str(path), data__client_column="site",
                                data__test_size=0.0))
    assert raw.x[:, 0].tolist() == list(range(10)) and raw.x[:, 1].tolist() == [-i for i in range(10)]
    assert raw.y.tolist() == [0 if i % 3 == 0 else 1 for i in range(10)] and raw.num_classes == 2
    assert raw.groups.tolist() == [i % 2 for i in range(10)]
    held = raw_dataset(small_cfg(data__type="csv", data__root=str(path), data__test_size=0.3,
                                 data__client_column="site",
                                 data__partition="iid"))
    assert held.groups.tolist() == [int(v) % 2 for v in held.x[:, 0].tolist()]
    assert len(held.y) == 7 and len(held.test.y) == 3
    assert sorted(held.x[:, 0].tolist() + held.test.x[:, 0].tolist()) == list(range(10))


@pytest.mark.extra("data")
def test_digits_is_bundled_real_data():
    raw = raw_dataset(small_cfg(data__type="digits", data__test_size=0.25))
    assert raw.input_shape == (1, 8, 8) and raw.num_classes == 10
    assert len(raw.y) + len(raw.test.y) == 1797 and len(raw.test.y) == round(0.25 * 1797)
    assert 0.0 <= float(raw.x.min()) and float(raw.x.max()) == 1.0


@pytest.mark.parametrize("dataset,expected", [
    ("mnist", "train-images-idx3-ubyte[.gz]"), ("fashion_mnist", "t10k-labels-idx1-ubyte[.gz]"),
    ("emnist", "emnist-byclass-train-images-idx3-ubyte"), ("cifar10", "data_batch_1.bin"),
    ("cifar100", "train.bin"), ("leaf_femnist", "train/*.json"), ("leaf_shakespeare", "preprocess.sh"),
])
def test_missing_files_fail_in_one_line_with_exit_2(tmp_path, capsys, dataset, expected):
    (tmp_path / "c.yaml").write_text(f"data: {{type: {dataset}, root: {tmp_path / 'absent'}}}\n")
    assert main(["--cfg", str(tmp_path / "c.yaml"), f"outdir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err and "data.root" in err


def test_missing_csv_file_exits_2(tmp_path, capsys):
    assert main(["--check", "--cfg", "/dev/null", "data.type=csv", f"data.root={tmp_path}/no.csv",
                 f"outdir={tmp_path / 'o'}"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_checksum_verification_on_local_files(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"federated")
    digest = hashlib.md5(b"federated").hexdigest()
    assert files.md5sum(f) == digest
    files.verify(f, digest)
    with pytest.raises(ConfigError, match="checksum mismatch"):
        files.verify(f, "0" * 32)


def test_download_verifies_and_refuses_a_corrupt_copy(tmp_path):
    src = tmp_path / "src" / "x.bin"
    src.parent.mkdir()
    src.write_bytes(b"payload")
    good = files.Remote(src.as_uri(), hashlib.md5(b"payload").hexdigest())
    assert files.download(good, tmp_path / "dst" / "x.bin").read_bytes() == b"payload"
    with pytest.raises(ConfigError, match="checksum mismatch"):
        files.download(files.Remote(src.as_uri(), "f" * 32), tmp_path / "bad" / "x.bin")
    assert not any((tmp_path / "bad").iterdir())  # nothing half-written is left behind
    with pytest.raises(ConfigError, match="cannot fetch"):
        files.download(files.Remote((tmp_path / "gone").as_uri(), "0" * 32), tmp_path / "g" / "x")


def test_mnist_download_path_fetches_missing_files(tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    mnist_files(mirror, gz=True)
    sums = {p.name: files.md5sum(p) for p in mirror.iterdir()}
    monkeypatch.setattr(idx, "_MNIST_BASE", mirror.as_uri() + "/")
    monkeypatch.setattr(idx, "_MNIST_MD5", sums)
    root = tmp_path / "root"
    cfg = small_cfg(data__type="mnist", data__root=str(root), data__download=True)
    raw = raw_dataset(cfg)
    assert len(raw.y) == 5 and sorted(p.name for p in root.iterdir()) == sorted(sums)
    with pytest.raises(ConfigError, match="not found"):
        raw_dataset(cfg.with_overrides(data__download=False, data__root=str(tmp_path / "empty")))


def test_cifar10_download_extracts_only_expected_members(tmp_path, monkeypatch):
    import tarfile

    from fedcore.scenarios.datasets import cifar
    staging = tmp_path / "staging" / "cifar-10-batches-bin"
    staging.mkdir(parents=True)
    x = np.zeros((1, 3, 32, 32), np.uint8)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        write_cifar(staging / name, np.array([[7]], np.uint8), x)
    (staging / "readme.html").write_text("not data")
    archive = tmp_path / "mirror" / "cifar-10-binary.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(staging, arcname="cifar-10-batches-bin")
    spec = list(cifar._SPECS["cifar10"])
    spec[4] = files.Remote(archive.as_uri(), files.md5sum(archive))
    monkeypatch.setitem(cifar._SPECS, "cifar10", tuple(spec))
    root = tmp_path / "root"
    raw = raw_dataset(small_cfg(data__type="cifar10", data__root=str(root), data__download=True))
    assert raw.y.tolist() == [7] * 5 and raw.test.y.tolist() == [7]
    assert not (root / "cifar-10-batches-bin" / "readme.html").exists()
    spec[4] = files.Remote(archive.as_uri(), "0" * 32)  # a stale archive in data.root is re-verified
    monkeypatch.setitem(cifar._SPECS, "cifar10", tuple(spec))
    (root / "cifar-10-batches-bin" / "test_batch.bin").unlink()
    with pytest.raises(ConfigError, match="checksum mismatch"):
        raw_dataset(small_cfg(data__type="cifar10", data__root=str(root), data__download=True))


def test_emnist_download_takes_one_split_from_the_archive(tmp_path, monkeypatch):
    import zipfile
    staging = tmp_path / "staging"
    staging.mkdir()
    mnist_files(staging, prefix="emnist-digits-", test_stem="test", gz=True)
    mnist_files(staging, prefix="emnist-letters-", test_stem="test", gz=True, classes=26, label_base=1)
    archive = tmp_path / "gzip.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for f in staging.iterdir():
            zf.write(f, f"gzip/{f.name}")
    monkeypatch.setattr(idx, "_EMNIST_ZIP", files.Remote(archive.as_uri(), files.md5sum(archive)))
    root = tmp_path / "root"
    raw = raw_dataset(small_cfg(data__type="emnist", data__root=str(root), data__download=True,
                                data__emnist__split="digits"))
    assert raw.num_classes == 10 and len(raw.y) == 5 and len(raw.test.y) == 3
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("emnist-")) == sorted(
        p.name for p in staging.iterdir() if p.name.startswith("emnist-digits-"))
