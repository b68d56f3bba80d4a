"""Edge cases of `python -m fedcore.run`: one line naming the key or file, exit 2; --check writes
nothing unless an outdir is named."""
import collections

import torch

from fedcore.run import main

SMALL = "federate: {client_num: 3, total_round_num: 1}\ndata: {synthetic: {samples_per_client: 20}}\n"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_empty_yaml_is_refused(tmp_path, capsys):
    (tmp_path / "e.yaml").write_text("")
    code, err = run(capsys, "--cfg", tmp_path / "e.yaml")
    assert code == 2 and len(err) == 1 and "is empty" in err[0]


def test_plugin_that_raises_on_import(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text("import fedcore\nvalue = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "c.yaml").write_text(SMALL)
    code, err = run(capsys, "--cfg", tmp_path / "c.yaml", "plugins=[broken_plugin]")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("fedcore: plugins: importing 'broken_plugin' failed at ")
    assert "broken_plugin.py:2: ZeroDivisionError" in err[0]


def test_unusable_outdir(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(SMALL)
    (tmp_path / "a_file").write_text("x")
    for outdir in (tmp_path / "a_file", tmp_path / "a_file" / "sub"):
        code, err = run(capsys, "--cfg", tmp_path / "c.yaml", f"outdir={outdir}")
        assert code == 2 and len(err) == 1 and err[0].startswith(f"fedcore: outdir: cannot create '{outdir}'")


def test_garbage_torch_files_never_suggest_unpickling(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(SMALL)
    (tmp_path / "noise.pt").write_bytes(bytes(range(256)) * 3)
    torch.save({"model": collections.OrderedDict(a=torch.zeros(1)), "hook": print}, tmp_path / "objects.pt")
    for key in ("resume_from", "model.init_from"):
        for f, why in (("noise.pt", "not a file written by torch.save"),
                       ("objects.pt", "fedcore never unpickles those")):
            code, err = run(capsys, "--cfg", tmp_path / "c.yaml", f"{key}={tmp_path / f}",
                            f"outdir={tmp_path / 'o'}")
            assert code == 2 and len(err) == 1, err
            assert err[0].startswith(f"fedcore: {key}: '{tmp_path / f}' is not") and why in err[0]
            assert "weights_only" not in err[0]


def test_check_writes_nothing_unless_an_outdir_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(SMALL)
    assert main(["--cfg", "c.yaml", "--check"]) == 0
    assert "set outdir=DIR" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]   # no runs/ folder
    assert main(["--cfg", "c.yaml", "--check", "outdir=named"]) == 0
    assert sorted(p.name for p in (tmp_path / "named").iterdir()) == [
        "config.yaml", "config_sources.yaml", "handlers.txt", "message_flow.graphml"]
