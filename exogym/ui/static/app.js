// The web view's page: the runs list, the comparison of selected runs, one run's timeline, the sweeps.
// Every request carries the token of the page's own address. Curves are drawn with plotly.js.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const state = {runs: [], sweeps: [], sort: {key: "started", desc: true}, selected: new Set(), details: {},
               compare: [], timeline: null, timelineName: null, polls: {}};
const X_AXES = [["step", "step (each node's local steps)"], ["examples", "examples"], ["bytes", "bytes per node"],
                ["sim_time_s", "simulated seconds"], ["updates", "server updates"], ["wall_time_s", "wall seconds"]];

function api(path, params = {}) {
  const q = new URLSearchParams({...params, token: TOKEN});
  return fetch(`${path}?${q}`).then(async (r) => {
    const body = await r.json().catch(() => ({error: r.statusText}));
    if (!r.ok) throw new Error(body.error || r.statusText);
    return body;
  });
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined || v === "") return "";
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : +v.toPrecision(digits) + "";
}

// ---- views and the address -------------------------------------------------------------------------------
function route() {
  const [view, query] = (location.hash.slice(1) || "runs").split("?");
  const params = new URLSearchParams(query || "");
  document.querySelectorAll(".view").forEach((v) => v.classList.toggle("active", v.id === `view-${view}`));
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.view === view));
  if (view === "compare") showCompare(params.getAll("run"));
  if (view === "timeline" && params.get("run")) showTimeline(params.get("run"));
  if (view === "timeline" && !params.get("run")) {
    document.getElementById("timeline-name").textContent = "pick a run's timeline in the runs list";
  }
  if (view === "sweeps") showSweeps(params.get("sweep"));
}

function link(view, key, names) {
  const q = new URLSearchParams(); for (const n of [].concat(names)) q.append(key, n);
  return `#${view}?${q}`;
}

// ---- the runs list -----------------------------------------------------------------------------------------
async function loadRuns() {
  const data = await api("/api/runs");
  state.runs = data.runs; state.sweeps = data.sweeps;
  document.getElementById("root").textContent = data.root;
  renderRuns();
  // for the tests and the benchmark: when the list was drawn, counted from the page's navigation
  document.body.dataset.runsDrawnAt = String(Math.round(performance.now()));
  document.body.dataset.runsLoaded = String(state.runs.length);
  const running = state.runs.filter((r) => r.status === "running").length;
  document.getElementById("status-line").textContent = `${state.runs.length} runs, ${running} running`;
  clearTimeout(state.listTimer);
  state.listTimer = setTimeout(loadRuns, running ? 3000 : 15000); // live: the list follows running runs
}

function renderRuns() {
  const text = document.getElementById("filter").value.toLowerCase();
  const status = document.getElementById("status-filter").value;
  const {key, desc} = state.sort;
  const rows = state.runs.filter((r) => (!status || r.status === status) &&
    (!text || `${r.name} ${r.strategy} ${r.status}`.toLowerCase().includes(text)));
  rows.sort((a, b) => {
    const x = a[key], y = b[key];
    if (x === y) return 0; if (x === null || x === undefined) return 1; if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * (desc ? -1 : 1);
  });
  const body = document.querySelector("#runs-table tbody"), frag = document.createDocumentFragment();
  for (const r of rows) {
    const box = el("input", {type: "checkbox", onchange: (e) => {
      if (e.target.checked) state.selected.add(r.name); else state.selected.delete(r.name);
      document.getElementById("compare-selected").disabled = state.selected.size === 0;
    }});
    box.checked = state.selected.has(r.name);
    const views = el("td", {}, el("a", {href: link("compare", "run", r.name)}, "curves"));
    if (r.timeline) views.append(" ", el("a", {href: link("timeline", "run", r.name)}, "timeline"));
    views.append(" ", el("a", {href: "#runs", onclick: (e) => { e.preventDefault(); showDetail(r.name); }}, "details"));
    const steps = r.max_steps && r.status === "running" ? `${fmt(r.steps)} / ${r.max_steps}` : fmt(r.steps);
    frag.append(el("tr", {"data-run": r.name},
      el("td", {}, box), el("td", {}, r.name), el("td", {}, r.strategy ?? ""), el("td", {class: "num"}, fmt(r.nodes)),
      el("td", {class: `status-${r.status}`, title: r.error || ""}, r.status + (r.error ? " *" : "")),
      el("td", {class: "num"}, steps), el("td", {class: "num"}, fmt(r.train_loss)),
      el("td", {class: "num"}, fmt(r.val_loss)),
      el("td", {class: "num"}, ExoTimeline.fmtBytes(r.bytes_per_node)), el("td", {class: "num"}, fmt(r.sim_time_s)),
      el("td", {}, r.started ?? ""), views));
  }
  body.replaceChildren(frag);
  document.getElementById("run-count").textContent = `${rows.length} of ${state.runs.length} runs`;
  document.querySelectorAll("#runs-table th[data-key]").forEach((th) => {
    th.classList.toggle("sorted-asc", th.dataset.key === key && !desc);
    th.classList.toggle("sorted-desc", th.dataset.key === key && desc);
  });
}

