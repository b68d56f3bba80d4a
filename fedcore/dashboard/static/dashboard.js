// fedcore dashboard: polls api/run for each run's new records and redraws the charts.
// Everything it loads comes from the server that served this page.
"use strict";
(function () {
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  const POLL_MS = 1000;
  const AXIS_LABELS = { round: "round", virtual_time: "virtual time (s)", wall_time: "wall time (s)",
                        trial_row: "evaluation (trials.jsonl row)" };
  const token = new URLSearchParams(location.hash.slice(1)).get("token");
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const state = { runs: [], charts: {}, polls: 0, live: false, liveFacts: null };
  window.fedcoreDashboard = state;

  async function getJSON(path) {
    const r = await fetch(path, { headers, cache: "no-store" });
    if (!r.ok) throw new Error(path + ": " + r.status);
    return r.json();
  }

  // one chart: for each run, one series per field; x from the records' `x` field
  function table(run, x, fields) {
    const rows = run.records.filter(r => r[x] !== undefined && fields.some(f => r[f] !== undefined));
    return [rows.map(r => r[x]), ...fields.map(f => rows.map(r => (r[f] === undefined ? null : r[f])))];
  }

  function draw(id, x, fieldsOf, opts) {
    const el = document.getElementById("chart-" + id);
    const tables = [], series = [{ label: x }];
    state.runs.forEach((run, i) => {
      const fields = fieldsOf(run);
      if (!fields.length) return;
      const t = table(run, x, fields);
      if (!t[0].length) return;
      tables.push(t);
      fields.forEach((f, j) => series.push({
        label: (state.runs.length > 1 ? run.name + ": " : "") + f,
        stroke: COLORS[(i * 3 + j) % COLORS.length], width: 2, spanGaps: true,
        points: { show: opts && opts.points ? true : t[0].length < 40 },
        paths: opts && opts.points ? () => null : undefined,
      }));
    });
    const old = state.charts[id];
    if (!tables.length) {
      if (old) { old.destroy(); delete state.charts[id]; }
      if (!el.querySelector(".empty")) el.innerHTML = '<div class="empty">nothing recorded yet</div>';
      return;
    }
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const key = series.map(s => s.label).join("|");
    if (old && old._key === key) { old.setData(data); return; }
    if (old) old.destroy();
    el.innerHTML = "";
    const chart = new uPlot({
      width: Math.max(400, el.clientWidth || 500), height: 240, series,
      scales: { x: { time: false } },
      axes: [{ label: AXIS_LABELS[x] || x }, {}],
    }, data, el);
    chart._key = key;
    state.charts[id] = chart;
  }

  const has = (run, pred) => {
    const names = new Set();
    run.records.forEach(r => Object.keys(r).forEach(k => { if (pred(k)) names.add(k); }));
    return [...names].sort();
  };

  function redraw() {
    const x = document.getElementById("xaxis").value;
    draw("acc", x, run => has(run, k => k === "test_acc" || k === "client_test_acc_mean"));
    draw("loss", x, run => has(run, k => k === "test_loss"));
    draw("part", "round", run => has(run, k => k === "num_updates"));
    draw("bytes", "round", run => has(run, k => /bytes/.test(k) && !/total/.test(k)));
    draw("drops", "round", run => has(run, k => /dropped|refused|lost|rejected/.test(k)));
    draw("dp", "round", run => has(run, k => /epsilon/.test(k)));
    drawTrials();
    drawTable();
  }

  function drawTrials() {
    const shadow = state.runs.map(run => ({ name: run.name, records: run.trials.map((t, i) => ({
      trial_row: i, objective: (typeof t.objective === "number" ? t.objective : undefined) })) }));
    const saved = state.runs;
    state.runs = shadow;
    try { draw("trials", "trial_row", run => run.records.length ? ["objective"] : [], { points: true }); }
    finally { state.runs = saved; }
  }

  function text(v, digits) {
    if (v === undefined || v === null) return "–";
    return typeof v === "number" && !Number.isInteger(v) ? v.toFixed(digits || 4) : String(v);
  }

  function liveValue(name, labels) {
    const rows = (state.liveFacts || {})[name] || [];
    return rows.filter(([l]) => Object.entries(labels).every(([k, v]) => l[k] === v))
               .reduce((a, [, v]) => a + v, 0);
  }

  function drawTable() {
    const body = document.querySelector("#runs tbody");
    body.innerHTML = "";
    const refusals = document.getElementById("refusals");
    refusals.innerHTML = "";
    state.runs.forEach((run, i) => {
      const last = run.records[run.records.length - 1] || {};
      const evals = run.records.filter(r => typeof r.test_acc === "number");
      const best = evals.reduce((b, r) => Math.max(b, r.test_acc), -Infinity);
      const eps = has(run, k => k === "dp_epsilon").length ? last.dp_epsilon : (run.summary || {}).dp_epsilon;
      let refused = run.summary ? run.summary.refused : null, clients = "–";
      if (state.live && state.liveFacts && i === 0) {
        refused = {};
        (state.liveFacts.fedcore_refused_total || []).forEach(([l, v]) => { refused[l.stage + ": " + l.reason] = v; });
        clients = liveValue("fedcore_clients", { state: "alive" }) + " alive / " +
                  liveValue("fedcore_clients", { state: "joined" }) + " joined / " +
                  liveValue("fedcore_clients", { state: "dropped" }) + " dropped";
      }
      const nRefused = refused ? Object.values(refused).reduce((a, v) => a + v, 0) : null;
      const tr = document.createElement("tr");
      tr.id = "run-" + i;
      const study = run.trials.length > 0 && run.records.length === 0;
      [run.name, study ? "study" : run.summary ? "finished" : "running",
       study ? run.trials.length + " evaluations" : String(run.records.length),
       text(evals.length ? evals[evals.length - 1].test_acc : null), text(evals.length ? best : null),
       text(eps, 3), clients, text(nRefused)].forEach((v, j) => {
        const td = document.createElement("td");
        td.textContent = v;
        td.className = ["name", "state", "rounds", "last-acc", "best-acc", "epsilon", "clients", "refused"][j];
        tr.appendChild(td);
      });
      body.appendChild(tr);
      Object.entries(refused || {}).forEach(([k, v]) => {
        const li = document.createElement("li");
        li.textContent = (state.runs.length > 1 ? run.name + ": " : "") + k + ": " + v;
        refusals.appendChild(li);
      });
    });
  }

  async function poll() {
    let more = false;
    try {
      for (const [i, run] of state.runs.entries()) {
        const u = await getJSON(`api/run?id=${i}&offset=${run.offset}&trials_offset=${run.trialsOffset}`);
        if (u.offset < run.offset) { run.records = []; }   // the file began again
        if (u.trials_offset < run.trialsOffset) { run.trials = []; }
        more = more || u.records.length > 0 || u.trials.length > 0;
        run.records.push(...u.records);
        run.trials.push(...u.trials);
        run.offset = u.offset;
        run.trialsOffset = u.trials_offset;
        run.summary = u.summary;
      }
      if (state.live) state.liveFacts = await getJSON("api/live");
      state.polls += 1;
      redraw();
      document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    } catch (e) {
      document.getElementById("updated").textContent = "not reachable: " + e.message;
    }
    setTimeout(poll, more ? 100 : POLL_MS);
  }

  async function start() {
    const r = await getJSON("api/runs");
    state.live = r.live;
    state.runs = r.runs.map(x => ({ name: x.name, records: [], trials: [], offset: 0, trialsOffset: 0, summary: null }));
    document.getElementById("xaxis").addEventListener("change", () => {
      const c = state.charts.acc;
      if (c) { c.destroy(); delete state.charts.acc; }
      redraw();
    });
    poll();
  }
  start().catch(e => { document.getElementById("updated").textContent = "cannot start: " + e.message; });
})();
