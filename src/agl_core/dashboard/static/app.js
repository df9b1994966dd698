// agl dashboard. Plain JavaScript, no build step. Every value from the server is inserted as text
// (el() makes text nodes, never markup): span content is untrusted.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2864c8", "#c8643c", "#1f8a4c", "#8a4cc8", "#b86e00", "#0f7d8c", "#c8323c", "#6b7480"];
let refreshTimer = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "onclick") node.addEventListener("click", value);
    else if (key === "class") node.className = value;
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// Each navigation counts up; a view whose data arrives after a later navigation began is stale and stops
// there (else a slow earlier view would draw over the page asked for since).
let routeSeq = 0;

class StaleRoute extends Error {}

async function api(path, { forRoute = true } = {}) {
  const seq = routeSeq;
  const response = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  if (forRoute && seq !== routeSeq) throw new StaleRoute();
  if (!response.ok) {
    const message = body && body.error ? body.error.message : `HTTP ${response.status}`;
    throw new Error(message);
  }
  return body;
}

function fmt(value, digits = 3) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number") {
    if (!Number.isFinite(value)) return "–";
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    return Number(value.toPrecision(digits)).toString();
  }
  return String(value);
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
}

function when(unix) {
  if (!unix) return "–";
  return new Date(unix * 1000).toLocaleString();
}

function status(value) {
  return el("span", { class: `status ${value}` }, value);
}

function setMain(...children) {
  const main = document.getElementById("main");
  main.replaceChildren(...children);
}

function showError(error) {
  setMain(el("p", { class: "error", "data-test": "error" }, `Error: ${error.message}`));
}

// ---- charts ---------------------------------------------------------------------------------------

// Round tick values covering [lo, hi]: a step of 1, 2 or 5 times a power of ten, about `count` of them.
function niceTicks(lo, hi, count = 4) {
  const raw = (hi - lo) / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) || 10 * power;
  const start = Math.floor(lo / step + 1e-9) * step, end = Math.ceil(hi / step - 1e-9) * step;
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const ticks = [];
  for (let v = start; v <= end + step / 2; v += step) ticks.push(Number(v.toFixed(decimals)));
  return { ticks, decimals };
}

// Dash patterns that tell apart series drawn on top of each other (equal values hide a line otherwise).
const DASHES = ["", "6 4", "2 3", "8 3 2 3"];

function lineChart(title, series, options = {}) {
  const width = 440, height = 220, right = 12, top = 10, bottom = 28;
  const points = series.flatMap((s) => s.points.concat(s.band ? s.band.flatMap((b) => [[b[0], b[1]], [b[0], b[2]]]) : []));
  const box = el("div", { class: "card chart", "data-chart": title });
  box.append(el("div", { class: "title" }, title));
  if (!points.length) {
    box.append(el("p", { class: "muted" }, "no data yet"));
    return box;
  }
  let [x0, x1] = [Math.min(...points.map((p) => p[0])), Math.max(...points.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...points.map((p) => p[1])), Math.max(...points.map((p) => p[1]))];
  // a series that never goes below zero (times, rates, counts, rewards in [0, 1]) is drawn from zero
  if (options.zero || y0 >= 0) y0 = Math.min(0, y0);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { y1 = y0 === 0 ? 1 : y1 + Math.abs(y1) * 0.5; if (y0 !== 0) y0 -= Math.abs(y0) * 0.5; }
  const { ticks, decimals } = niceTicks(y0, y1);
  y0 = ticks[0]; y1 = ticks[ticks.length - 1];
  const labels = ticks.map((v) => v.toFixed(decimals));
  const left = Math.max(30, 10 + 6.5 * Math.max(...labels.map((l) => l.length)));  // room for the widest label
  const X = (x) => left + ((x - x0) / (x1 - x0)) * (width - left - right);
  const Y = (y) => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" });
  ticks.forEach((y, i) => {
    chart.append(svg("line", { x1: left, x2: width - right, y1: Y(y), y2: Y(y), stroke: "#e8ecf0" }));
    chart.append(svg("text", { x: left - 6, y: Y(y) + 4, "text-anchor": "end", "font-size": 10, fill: "#6b7480", "data-tick": "y" }, labels[i]));
  });
  const steps = [...new Set(points.map((p) => p[0]))].sort((a, b) => a - b);
  const every = Math.max(1, Math.ceil(steps.length / 8));
  steps.filter((_, i) => i % every === 0).forEach((x) => {
    chart.append(svg("text", { x: X(x), y: height - 10, "text-anchor": "middle", "font-size": 10, fill: "#6b7480" }, fmt(x)));
  });
  chart.append(svg("text", { x: width - right, y: height - 1, "text-anchor": "end", "font-size": 10, fill: "#6b7480" }, options.xLabel || "step"));
  series.forEach((s, index) => {
    const color = s.color || COLORS[index % COLORS.length];
    if (s.band && s.band.length) {
      const upper = s.band.map((b) => `${X(b[0])},${Y(b[2])}`);
      const lower = s.band.slice().reverse().map((b) => `${X(b[0])},${Y(b[1])}`);
      chart.append(svg("polygon", { points: upper.concat(lower).join(" "), fill: color, opacity: 0.15 }));
    }
    if (s.points.length > 1) {
      const dash = DASHES[index % DASHES.length];
      chart.append(svg("polyline", { points: s.points.map((p) => `${X(p[0])},${Y(p[1])}`).join(" "), fill: "none", stroke: color, "stroke-width": 2, "stroke-dasharray": dash || null, "data-series": s.name }));
    }
    s.points.forEach((p) => {
      chart.append(svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 3, fill: color }, svg("title", {}, `${s.name} @ ${options.xLabel || "step"} ${p[0]}: ${fmt(p[1], 4)}`)));
    });
  });
  box.append(chart);
  box.append(el("div", { class: "legend" }, series.map((s, i) => el("span", {}, el("i", {}), s.name))));
  box.querySelectorAll(".legend i").forEach((node, i) => {
    const color = series[i].color || COLORS[i % COLORS.length];
    // the legend shows each series' dash too
    node.style.background = i % DASHES.length ? `repeating-linear-gradient(90deg, ${color} 0 ${3 + (i % DASHES.length)}px, transparent 0 ${6 + (i % DASHES.length)}px)` : color;
  });
  return box;
}

