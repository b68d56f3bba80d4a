"""`fedcore.scenarios.describe`: histograms, entropy, the PNG heat map and the CLI."""
from __future__ import annotations

import numpy as np
import pytest

from fedcore.scenarios.describe import heat_map, label_entropy, main


def read_image(path) -> np.ndarray:
    """Decode an image file with matplotlib (Pillow underneath): H x W x channels."""
    import matplotlib.image
    return matplotlib.image.imread(path)


def test_label_entropy_by_hand():
    hist = np.array([[5, 5, 0, 0], [1, 1, 1, 1], [7, 0, 0, 0], [0, 0, 0, 0]])
    assert label_entropy(hist) == pytest.approx([np.log(2), np.log(4), 0.0, 0.0])


@pytest.mark.extra("plot")
def test_heat_map_rows_are_label_distributions(tmp_path):
    fig = heat_map(np.array([[4, 0], [1, 1], [0, 0]]), tmp_path / "h.png")
    drawn = fig.axes[0].images[0].get_array()
    assert np.array_equal(drawn, [[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]])  # an empty client stays 0
    width, height = fig.get_size_inches() * fig.dpi
    assert read_image(tmp_path / "h.png").shape[:2] == (round(height), round(width))


@pytest.mark.extra("plot")
def test_heat_map_format_follows_the_suffix(tmp_path):
    heat_map(np.array([[1, 2]]), tmp_path / "h.svg")
    heat_map(np.array([[1, 2]]), tmp_path / "h.pdf")
    assert (tmp_path / "h.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "h.pdf").read_bytes()[:5] == b"%PDF-"


@pytest.mark.extra("plot")
@pytest.mark.extra("data")
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
    assert read_image(png).ndim == 3 and read_image(png).shape[0] > 100


def test_cli_bad_config_exits_2(capsys):
    assert main(["data.type=mnist", "data.root=/nonexistent"]) == 2
    assert "mnist files not found" in capsys.readouterr().err
