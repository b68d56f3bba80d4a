"""SplitNN in a vertical course equals training the composed model centrally on the joined
columns (float64, SGD and Adam), and bad vertical input exits 2 in one line."""
from __future__ import annotations

import csv

import pytest
import torch

pytest.importorskip("cryptography", reason="vertical courses need the 'vertical' extra (pip install 'fedcore[vertical]')")

import fedcore  # noqa: E402
from fedcore.algorithms.splitnn import batch_rows, bottom_model, top_model  # noqa: E402
from fedcore.kernel.config import load_config  # noqa: E402
from fedcore.scenarios.vertical_data import party_tables, train_test_ids  # noqa: E402

BASE = {"seed": 3, "verbose": False, "data.type": "synthetic", "data.partition": "vertical",
        "data.synthetic.samples_per_client": 20, "data.synthetic.dim": 7, "data.synthetic.num_classes": 3,
        "federate.client_num": 4, "federate.total_round_num": 2, "data.test_size": 0.25,
        "vertical.parties": 3, "vertical.keep": 0.8, "vertical.cut": 4, "vertical.bottom_hidden": [5],
        "model.dtype": "float64", "train.batch_size": 8, "train.optimizer.lr": 0.05}


def _central(cfg) -> dict[str, torch.Tensor]:
    """The composed model trained in one process on the joined columns, one optimizer."""
    tables = party_tables(cfg)
    shared = sorted(set.intersection(*(set(t.ids) for t in tables)))     # a plain intersection
    train_ids, _ = train_test_ids(shared, cfg)
    xs = [t.aligned(train_ids).x for t in tables]
    y = tables[0].aligned(train_ids).y
    bottoms = [bottom_model(cfg, p, x.shape[1]) for p, x in enumerate(xs)]
    top = top_model(cfg, len(xs), tables[0].num_classes)
    params = [p for m in [top, *bottoms] for p in m.parameters()]
    opt = (torch.optim.SGD(params, lr=cfg["train.optimizer.lr"]) if cfg["train.optimizer.type"] == "sgd"
           else torch.optim.Adam(params, lr=cfg["train.optimizer.lr"]))
    n, bs = len(y), cfg["train.batch_size"]
    steps = -(-n // bs) * cfg["federate.total_round_num"]
    for s in range(steps):
        rows = batch_rows(cfg["seed"], n, bs, s)
        logits = top(torch.cat([b(x[rows]) for b, x in zip(bottoms, xs)], dim=1))
        loss = torch.nn.functional.cross_entropy(logits, y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {f"top.{k}": v for k, v in top.state_dict().items()}
    for p, b in enumerate(bottoms):
        out.update({f"bottom{p}.{k}": v for k, v in b.state_dict().items()})
    return out


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_splitnn_equals_the_composed_model_trained_centrally(tmp_path, optimizer):
    over = {**BASE, "train.optimizer.type": optimizer, "outdir": str(tmp_path)}
    result = fedcore.run(over)
    final = torch.load(tmp_path / "final_model.pt", weights_only=True)
    expected = _central(load_config(None, extra=over))
    assert sorted(final) == sorted(expected)
    for k, v in expected.items():
        torch.testing.assert_close(final[k], v, rtol=0, atol=1e-12)
    shared = set.intersection(*(set(t.ids) for t in party_tables(load_config(None, extra=over))))
    assert result.summary["psi_intersection"] == len(shared) < 80
    rec = result.records[-1]
    assert rec["bytes_party_1"] > 0 and rec["bytes_party_2"] > 0 and "virtual_time_party_2" in rec


def test_gradient_noise_changes_only_what_the_passive_parties_receive(tmp_path):
    exact = fedcore.run({**BASE, "outdir": str(tmp_path / "a")})
    noisy = fedcore.run({**BASE, "outdir": str(tmp_path / "b"), "vertical.gradient_noise": 0.5})
    fa = torch.load(tmp_path / "a" / "final_model.pt", weights_only=True)
    fb = torch.load(tmp_path / "b" / "final_model.pt", weights_only=True)
    assert not torch.equal(fa["bottom1.1.weight"], fb["bottom1.1.weight"])
    assert exact.summary["psi_intersection"] == noisy.summary["psi_intersection"]


def _cli(tmp_path, capsys, *args) -> tuple[int, str]:
    """`python -m fedcore.run`'s entry point in this process (the command itself is tested by
    the docs commands): its exit code and what it wrote to stderr."""
    from fedcore.run import main
    code = main([*args, "verbose=false", f"outdir={tmp_path / 'out'}"])
    return code, capsys.readouterr().err


def _yaml(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_bad_vertical_input_exits_2_in_one_line(tmp_path, capsys):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    with open(a, "w", newline="") as f:
        csv.writer(f).writerows([["id", "u", "label"], ["p1", 1, 0], ["p2", 2, 1]])
    with open(b, "w", newline="") as f:
        csv.writer(f).writerows([["id", "v"], ["q1", 1], ["q2", 2]])
    cfg = _yaml(tmp_path, f"data: {{partition: vertical}}\nvertical: {{files: ['{a}', '{b}']}}\n")
    for args, key in (((), "do not intersect"), (("vertical.parties=1",), "vertical.parties"),
                      (("vertical.columns=[[u],[w]]",), "vertical.columns: party 1 names column 'w'")):
        code, stderr = _cli(tmp_path, capsys, "--cfg", cfg, *args)
        assert code == 2, stderr
        assert key in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_a_course_on_the_users_csv_files_trains_on_the_shared_ids(tmp_path):
    import random
    rng = random.Random(0)
    a_rows = [[f"c{i}", rng.gauss(0, 1), rng.gauss(0, 1), i % 2] for i in range(0, 60)]
    b_rows = [[f"c{i}", rng.gauss(0, 1)] for i in range(20, 90)]        # shares c20..c59 with a
    with open(tmp_path / "a.csv", "w", newline="") as f:
        csv.writer(f).writerows([["id", "f1", "f2", "label"], *a_rows])
    with open(tmp_path / "b.csv", "w", newline="") as f:
        csv.writer(f).writerows([["id", "g1"], *b_rows])
    result = fedcore.run({"seed": 0, "verbose": False, "data.partition": "vertical",
                          "vertical.files": [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")],
                          "federate.total_round_num": 1, "train.batch_size": 8, "outdir": str(tmp_path / "o")})
    assert result.summary["psi_intersection"] == 40
    assert result.summary["total_params"] > 0 and "test_acc" in result.records[-1]