function seriesOf(rows, name, pick) {
  const points = rows.map((r) => [r.step, pick(r)]).filter((p) => typeof p[1] === "number" && Number.isFinite(p[1]));
  return { name, points };
}

// ---- runs -----------------------------------------------------------------------------------------

async function viewRuns() {
  const data = await api("/api/runs");
  if (!data.runs.length) {
    setMain(el("h1", {}, "Runs"), el("p", { class: "muted" }, data.store ? "No run directories given (--runs DIR); the store's rollouts are under Rollouts." : "No runs found."));
    return;
  }
  const table = el("table", { "data-test": "runs" },
    el("tr", {}, ["", "Run", "Status", "Progress", "ETA", "Train reward", "Held-out before → after", "Started"].map((h) => el("th", {}, h))));
  const chosen = new Set();
  const compare = el("button", { type: "button", "data-test": "compare", disabled: true,
    onclick: () => { location.hash = `#/compare?runs=${[...chosen].map(encodeURIComponent).join(",")}`; } }, "Compare selected runs");
  for (const run of data.runs) {
    const pct = run.steps ? Math.min(100, (100 * run.step) / run.steps) : 0;
    const bar = el("div", { class: "progress" }, el("div", {}));
    bar.firstChild.style.width = `${pct}%`;
    const pick = el("input", { type: "checkbox", "data-pick": run.name, title: "compare this run with others" });
    pick.addEventListener("click", (event) => {
      event.stopPropagation();  // ticking a box does not open the run
      if (pick.checked) chosen.add(run.name); else chosen.delete(run.name);
      compare.disabled = chosen.size < 2;
    });
    table.append(el("tr", { class: "clickable", "data-run": run.name, onclick: () => { location.hash = `#/run/${encodeURIComponent(run.name)}`; } },
      el("td", {}, pick),
      el("td", {}, el("a", { href: `#/run/${encodeURIComponent(run.name)}` }, run.name), el("div", { class: "muted" }, `${run.title} · ${run.path}`)),
      el("td", {}, status(run.status), run.phase ? el("div", { class: "muted", "data-test": "phase" }, run.phase) : ""),
      el("td", {}, bar, el("span", { class: "muted" }, `step ${run.step}${run.steps ? " / " + run.steps : ""}`)),
      el("td", {}, run.status === "running" ? duration(run.eta_s) : "–"),
      el("td", { class: "num" }, fmt(run.mean_reward)),
      el("td", { class: "num" }, `${fmt(run.val_first)} → ${fmt(run.val_last)}`),
      el("td", {}, when(run.started_at))));
  }
  setMain(el("h1", {}, "Runs"), table, data.runs.length > 1 ? el("p", {}, compare) : "");
  if (data.runs.some((r) => r.status === "running")) refreshTimer = setTimeout(route, 5000);
}

