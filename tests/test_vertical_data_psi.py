"""Vertical partitioner (columns across parties, ids per party) and DH-PSI, tested as a curious
party would try."""
from __future__ import annotations

import csv

import pytest
import torch

pytest.importorskip("cryptography", reason="PSI needs the 'vertical' extra (pip install 'fedcore[vertical]')")

from fedcore.algorithms.psi import PsiActive, PsiKey, hash_to_point, intersect, passive_reply  # noqa: E402
from fedcore.kernel.errors import ConfigError  # noqa: E402
from fedcore.scenarios.data import raw_dataset  # noqa: E402
from fedcore.scenarios.vertical_data import party_tables, train_test_ids  # noqa: E402
from tests.conftest import small_cfg  # noqa: E402


def _cfg(**over):
    return small_cfg(data__partition="vertical", **over)


def test_even_split_holds_every_column_once_and_labels_only_at_the_active_party():
    cfg = _cfg(vertical__parties=3)
    raw = raw_dataset(cfg)
    x = torch.cat([raw.x, raw.test.x]) if raw.test is not None else raw.x
    tables = party_tables(cfg)
    assert [t.columns for t in tables] == [["x0", "x1", "x2"], ["x3", "x4", "x5"], ["x6", "x7"]]
    assert torch.equal(torch.cat([t.x for t in tables], dim=1), x.to(tables[0].x.dtype))
    assert tables[0].y is not None and tables[1].y is None and tables[2].y is None


def test_configured_columns_and_keep_fraction():
    cfg = _cfg(vertical__columns=[["x7", 0], [3, "x5"]], vertical__keep=0.5)
    tables = party_tables(cfg)
    n = len(raw_dataset(cfg).y) + (len(raw_dataset(cfg).test.y) if raw_dataset(cfg).test is not None else 0)
    assert tables[0].columns == ["x7", "x0"] and tables[1].columns == ["x3", "x5"]
    assert [len(t.ids) for t in tables] == [round(n / 2)] * 2
    assert set(tables[0].ids) != set(tables[1].ids)        # seeded per party: PSI has work to do
    row = tables[1].aligned([tables[1].ids[3]])
    assert torch.equal(row.x, tables[1].x[3:4])


@pytest.mark.parametrize("over, key", [
    ({"vertical__parties": 1}, "vertical.parties"),
    ({"vertical__columns": [["x0"], ["x99"]]}, "vertical.columns"),
    ({"vertical__columns": [["x0"]]}, "vertical.columns"),
])
def test_bad_vertical_config_is_one_line_naming_the_key(over, key):
    with pytest.raises(ConfigError, match=key):
        party_tables(_cfg(**over))


def _write(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


def test_user_csv_files_per_party(tmp_path):
    a = _write(tmp_path / "a.csv", ["id", "age", "label"], [["u1", 30, "no"], ["u2", 40, "yes"], ["u3", 50, "no"]])
    b = _write(tmp_path / "b.csv", ["id", "income", "debt"], [["u3", 5, 1], ["u9", 6, 2], ["u1", 7, 3]])
    tables = party_tables(_cfg(vertical__files=[a, b]))
    assert tables[0].columns == ["age"] and tables[1].columns == ["income", "debt"]
    assert tables[0].y.tolist() == [0, 1, 0] and tables[0].num_classes == 2 == tables[1].num_classes
    shared = intersect([tables[0].ids, tables[1].ids])
    assert shared == ["u1", "u3"]
    assert tables[1].aligned(shared).x.tolist() == [[7.0, 3.0], [5.0, 1.0]]
    with pytest.raises(ConfigError, match="vertical.columns: party 1 names column 'age'"):
        party_tables(_cfg(vertical__files=[a, b], vertical__columns=[["age"], ["age"]]))
    with pytest.raises(ConfigError, match="vertical.files: party 1's file .* has no column 'id'"):
        party_tables(_cfg(vertical__files=[a, _write(tmp_path / "c.csv", ["key", "v"], [["u1", 1]])]))


def test_train_test_split_is_seeded_and_disjoint():
    cfg = _cfg(data__test_size=0.25)
    ids = [f"s{i}" for i in range(40)]
    tr, te = train_test_ids(ids, cfg)
    assert len(te) == 10 and not set(tr) & set(te) and sorted(tr + te) == sorted(ids)
    assert (tr, te) == train_test_ids(list(reversed(ids)), cfg)


# ------------------------------------------------------------------ PSI
def test_psi_equals_the_plain_intersection():
    sets = [[f"u{i}" for i in range(0, 60)], [f"u{i}" for i in range(30, 90)], [f"u{i}" for i in range(40, 55)] + ["zz"]]
    expected = sorted(set(sets[0]) & set(sets[1]) & set(sets[2]))
    assert intersect(sets) == expected
    assert intersect([["a", "b"], ["c"]]) == []


def test_blinding_commutes_and_hides_the_hash():
    a, b = PsiKey(), PsiKey()
    p = hash_to_point("alice")
    assert a.blind(b.blind(p)) == b.blind(a.blind(p))
    assert a.blind(p) != p and a.blind(p) != b.blind(p)


def test_curious_passive_party_cannot_recover_the_active_partys_other_ids():
    """B holds its own secret b and sees A's request. Guessing an id g, B can compute H(g) and
    b·H(g), but no function of its view matches A's blinded points without a."""
    active_ids = [f"u{i}" for i in range(50)]                 # u0..u49; B holds u40..u59
    b = PsiKey()
    active = PsiActive(active_ids)
    request = active.request()
    guesses = [f"u{i}" for i in range(100)]                 # includes every id A holds
    seen = set(request)
    assert not seen & {hash_to_point(g) for g in guesses}
    assert not seen & {b.blind(hash_to_point(g)) for g in guesses}
    # the request for A's set with u0 replaced by an id that exists nowhere has the same shape,
    # and nothing in B's view matches between the two runs (fresh secret each course)
    other = PsiActive(["nobody"] + active_ids[1:]).request()
    assert len(other) == len(request) and all(len(p) == 32 for p in other)
    assert not set(other) & seen
    # B's result after the round: only the shared ids, never the others
    reblinded, theirs = passive_reply([f"u{i}" for i in range(40, 60)], request, b)
    assert active.receive(1, reblinded, theirs) == {f"u{i}" for i in range(40, 50)}
    assert active.shared() == sorted(f"u{i}" for i in range(40, 50))


def test_curious_active_party_learns_only_the_intersection():
    """A sees B's blinded set b·H(y) in a shuffled order; A's guesses blinded by a do not match
    it, and a·b·H(y) matches only A's own doubled points: B's other ids stay hidden."""
    a = PsiKey()
    active = PsiActive(["u1", "u2"], key=a)
    passive_ids = ["u2", "secret1", "secret2"]
    reblinded, theirs = passive_reply(passive_ids, active.request())
    guesses = ["secret1", "secret2", "u1", "u2"]
    assert not set(theirs) & ({hash_to_point(g) for g in guesses} | set(a.blind_ids(guesses)))
    assert active.receive(1, reblinded, theirs) == {"u2"}
