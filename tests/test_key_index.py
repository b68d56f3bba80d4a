"""The packaged key index (what --help-key and --list-keys read without importing the plug-ins)
is the live schema, and the command line's fast path imports neither plug-ins nor torch."""
import subprocess
import sys

from fedcore.kernel import key_index


def _python(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def test_the_packaged_index_is_the_live_schema():
    # in a fresh process: tests register plug-ins of their own in this one
    r = _python("-m", "fedcore.kernel.key_index", "--check")
    assert r.returncode == 0, r.stderr


def test_the_check_sees_an_index_that_differs_from_the_schema(tmp_path, monkeypatch):
    monkeypatch.setattr(key_index, "INDEX", tmp_path / "key_index.json")
    assert key_index.main(["--check"]) == 1   # missing
    assert key_index.main([]) == 0 and key_index.main(["--check"]) == 0
    text = key_index.INDEX.read_text()
    key_index.INDEX.write_text(text.replace('"default": "10"', '"default": "11"', 1))
    assert key_index.main(["--check"]) == 1


def test_help_key_answers_from_the_index_without_plug_ins_or_torch():
    probe = ("import sys; from fedcore.run import main; main(['--help-key', 'federate.total_round_num']); "
             "print(sorted(m for m in ('torch', 'fedcore.handlers', 'fedcore.algorithms', "
             "'fedcore.scenarios') if m in sys.modules))")
    r = _python("-c", probe)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "[]"
    # the answer follows schema.py's declaration: int, default 10, its help line
    assert lines[0] == "federate.total_round_num: int, default 10" and lines[1].startswith("  rounds")


def test_a_section_reads_the_same_from_the_index_and_from_the_live_schema():
    packaged = key_index.describe_key("distribute.tls", packaged=True)
    assert packaged == key_index.describe_key("distribute.tls")
    # the four distribute.tls.* keys distributed.py declares, in order
    assert [line.split(":")[0] for line in packaged.splitlines() if not line.startswith(" ")] == [
        "distribute.tls.ca", "distribute.tls.cert", "distribute.tls.key", "distribute.tls.server_name"]