// Several runs on the same curves, one series per run.
async function viewCompare(params) {
  const names = (params.get("runs") || "").split(",").filter(Boolean);
  if (names.length < 2) throw new Error("choose two runs or more on the Runs page to compare them");
  const runs = await Promise.all(names.map((name) => api(`/api/runs/${encodeURIComponent(name)}`)));
  const per = (pick) => runs.map((run) => seriesOf(run.train, run.name, pick));
  const heldOut = runs.map((run) => ({ name: run.name, points: run.val.map((v) => [v.step, v.mean]).filter((p) => Number.isFinite(p[1])) }));
  const charts = el("div", { class: "charts" },
    lineChart("Reward", per((r) => r.mean_reward)),
    lineChart("Held-out reward", heldOut),
    lineChart("Loss", per((r) => r.loss)),
    lineChart("KL", per((r) => r.kl)),
    lineChart("Tokens/s", per((r) => r.generation_tokens_per_s), { zero: true }),
    lineChart("Step time (s)", per((r) => r.seconds), { zero: true }));
  const table = el("table", { "data-test": "compared" },
    el("tr", {}, ["Run", "Status", "Steps", "Held-out before → after", "Config"].map((h) => el("th", {}, h))),
    ...runs.map((run) => el("tr", {},
      el("td", {}, el("a", { href: `#/run/${encodeURIComponent(run.name)}` }, run.name), el("div", { class: "muted" }, run.title)),
      el("td", {}, status(run.status)),
      el("td", {}, `${run.step}${run.steps ? " / " + run.steps : ""}`),
      el("td", { class: "num" }, `${fmt(run.val_first)} → ${fmt(run.val_last)}`),
      el("td", { class: "muted" }, configDiff(run.config, runs.map((r) => r.config))))));
  setMain(el("h1", {}, `Comparing ${runs.length} runs`), table, el("h2", {}, "Curves"), charts);
}

// The config keys (dotted) where this run differs from the others, with its values.
function configDiff(config, all) {
  const flat = (obj, prefix = "", out = {}) => {
    for (const [k, v] of Object.entries(obj || {})) {
      if (v && typeof v === "object" && !Array.isArray(v)) flat(v, `${prefix}${k}.`, out);
      else out[`${prefix}${k}`] = JSON.stringify(v);
    }
    return out;
  };
  const mine = flat(config), flats = all.map((c) => flat(c));
  const keys = Object.keys(mine).filter((k) => k !== "output_dir" && flats.some((f) => f[k] !== mine[k]));
  return keys.length ? keys.map((k) => `${k}=${mine[k]}`).join(", ") : "same config";
}

function agentSeries(train) {
  const names = [...new Set(train.flatMap((r) => Object.keys(r.agents || {})))];
  return names.flatMap((name) => [
    seriesOf(train, `${name} calls`, (r) => (r.agents && r.agents[name] ? r.agents[name].calls : null)),
    seriesOf(train, `${name} trained`, (r) => (r.agents && r.agents[name] ? r.agents[name].trained : null)),
  ]);
}

function policySeries(train, key) {
  const names = [...new Set(train.flatMap((r) => Object.keys(r.policies || {})))];
  return names.map((name) => seriesOf(train, name, (r) => (r.policies && r.policies[name] ? r.policies[name][key] : null)));
}

function meanStaleness(histogram) {
  let calls = 0, total = 0;
  for (const [versions, count] of Object.entries(histogram || {})) { calls += count; total += Number(versions) * count; }
  return calls ? total / calls : null;
}

function heldOutTable(held) {
  if (!held) return el("p", { class: "muted" }, "No held-out evaluation yet.");
  const rows = held.tasks.filter((t) => t.change);
  const head = el("p", {},
    `before (step ${held.before.step}): ${fmt(held.before.mean)} ± ${fmt(held.before.se)}; `,
    held.after ? `after (step ${held.after.step}): ${fmt(held.after.mean)} ± ${fmt(held.after.se)}; ` : "no evaluation after training yet; ",
    `${held.changed} of ${held.tasks.length} tasks changed`);
  const table = el("table", { "data-test": "held-out" },
    el("tr", {}, el("th", {}, "Task"), el("th", { class: "num" }, "Before"), el("th", { class: "num" }, "After"), el("th", { class: "num" }, "Change")));
  for (const t of rows.slice(0, 200)) {
    table.append(el("tr", {}, el("td", {}, t.task), el("td", { class: "num" }, fmt(t.before)), el("td", { class: "num" }, fmt(t.after)),
      el("td", { class: `num ${t.change > 0 ? "pos" : "neg"}` }, (t.change > 0 ? "+" : "") + fmt(t.change))));
  }
  return el("div", {}, head, rows.length ? table : el("p", { class: "muted" }, "No task changed."));
}

