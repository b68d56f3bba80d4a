"""The dashboard: its incremental feed, its fixed file tables, and the page in a real headless
Chromium drawing a finished run and updating when a round is written."""
from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path

import pytest

from fedcore.dashboard.app import STATIC, Dashboard
from fedcore.dashboard.feed import read_lines, run_update

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"   # the docs' picture: FEDCORE_SCREENSHOT=1 retakes it


def test_the_feed_reads_whole_lines_from_an_offset_and_starts_again_when_the_file_does(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text('{"round": 1, "test_acc": 0.5}\n{"round": 2, "test_acc": 0.')   # round 2 half-written
    got, offset = read_lines(f, 0)
    assert got == [{"round": 1, "test_acc": 0.5}] and offset == len('{"round": 1, "test_acc": 0.5}\n')
    with f.open("a") as fh:
        fh.write('75}\nnot json\n[1, 2]\n')
    got, offset2 = read_lines(f, offset)
    assert got == [{"round": 2, "test_acc": 0.75}] and offset2 == f.stat().st_size
    assert read_lines(f, offset2) == ([], offset2)
    f.write_text('{"round": 1}\n')   # a new run in the folder: shorter than the offset held
    assert read_lines(f, offset2) == ([{"round": 1}], len('{"round": 1}\n'))
    assert read_lines(tmp_path / "absent.jsonl", 7) == ([], 0)


def test_a_poll_sends_numbers_and_the_summary_s_own_fields_only(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"round": 1, "test_acc": 0.5, "note": "a string", "flag": True, "nan": None}) + "\n"
        + json.dumps({"late_eval": {"round": 1, "client": 2, "acc": 1.0}, "wall_time": 3.0}) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps({
        "rounds": 1, "best_test_acc": 0.5, "admission": {"non-finite update": 2},
        "deployment": {"clients": {"1": {"state": "left"}}, "refused": {"wrong or missing token": 3}},
        "dropped": [{"round": 1, "clients": [2], "reason": "deadline"}], "config_secret": "s3cret"}))
    (tmp_path / "trials.jsonl").write_text(json.dumps({"trial": 0, "params": {"lr": 0.1}, "budget": 2,
                                                       "status": "complete", "objective": 0.4}) + "\n")
    u = run_update(tmp_path)
    assert u["records"] == [{"round": 1, "test_acc": 0.5}]   # a late evaluation is not a round's record
    assert u["summary"] == {"rounds": 1, "best_test_acc": 0.5, "dropped": 1, "lost_clients": 0,
                            "refused": {"non-finite update": 2, "wrong or missing token": 3}}
    assert u["trials"] == [{"trial": 0, "budget": 2, "status": "complete", "objective": 0.4}]


def test_requests_name_entries_of_fixed_tables_never_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 1}\n')
    (tmp_path / "secret.txt").write_text("top secret")
    d = Dashboard([run])
    assert d.respond("", "")[0] == 200 and b"dashboard.js" in d.respond("", "")[2]
    for name in STATIC:
        assert d.respond(name, "")[0] == 200
    for path in ("../secret.txt", "static/../../secret.txt", "%2e%2e/secret.txt", "metrics.jsonl",
                 "/etc/passwd", "api/live", "api/nothing"):
        status, _, body = d.respond(path, "")
        assert status == 404 and b"secret" not in body
    for query in ("id=1&offset=0", "id=-1", "id=x", "id=0&offset=-5", "id=0&trials_offset=a"):
        assert d.respond("api/run", query)[0] == 400
    status, _, body = d.respond("api/run", "id=0&offset=0")
    assert status == 200 and json.loads(body)["records"] == [{"round": 1}]
    assert json.loads(d.respond("api/runs", "")[2]) == {"runs": [{"id": 0, "name": "run"}], "live": False}


def test_the_page_loads_nothing_from_elsewhere():
    static = ROOT / "fedcore" / "dashboard" / "static"
    assert (static / "LICENSE.uPlot").read_text().startswith("The MIT License")
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        text = (static / name).read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, name


def _browser():
    """A headless Chromium driven by Selenium, or a skip naming what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the 'dev' extra: "
                                    "pip install \"fedcore[dev]\")")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("needs Chromium and its driver (apt-get install -y chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,1560", "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def _finished_run(tmp_path: Path) -> Path:
    import fedcore
    from tests.conftest import small_cfg
    out = tmp_path / "fedavg"
    fedcore.run(small_cfg(out, federate__total_round_num=6, privacy__dp__mode="central",
                          privacy__dp__noise_multiplier=1.0, eval__clients=False))
    return out


def test_the_page_draws_a_finished_run_and_follows_a_new_round_in_headless_chromium(tmp_path):
    from fedcore.dashboard.server import DashboardServer
    browser = _browser()
    run = _finished_run(tmp_path)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    study = tmp_path / "study"   # a tuning study's table (fedcore.tune's Row, as it writes it)
    study.mkdir()
    rows = [{"trial": t, "params": {"train.optimizer.lr": lr}, "budget": 2, "status": "complete",
             "objective": obj, "rounds": 2, "outdir": str(study / "trials" / f"{t:04d}")}
            for t, (lr, obj) in enumerate([(0.1, 0.41), (0.3, 0.52), (0.03, 0.37)])]
    (study / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = DashboardServer(Dashboard([run, study]), "127.0.0.1", 0).start()
    try:
        page = urllib.request.urlopen(server.url, timeout=10)
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        browser.get(server.url)
        wait = _waiter(browser)
        js = "return window.fedcoreDashboard"
        d = "window.fedcoreDashboard"
        # the learning curve holds one point per evaluated round, the very values of the file
        wait(lambda: browser.execute_script(f"return {d}.charts.acc && {d}.charts.acc.data[0].length")
             == len(records))
        drawn = browser.execute_script(js + ".charts.acc.data")
        assert drawn[0] == [r["round"] for r in records]
        assert drawn[1] == [r["test_acc"] for r in records]
        assert browser.execute_script(js + ".charts.dp.data")[1] == [r["dp_epsilon"] for r in records]
        assert browser.execute_script(js + ".charts.part.data")[1] == [r["num_updates"] for r in records]
        def cell(name):   # the table is drawn anew at each poll: look the cell up each time
            return browser.execute_script(f"return document.querySelector('#run-0 .{name}').textContent")
        assert cell("rounds") == str(len(records)) and cell("state") == "finished"
        assert len(browser.find_elements("css selector", "#chart-acc canvas")) == 1
        wait(lambda: browser.execute_script(f"return {d}.charts.trials && {d}.charts.trials.data[0].length") == 3)
        assert browser.execute_script(js + ".charts.trials.data")[1] == [0.41, 0.52, 0.37]   # the study's
        shot = SCREENSHOT if os.environ.get("FEDCORE_SCREENSHOT") == "1" else tmp_path / "dashboard.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0
        # a new round written: the page draws it at its next poll
        new = dict(records[-1], round=records[-1]["round"] + 1, test_acc=0.123)
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(new) + "\n")
        wait(lambda: browser.execute_script(js + ".charts.acc.data[0].length") == len(records) + 1)
        assert browser.execute_script(js + ".charts.acc.data")[1][-1] == 0.123
        wait(lambda: cell("last-acc") == "0.1230")
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        browser.quit()
        server.stop()


def _waiter(browser, timeout: float = 30.0):
    from selenium.webdriver.support.ui import WebDriverWait

    def wait(condition):
        WebDriverWait(browser, timeout, poll_frequency=0.1).until(lambda _: condition())
    return wait