async function showDetail(name) {
  const box = document.getElementById("run-detail");
  const d = await api("/api/run", {name});
  const e = d.entry;
  box.replaceChildren(el("h3", {}, name), el("p", {class: e.error ? "error" : ""},
    `${e.status}${e.error ? ": " + e.error : ""}; ${fmt(e.steps)} steps, goodput ${fmt(e.goodput)}, ` +
    `${fmt(e.updates)} server updates`),
    el("p", {}, "The call that reruns it (or resumes it, when it was interrupted):"),
    el("pre", {class: "rerun"}, d.rerun || "(no config.json)"),
    el("details", {}, el("summary", {}, "config.json"), el("pre", {}, JSON.stringify(d.config, null, 1))));
  box.scrollIntoView();
}

// ---- comparing runs ----------------------------------------------------------------------------------------
async function fetchRun(name) {
  const have = state.details[name];
  const since = have ? have.train.step?.length || 0 : 0, since_val = have ? have.val.step?.length || 0 : 0;
  const d = await api("/api/run", {name, since, since_val});
  if (!have) { state.details[name] = d; return d; }
  for (const table of ["train", "val"]) {
    for (const [c, values] of Object.entries(d[table])) (have[table][c] ||= []).push(...values);
  }
  have.entry = d.entry; have.summary = d.summary;
  return have;
}

async function showCompare(names) {
  state.compare = names;
  document.getElementById("compare-names").textContent =
    names.length ? names.join(", ") : "tick runs in the runs list and press Compare selected";
  await Promise.all(names.map(fetchRun));
  drawCompare(); drawFrontier(); drawConfigDiff();
  for (const name of names) followRun(name);
}

// A run still training: its new rows are fetched every 2 s and the curves grow, without reloading the page.
function followRun(name) {
  if (state.polls[name]) return;
  const tick = async () => {
    const d = await fetchRun(name).catch(() => null);
    if (state.compare.includes(name)) { drawCompare(); drawFrontier(); }
    if (d && d.entry.status === "running" && state.compare.includes(name)) state.polls[name] = setTimeout(tick, 2000);
    else delete state.polls[name];
  };
  if (state.details[name]?.entry.status === "running") state.polls[name] = setTimeout(tick, 2000);
}

function xOptions() {
  const sel = document.getElementById("x-axis");
  if (!sel.options.length) for (const [v, label] of X_AXES) sel.append(el("option", {value: v}, label));
}