async function viewRun(name) {
  const run = await api(`/api/runs/${encodeURIComponent(name)}`);
  const train = run.train, val = run.val;
  const valSeries = { name: "held-out", points: val.map((v) => [v.step, v.mean]), band: val.map((v) => [v.step, v.mean - v.se, v.mean + v.se]) };
  const phases = [...new Set(train.flatMap((r) => Object.keys(r.phases || {})))];
  const charts = el("div", { class: "charts" },
    lineChart("Reward", [seriesOf(train, "train", (r) => r.mean_reward), valSeries]),
    lineChart("Loss", [seriesOf(train, "loss", (r) => r.loss)]),
    lineChart("KL", [seriesOf(train, "KL to reference", (r) => r.kl), seriesOf(train, "approx. KL to behaviour", (r) => r.approx_kl)]),
    lineChart("Tokens/s", [seriesOf(train, "update", (r) => r.tokens_per_s), seriesOf(train, "generation", (r) => r.generation_tokens_per_s)], { zero: true }),
    lineChart("LLM calls per agent", agentSeries(train), { zero: true }),
    lineChart("Rollouts", [seriesOf(train, "done", (r) => r.rollouts), seriesOf(train, "failed", (r) => r.rollouts_failed), seriesOf(train, "late", (r) => r.rollouts_late)], { zero: true }),
    lineChart("Step time (s)", phases.map((p) => seriesOf(train, p, (r) => (r.phases ? r.phases[p] : null))), { zero: true }),
    lineChart("Peak RSS (MB)", [seriesOf(train, "peak RSS", (r) => r.peak_rss_mb)]));
  const policies = policySeries(train, "reward");
  if (policies.length) charts.append(lineChart("Reward per policy", policies));
  const staleness = train.filter((r) => r.pipeline);
  if (staleness.length) {
    charts.append(lineChart("Async pipeline", [
      seriesOf(staleness, "dropped groups", (r) => r.pipeline.dropped_groups),
      seriesOf(staleness, "finished during update", (r) => r.pipeline.finished_during_update),
      seriesOf(staleness, "mean staleness (versions)", (r) => meanStaleness(r.pipeline.staleness))], { zero: true }));
  }
  const last = train.length ? train[train.length - 1] : {};
  const cards = el("div", { class: "cards" },
    card("Status", run.phase ? [status(run.status), el("div", { class: "muted", "data-test": "phase" }, `${run.phase}, for ${duration(run.now - run.phase_started_at)}`)] : status(run.status)),
    card("Step", `${run.step}${run.steps ? " / " + run.steps : ""}`),
    card("ETA", run.status === "running" ? duration(run.eta_s) : "–"),
    card("Train reward (last step)", fmt(last.mean_reward)),
    card("Loss (last step)", fmt(last.loss)),
    card("Started", when(run.started_at)));
  const parts = [el("h1", {}, run.name), el("p", { class: "muted" }, `${run.title} · ${run.path}`), cards];
  if (run.error) parts.push(el("p", { class: "error" }, run.error));
  parts.push(el("h2", {}, "Curves"), charts);
  parts.push(el("h2", {}, "Held-out results"), heldOutTable(run.held_out));
  const steps = el("table", { "data-test": "steps" }, el("tr", {}, ["Step", "Reward", "Loss", "Trained", "Failed", "Seconds", "Rollouts"].map((h) => el("th", {}, h))));
  for (const r of train.slice().reverse().slice(0, 100)) {
    steps.append(el("tr", {}, el("td", {}, r.step), el("td", { class: "num" }, fmt(r.mean_reward)), el("td", { class: "num" }, fmt(r.loss)),
      el("td", { class: "num" }, `${fmt(r.trained_transitions)} / ${fmt(r.transitions)}`), el("td", { class: "num" }, fmt(r.rollouts_failed)),
      el("td", { class: "num" }, fmt(r.seconds, 3)), el("td", {}, el("a", { href: `#/rollouts?run=${encodeURIComponent(run.rollouts_run)}&step=${r.step}`, "data-test": "steps-link" }, "rollouts"))));
  }
  parts.push(el("h2", {}, "Steps"), steps);
  if (run.config) parts.push(el("h2", {}, "Config"), el("details", {}, el("summary", {}, "show"), el("pre", { class: "config" }, JSON.stringify(run.config, null, 2))));
  setMain(...parts);
  if (run.status === "running") refreshTimer = setTimeout(route, 5000);
}

