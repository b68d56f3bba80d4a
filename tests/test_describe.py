"""`fedcore.scenarios.describe`: histograms, entropy, the PNG heat map and the CLI."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from fedcore.scenarios.describe import heat_map, label_entropy, main
from fedcore.scenarios.png import heat_colors, write_png


def read_png(path) -> np.ndarray:
    """Decode an 8-bit RGB, filter-0 PNG (what write_png produces)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    w, h, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color) == (8, 2)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def test_label_entropy_by_hand():
    hist = np.array([[5, 5, 0, 0], [1, 1, 1, 1], [7, 0, 0, 0], [0, 0, 0, 0]])
    assert label_entropy(hist) == pytest.approx([np.log(2), np.log(4), 0.0, 0.0])


def test_png_round_trip_and_color_ends(tmp_path):
    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    write_png(tmp_path / "a.png", img)
    assert np.array_equal(read_png(tmp_path / "a.png"), img)
    assert heat_colors(np.array([0.0])).tolist() == [[255, 255, 255]]
    assert heat_colors(np.array([1.0])).tolist() == [[103, 0, 13]]


def test_heat_map_rows_are_label_distributions(tmp_path):
    heat_map(np.array([[4, 0], [1, 1]]), tmp_path / "h.png", cell=2)
    img = read_png(tmp_path / "h.png")
    assert img.shape == (4, 4, 3)
    assert img[0, 0].tolist() == [103, 0, 13] and img[0, 2].tolist() == [255, 255, 255]
    assert img[2, 0].tolist() == img[2, 2].tolist() == heat_colors(np.array([0.5]))[0].tolist()


def test_cli_prints_sizes_and_histograms_and_writes_png(tmp_path, capsys):
    png = tmp_path / "d.png"
    rc = main(["data.type=digits", "data.partition=shards", "data.shards_per_client=2",
               "federate.client_num=5", "data.test_size=0.2", "--png", str(png)])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[2:7]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4", "5"]
    assert all(sum(int(v) > 0 for v in r[4:]) == 2 for r in rows)  # two labels per client
    assert sum(int(r[1]) + int(r[2]) + int(r[3]) for r in rows) == 1797 - round(0.2 * 1797)
    assert "server_test=359" in out[0]
    assert read_png(png).shape == (5 * 8, 10 * 8, 3)


def test_cli_bad_config_exits_2(capsys):
    assert main(["data.type=mnist", "data.root=/nonexistent"]) == 2
    assert "mnist files not found" in capsys.readouterr().err