function drawCompare() {
  xOptions();
  const x = document.getElementById("x-axis").value, [table, y] = document.getElementById("y-axis").value.split(":");
  const traces = [];
  for (const name of state.compare) {
    const d = state.details[name]; if (!d) continue;
    const rows = d[table], xs = rows[x] || (table === "val" ? interpolateX(d, x) : null);
    if (!xs || !rows[y]) continue;
    traces.push({x: xs, y: rows[y], name, mode: "lines", type: "scatter", line: {width: 1.5}});
  }
  const layout = {margin: {t: 10, r: 10}, xaxis: {title: {text: x}, type: checked("log-x") ? "log" : "linear"},
                  yaxis: {title: {text: y}, type: checked("log-y") ? "log" : "linear"}, legend: {orientation: "h"},
                  uirevision: "compare"};
  Plotly.react("compare-chart", traces, layout, {displaylogo: false, responsive: true});
  document.body.dataset.comparePoints = String(traces.reduce((n, t) => n + t.x.length, 0));
}

// A validation row has a step; its bytes / examples / times are the train row's of that step.
function interpolateX(d, x) {
  const ts = d.train.step, tx = d.train[x]; if (!ts || !tx || !d.val.step) return null;
  const at = new Map(ts.map((s, i) => [s, tx[i]]));
  return d.val.step.map((s) => (s === 0 ? 0 : at.get(s) ?? null));
}

function checked(id) { return document.getElementById(id).checked; }

function drawFrontier() {
  const pts = state.compare.map((n) => state.details[n]).filter((d) => d && d.entry.val_loss !== null &&
                                                                       d.entry.bytes_per_node !== null);
  const sorted = [...pts].sort((a, b) => a.entry.bytes_per_node - b.entry.bytes_per_node);
  const front = []; let best = Infinity;
  for (const d of sorted) if (d.entry.val_loss < best) { best = d.entry.val_loss; front.push(d); }
  Plotly.react("frontier-chart", [
    {x: pts.map((d) => d.entry.bytes_per_node), y: pts.map((d) => d.entry.val_loss), text: pts.map((d) => d.entry.name),
     mode: "markers+text", textposition: "top center", type: "scatter", name: "runs"},
    {x: front.map((d) => d.entry.bytes_per_node), y: front.map((d) => d.entry.val_loss), mode: "lines",
     line: {shape: "hv", dash: "dot"}, name: "frontier"}],
    {margin: {t: 10, r: 10}, xaxis: {title: {text: "bytes per node"}, type: "log"},
     yaxis: {title: {text: "final validation loss"}}, showlegend: false}, {displaylogo: false, responsive: true});
}

function flatten(obj, prefix = "", out = {}) {
  for (const [k, v] of Object.entries(obj || {})) {
    if (v && typeof v === "object" && !Array.isArray(v)) flatten(v, `${prefix}${k}.`, out);
    else out[`${prefix}${k}`] = JSON.stringify(v);
  }
  return out;
}

function drawConfigDiff() {
  const names = state.compare.filter((n) => state.details[n]);
  const flat = names.map((n) => flatten(state.details[n].config));
  const keys = [...new Set(flat.flatMap(Object.keys))].filter((k) => !k.startsWith("versions") &&
    k !== "run_name" && new Set(flat.map((f) => f[k])).size > 1).sort();
  const table = document.getElementById("config-diff");
  table.replaceChildren(el("tr", {}, el("th", {}, "setting"), ...names.map((n) => el("th", {}, n))),
    ...keys.map((k) => el("tr", {}, el("td", {}, k), ...flat.map((f) => el("td", {class: "diff"}, f[k] ?? "—")))));
  if (!keys.length) table.append(el("tr", {}, el("td", {}, names.length > 1 ? "the runs' settings are the same" :
                                                              "select two runs or more to see their differences")));
}