function card(label, value) {
  return el("div", { class: "card" }, el("div", { class: "label" }, label), el("div", { class: "value" }, value));
}

// ---- rollouts -------------------------------------------------------------------------------------

const FILTERS = ["status", "run", "step", "split", "agent", "task", "search", "reward_min", "reward_max"];

async function viewRollouts(params) {
  const query = new URLSearchParams();
  for (const key of FILTERS.concat(["before", "limit"])) {
    const value = params.get(key);
    if (value) query.set(key, value);
  }
  const form = el("form", { class: "filters", "data-test": "filters" },
    el("label", {}, "status", el("select", { name: "status" }, ["", "succeeded", "failed", "timed_out", "running", "queued", "cancelled"].map((s) => {
      const option = el("option", { value: s }, s || "any");
      if (s === (params.get("status") || "")) option.selected = true;
      return option;
    }))),
    ...["run", "step", "split", "agent", "task", "search", "reward_min", "reward_max"].map((name) =>
      el("label", {}, name.replace("_", " "), el("input", { name, value: params.get(name) || "", size: name === "search" ? 20 : name === "task" || name === "agent" ? 14 : 6, title: name === "search" ? "rollouts with a span whose name or an attribute contains this text (case-sensitive)" : null }))),
    el("button", { type: "submit" }, "Filter"),
    el("button", { type: "button", class: "secondary", onclick: () => { location.hash = "#/rollouts"; } }, "Clear"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const [key, value] of new FormData(form).entries()) if (value) next.set(key, value);
    location.hash = `#/rollouts?${next}`;
  });
  setMain(el("h1", {}, "Rollouts"), form, el("p", { class: "muted" }, "loading…"));
  const started = performance.now();
  const page = await api(`/api/rollouts?${query}`);
  const table = el("table", { "data-test": "rollouts" },
    el("tr", {}, ["Rollout", "Task", "Status", "Reward", "Run", "Step", "Split", "Spans", "Attempts", "Duration", "Created"].map((h) => el("th", {}, h))));
  for (const r of page.rollouts) {
    table.append(el("tr", { class: "clickable", "data-rollout": r.rollout_id, onclick: () => { location.hash = `#/rollout/${encodeURIComponent(r.rollout_id)}`; } },
      el("td", {}, el("a", { href: `#/rollout/${encodeURIComponent(r.rollout_id)}` }, r.rollout_id), r.error ? el("div", { class: "error" }, r.error) : null),
      el("td", {}, r.task_id), el("td", {}, status(r.status)), el("td", { class: "num" }, fmt(r.reward)),
      el("td", {}, r.run ? el("a", { href: `#/run/${encodeURIComponent(r.run)}` }, r.run) : "–"),
      el("td", { class: "num" }, fmt(r.step)), el("td", {}, fmt(r.split)), el("td", { class: "num" }, fmt(r.spans)),
      el("td", { class: "num" }, fmt(r.attempts)), el("td", { class: "num" }, r.duration_s === null ? "–" : `${fmt(r.duration_s)}s`),
      el("td", {}, when(r.created_at))));
  }
  const history = (params.get("trail") || "").split(",").filter(Boolean);
  const base = new URLSearchParams(query);
  const prev = el("button", { class: "secondary", disabled: !history.length, onclick: () => {
    const trail = history.slice(0, -1);
    base.delete("before");
    if (history[history.length - 1] !== "top") base.set("before", history[history.length - 1]);
    if (trail.length) base.set("trail", trail.join(",")); else base.delete("trail");
    location.hash = `#/rollouts?${base}`;
  } }, "← Newer");
  const next = el("button", { class: "secondary", disabled: page.before === null, onclick: () => {
    const trail = history.concat([params.get("before") || "top"]);
    base.set("before", page.before);
    base.set("trail", trail.join(","));
    location.hash = `#/rollouts?${base}`;
  } }, "Older →");
  const total = `${page.total.toLocaleString("en-US")}${page.total_capped ? "+" : ""} matching`;
  const elapsed = Math.round(performance.now() - started);
  setMain(el("h1", {}, "Rollouts"), form,
    el("p", { class: "muted", "data-test": "total" }, `${total} · ${elapsed} ms`),
    page.rollouts.length ? table : el("p", { class: "muted" }, "No rollout matches."),
    el("div", { class: "pager" }, prev, next));
}

// ---- one rollout ----------------------------------------------------------------------------------

function timeline(spans) {
  const { ticks } = niceTicks(0, Math.max(1, ...spans.map((s) => s.start_ms + s.duration_ms)), 5);
  const end = ticks[ticks.length - 1];
  const box = el("div", { class: "timeline", "data-test": "timeline" });
  // a time axis over the bars: round ticks from the rollout's first span, in ms or s
  const axis = el("div", { class: "tl-track tl-axis", "data-test": "time-axis" });
  for (const t of ticks) {
    const label = el("span", { class: "tl-tick" }, end >= 5000 ? `${fmt(t / 1000)} s` : `${fmt(t)} ms`);
    label.style.left = `${(100 * t) / end}%`;
    axis.append(label);
  }
  box.append(el("div", { class: "tl-row tl-axis-row" }, el("div", { class: "tl-name muted" }, "time from start"), axis));
  for (const s of spans) {
    const bar = el("div", { class: `tl-bar ${s.kind}${s.error ? " error" : ""}` });
    bar.style.left = `${(100 * s.start_ms) / end}%`;
    bar.style.width = `${Math.max(0.3, (100 * s.duration_ms) / end)}%`;
    bar.title = `${s.name}: ${fmt(s.duration_ms)} ms`;
    const tags = [el("span", { class: "tag" }, s.kind)];
    if (s.agent) tags.push(el("span", { class: "tag" }, `agent=${s.agent}`));
    if (s.tool) tags.push(el("span", { class: "tag" }, `tool=${s.tool}`));
    if (s.tokens) tags.push(el("span", { class: "tag" }, `${s.tokens[0]}+${s.tokens[1]} tokens`));
    if (s.reward) tags.push(el("span", { class: "tag reward" }, `${s.reward.name}=${fmt(s.reward.value)}`));
    if (s.transition !== null && s.transition !== undefined) tags.push(el("span", { class: "tag" }, `→ call ${s.transition}`));
    if (s.problem) tags.push(el("span", { class: "tag error" }, `no transition: ${s.problem}`));
    if (s.error) tags.push(el("span", { class: "tag error" }, `ERROR ${s.status_message}`));
    const name = el("div", { class: "tl-name" }, s.name, ...tags);
    name.style.paddingLeft = `${s.depth * 14}px`;
    const row = el("div", { class: "tl-row", "data-span": s.span_id }, name, el("div", { class: "tl-track" }, bar));
    const attrs = el("div", { class: "attrs" }, JSON.stringify({ span_id: s.span_id, attempt: s.attempt_id, start_ms: s.start_ms, duration_ms: s.duration_ms, attributes: s.attributes }, null, 2));
    attrs.hidden = true;
    row.addEventListener("click", () => { attrs.hidden = !attrs.hidden; row.classList.toggle("open", !attrs.hidden); });
    box.append(row, attrs);
  }
  return box;
}

function shade(logprob) {
  if (logprob === null || logprob === undefined) return "transparent";
  const p = Math.exp(logprob);
  // confident tokens stay light; unlikely ones turn red
  return `rgba(200, 50, 60, ${Math.min(0.75, (1 - p) * 0.75).toFixed(3)})`;
}

function transitionView(t) {
  const response = el("div", { class: "response", "data-test": "response" });
  for (const token of t.response) {
    const span = el("span", { class: "tok", title: `id ${token.id}, logprob ${fmt(token.logprob, 4)}` }, token.text);
    span.style.background = shade(token.logprob);
    response.append(span);
  }
  return el("div", { class: "card transition", "data-call": t.call_index },
    el("div", { class: "head" },
      el("strong", {}, `call ${t.call_index}`),
      el("span", {}, `agent: ${t.agent || "–"}`),
      el("span", {}, `policy: ${t.policy || "base"} v${fmt(t.policy_version)}`),
      el("span", {}, `reward: ${fmt(t.reward, 4)}`),
      el("span", {}, `advantage: ${fmt(t.advantage, 4)}`),
      t.trained ? el("span", { class: "pos" }, "trained") : el("span", { class: "neg", "data-test": "reason" }, `not trained: ${t.reason}`),
      el("span", { class: "muted" }, `${t.prompt_tokens} prompt + ${t.response_tokens} response tokens`)),
    el("details", {}, el("summary", {}, t.decoded ? "prompt" : "prompt token ids (no tokenizer here)"), el("div", { class: "prompt" }, t.prompt)),
    el("div", { class: "muted" }, "response (shaded by how unlikely the policy found each token)"),
    response);
}