// ---- the timeline ------------------------------------------------------------------------------------------
async function showTimeline(name) {
  if (!state.timeline) {
    state.timeline = new ExoTimeline.Timeline(document.getElementById("timeline-canvas"),
                                              document.getElementById("timeline-tip"));
    const legend = document.getElementById("timeline-legend");
    for (const [k, label] of Object.entries({c: "compute", m: "comm", i: "idle", d: "down", s: "slowed", b: "link busy"})) {
      legend.append(el("span", {}, el("i", {style: `background:${ExoTimeline.KIND_COLORS[k]}`}), label));
    }
    legend.append(el("span", {}, "| lines: messages, send to arrival; server marks: updates (green fresh, red stale)"));
  }
  if (state.timelineName === name) return;
  state.timelineName = name;
  document.getElementById("timeline-name").textContent = name;
  try {
    const data = await api("/api/timeline", {name});
    state.timeline.load(data);
    document.body.dataset.timelineDrawnAt = String(Math.round(performance.now()));
    document.body.dataset.timelineLanes = String(data.lanes.length);
  } catch (err) {
    document.getElementById("timeline-info").textContent = err.message;
    document.body.dataset.timelineError = err.message;
  }
}

// ---- sweeps ------------------------------------------------------------------------------------------------
async function showSweeps(name) {
  const list = document.getElementById("sweeps-list");
  list.replaceChildren(el("h3", {}, "Sweeps"), ...(state.sweeps.length ? state.sweeps.map((s) =>
    el("div", {}, el("a", {href: link("sweeps", "sweep", s)}, s))) : [el("p", {}, "no sweep folders under the root")]));
  if (!name) return;
  const d = await api("/api/sweep", {name});
  const box = document.getElementById("sweep-detail");
  const cols = d.columns.filter((c) => !c.endsWith("_std") && c !== "run_folders" && c !== "error");
  box.replaceChildren(el("h3", {}, name),
    el("p", {}, "Optuna's own views (history, importance, Pareto front): run the second command, then open ",
       el("a", {href: "http://127.0.0.1:8080/", target: "_blank", rel: "noopener"}, "http://127.0.0.1:8080/")),
    el("pre", {}, d.commands),
    el("table", {class: "grid"}, el("tr", {}, ...cols.map((c) => el("th", {}, c))),
       ...d.rows.map((r) => el("tr", {}, ...cols.map((c) => el("td", {}, fmt(isFinite(+r[c]) && r[c] !== "" ? +r[c] : r[c])))))),
    el("div", {id: "sweep-frontier", class: "chart small"}));
  const x = cols.find((c) => c === "payload_bytes_per_node") || cols.find((c) => c.includes("bytes"));
  const y = cols.find((c) => c === "objective") || cols.find((c) => c.includes("loss"));
  if (x && y) {
    const pts = d.rows.filter((r) => r[x] !== "" && r[y] !== "");
    Plotly.newPlot("sweep-frontier", [{x: pts.map((r) => +r[x]), y: pts.map((r) => +r[y]), mode: "markers",
      type: "scatter", text: pts.map((r) => cols.slice(0, 3).map((c) => `${c}=${r[c]}`).join(" "))}],
      {margin: {t: 10}, xaxis: {title: {text: x}, type: "log"}, yaxis: {title: {text: y}}}, {displaylogo: false});
  }
}

// ---- wiring ------------------------------------------------------------------------------------------------
document.getElementById("filter").addEventListener("input", renderRuns);
document.getElementById("status-filter").addEventListener("change", renderRuns);
document.querySelectorAll("#runs-table th[data-key]").forEach((th) => th.addEventListener("click", () => {
  const key = th.dataset.key;
  state.sort = {key, desc: state.sort.key === key ? !state.sort.desc : false};
  renderRuns();
}));
document.getElementById("compare-selected").addEventListener("click", () => {
  location.hash = link("compare", "run", [...state.selected]);
});
for (const id of ["x-axis", "y-axis", "log-x", "log-y"]) document.getElementById(id).addEventListener("change", drawCompare);
document.getElementById("timeline-reset").addEventListener("click", () => state.timeline && state.timeline.reset());
document.getElementById("timeline-messages").addEventListener("change", (e) => {
  if (state.timeline) { state.timeline.showMessages = e.target.checked; state.timeline.draw(); }
});
window.addEventListener("hashchange", route);
loadRuns().then(route).catch((err) => {
  document.getElementById("status-line").textContent = err.message;
});