async function viewRollout(id) {
  const data = await api(`/api/rollouts/${encodeURIComponent(id)}`);
  const r = data.rollout;
  const parts = [
    el("h1", {}, `Rollout ${r.rollout_id}`),
    el("div", { class: "cards" },
      card("Status", status(r.status)), card("Task", r.task_id), card("Reward", fmt(r.reward, 4)),
      card("Run", r.run ? el("a", { href: `#/run/${encodeURIComponent(r.run)}`, "data-test": "run-link" }, r.run) : "–"),
      card("Step / split", r.run && r.step !== null && r.step !== undefined
        ? el("a", { href: `#/rollouts?run=${encodeURIComponent(r.run)}&step=${r.step}`, "data-test": "step-link" }, `${fmt(r.step)} / ${fmt(r.split)}`)
        : `${fmt(r.step)} / ${fmt(r.split)}`),
      card("Attempts", r.attempts.length), card("Spans", fmt(r.spans))),
  ];
  if (data.untrained) parts.push(el("p", { class: "error", "data-test": "untrained" }, `Did not train: ${data.untrained}`));
  const lastAttempt = r.attempts.length ? r.attempts[r.attempts.length - 1] : null;
  if (lastAttempt && lastAttempt.error) parts.push(el("details", {}, el("summary", { class: "error" }, `error (${lastAttempt.status})`), el("pre", { class: "config" }, lastAttempt.error)));
  parts.push(el("details", {}, el("summary", {}, "input and metadata"), el("pre", { class: "config" }, JSON.stringify({ input: r.input, metadata: r.metadata, group: r.group_id }, null, 2))));
  parts.push(el("h2", {}, "Timeline"), data.spans.length ? timeline(data.spans) : el("p", { class: "muted" }, "No spans stored for this rollout."));
  parts.push(el("h2", {}, `Transitions (${data.transitions.length})`));
  if (data.transitions.length) parts.push(...data.transitions.map(transitionView));
  else parts.push(el("p", { class: "muted" }, "No LLM call of this rollout became a transition."));
  if (data.problems.length) {
    parts.push(el("h2", {}, "Problems"), el("ul", {}, data.problems.map((p) => el("li", {}, p.reason, p.detail ? ` (${p.detail})` : "", p.span_id ? ` [span ${p.span_id}]` : ""))));
  }
  if (data.group.length) {
    const table = el("table", {}, el("tr", {}, el("th", {}, "Rollout"), el("th", {}, "Status"), el("th", { class: "num" }, "Reward")));
    for (const g of data.group) {
      table.append(el("tr", {}, el("td", {}, el("a", { href: `#/rollout/${encodeURIComponent(g.rollout_id)}` }, g.rollout_id)), el("td", {}, status(g.status)), el("td", { class: "num" }, fmt(g.reward))));
    }
    parts.push(el("h2", {}, "Its group"), table);
  }
  setMain(...parts);
}

// ---- agl improve ----------------------------------------------------------------------------------

async function viewImprove(params) {
  const name = params.get("name") || "";
  const form = el("form", { class: "filters", "data-test": "improve-form" },
    el("label", {}, "service (improve.name)", el("input", { name: "name", value: name || "default" })),
    el("button", { type: "submit" }, "Show"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    location.hash = `#/improve?name=${encodeURIComponent(new FormData(form).get("name"))}`;
  });
  if (!name) {
    setMain(el("h1", {}, "agl improve"), form, el("p", { class: "muted" }, "The versions an agl improve service made, its gate's numbers, where each was published and what it is waiting for."));
    return;
  }
  const data = await api(`/api/improve/${encodeURIComponent(name)}`);
  const lineage = data.lineage;
  const cards = el("div", { class: "cards" },
    card("Serving", `v${lineage.serving}`),
    card("Rounds", fmt(lineage.rounds)),
    card("Rollouts trained on", fmt(lineage.consumed_count)),
    card("Updated", when(lineage.updated_at)),
    card("Service", serviceState(lineage)));
  const versions = el("table", { "data-test": "versions" }, el("tr", {},
    ["Version", "Status", "From", "Round", "Trained on", "Held-out (serving → candidate)", "Paired change", "Live reward (sessions)", "Published to", "Note"].map((h) => el("th", {}, h))));
  for (const v of lineage.versions.slice().reverse()) {
    const gate = v.gate || {};
    const change = gate.change === null || gate.change === undefined ? "–" : `${gate.change > 0 ? "+" : ""}${fmt(gate.change)} ± ${fmt(gate.se)} (n=${gate.tasks})`;
    versions.append(el("tr", { "data-version": v.version },
      el("td", {}, `v${v.version}`), el("td", {}, status(v.status)), el("td", {}, v.parent === null ? "–" : `v${v.parent}`),
      el("td", { class: "num" }, fmt(v.round)), el("td", { class: "num" }, fmt(v.trained_on.length)),
      el("td", {}, gate.serving === undefined || gate.serving === null ? "–" : `${fmt(gate.serving)} → ${fmt(gate.candidate)}`),
      el("td", { class: gate.change > 0 ? "num pos" : "num neg" }, change),
      el("td", { class: "num", "data-test": "live" }, liveReward((lineage.live || {})[String(v.version)])),
      el("td", {}, Object.keys(v.published || {}).join(", ") || "–"),
      el("td", {}, v.note || gate.reason || "")));
  }
  const gateways = el("table", { "data-test": "gateways" }, el("tr", {}, ["Gateway", "State", "Serves", "Message"].map((h) => el("th", {}, h))));
  for (const [label, t] of Object.entries(lineage.targets || {})) {
    gateways.append(el("tr", {}, el("td", {}, label), el("td", {}, status(t.state)), el("td", {}, t.serving === null ? "–" : `v${t.serving}`), el("td", {}, t.message || "")));
  }
  const events = el("ul", { "data-test": "events" }, lineage.events.slice().reverse().slice(0, 50).map((e) => el("li", {}, `${when(e.time)} ${e.kind}: ${e.message}`)));
  const parts = [el("h1", {}, `agl improve: ${name}`), form, cards, el("p", { "data-test": "waiting" }, `now: ${lineage.waiting}`)];
  if (lineage.pending) parts.push(el("p", {}, `round ${lineage.pending.round} in progress: v${lineage.pending.version} from v${lineage.pending.parent} on ${lineage.pending.rollouts.length} rollouts (${lineage.pending.phase})`));
  parts.push(el("h2", {}, "Versions"), versions, el("h2", {}, "Gateways"), gateways, el("h2", {}, "Events"), events);
  setMain(...parts);
  refreshTimer = setTimeout(route, 10000);
}

// ---- routing --------------------------------------------------------------------------------------

async function storeStats() {
  try {
    const stats = await api("/api/stats", { forRoute: false });
    document.getElementById("store-stats").textContent = `store: ${fmt(stats.spans)} spans · ${fmt(stats.rollouts)} rollouts`;
  } catch (e) {
    document.getElementById("store-stats").textContent = "";
  }
}

// A version's live reward: the mean of the late rewards of the sessions it served alone.
function liveReward(live) {
  if (!live || !live.sessions) return "–";
  const left = live.left_out ? `, ${fmt(live.left_out)} left out` : "";
  return `${fmt(live.mean)} ± ${fmt(live.se)} (${fmt(live.sessions)}${left})`;
}

// Whether the service runs: it said it stopped, or its lineage (rewritten at least every minute while it
// runs) went quiet.
function serviceState(lineage) {
  if (lineage.stopped_at) return `stopped ${when(lineage.stopped_at)}`;
  const quiet = Date.now() / 1000 - lineage.updated_at;
  return quiet > 180 ? `silent since ${when(lineage.updated_at)} (killed?)` : "running";
}

async function route() {
  clearTimeout(refreshTimer);
  routeSeq += 1;
  const hash = location.hash.slice(1) || "/";
  const [path, search] = hash.split("?");
  const params = new URLSearchParams(search || "");
  const section = path.startsWith("/rollout") ? "rollouts" : path.startsWith("/improve") ? "improve" : "runs";
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === section));
  try {
    if (path.startsWith("/run/")) await viewRun(decodeURIComponent(path.slice(5)));
    else if (path === "/compare") await viewCompare(params);
    else if (path === "/rollouts") await viewRollouts(params);
    else if (path === "/improve") await viewImprove(params);
    else if (path.startsWith("/rollout/")) await viewRollout(decodeURIComponent(path.slice(9)));
    else await viewRuns();
    document.body.dataset.ready = hash;
  } catch (error) {
    if (error instanceof StaleRoute) return;  // a later navigation draws the page
    showError(error);
    document.body.dataset.ready = hash;
  }
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", () => { route(); storeStats(); });
