// The live mesh view: listens to /events (server-sent events), draws each frame. No build step,
// no dependencies. Every value goes in with textContent, never as HTML.
"use strict";

const HISTORY_POINTS = 300;
const history = {}; // pool -> endpoint -> [{at, p99_ms, qps, weight, share}]
let actions = false;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const fmt = {
  ms: (v) => (v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) : v.toFixed(0)),
  qps: (v) => (v === null || v === undefined ? "–" : v < 10 ? v.toFixed(1) : v.toFixed(0)),
  pct: (v) => (v === null || v === undefined ? "–" : `${(v * 100).toFixed(0)}%`),
  bytes: (v) => {
    if (v === null || v === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return `${v.toFixed(v < 10 ? 1 : 0)} ${units[i]}`;
  },
  time: (at) => new Date(at * 1000).toLocaleTimeString(),
};

function stateBadge(state) {
  return el("span", { class: `badge state-${state.replace(/ /g, "-")}`, "data-state": state }, state);
}

function bar(fraction, label, extraClass) {
  const width = Math.max(0, Math.min(1, fraction || 0)) * 100;
  return el("div", { class: "barwrap", title: label },
    el("div", { class: `bar ${extraClass || ""}` }, el("span", { style: `width:${width}%` })),
    el("em", {}, label));
}

function gauge(used, total) {
  if (used === null || used === undefined || !total) return "–";
  const f = used / total;
  const level = f >= 0.95 ? "full" : f >= 0.8 ? "high" : "";
  return bar(f, `${fmt.pct(f)} of ${fmt.bytes(total)}`, `gauge ${level}`);
}

function kvGauge(used, total) {
  if (used === null || used === undefined || !total) return "–";
  const f = used / total;
  const level = f >= 0.95 ? "full" : f >= 0.8 ? "high" : "";
  return bar(f, `${fmt.pct(f)} of ${total} blocks`, `gauge ${level}`);
}

function spark(points, field) {
  const values = points.map((p) => p[field]).filter((v) => v !== null && v !== undefined);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", "0 0 90 22");
  svg.setAttribute("preserveAspectRatio", "none");
  if (values.length >= 2) {
    const max = Math.max(...values, 1e-9);
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    const step = 90 / (values.length - 1);
    line.setAttribute("points", values.map((v, i) =>
      `${(i * step).toFixed(1)},${(21 - (v / max) * 20).toFixed(1)}`).join(" "));
    svg.append(line);
  }
  const title = document.createElementNS("http://www.w3.org/2000/svg", "title");
  title.textContent = `${field}, last ${values.length} s (max ${values.length ? Math.max(...values).toFixed(1) : "–"})`;
  svg.append(title);
  return svg;
}

function remember(frame) {
  for (const pool of frame.pools) {
    const lines = (history[pool.model] ||= {});
    for (const row of pool.endpoints) {
      const line = (lines[row.endpoint] ||= []);
      line.push({ at: frame.at, p99_ms: row.p99_ms, qps: row.qps, weight: row.weight, share: row.share });
      if (line.length > HISTORY_POINTS) line.splice(0, line.length - HISTORY_POINTS);
    }
  }
}

async function post(path, body) {
  const token = sessionStorage.getItem("infermesh-token") || "";
  const response = await fetch(path, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${token}` },
    body: JSON.stringify(body),
  });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) alert(`${path}: ${answer.error || response.status}`);
}

function splitView(pool) {
  const entries = Object.entries(pool.version_split);
  const total = entries.reduce((sum, [, w]) => sum + w, 0);
  const parts = entries.length && total
    ? entries.map(([v, w]) => el("span", { style: `width:${(w / total) * 100}%`, title: `v${v}: ${w}` },
      `v${v} ${fmt.pct(w / total)}`))
    : [el("span", { style: "width:100%;background:#8a93a3" }, "no split: the newest READY version")];
  const children = [el("div", { class: "split", "data-split": pool.model }, parts)];
  if (actions) {
    const inputs = entries.length ? entries : [["1", 100]];
    const form = el("form", { class: "split-form", onsubmit: (event) => {
      event.preventDefault();
      const body = {};
      for (const input of form.querySelectorAll("input")) body[input.name] = Number(input.value);
      post(`/models/${encodeURIComponent(pool.model)}/split`, body);
    } },
    inputs.map(([v, w]) => el("label", {}, `v${v} `, el("input", { name: v, type: "number", min: 0, value: w }))),
    el("button", { type: "submit" }, "set split"));
    children.push(form);
  }
  return children;
}

function canaryView(pool) {
  const run = pool.canary;
  if (!run) return null;
  return el("div", { class: "canary", "data-canary": run.status },
    `canary v${run.canary} vs v${run.stable}: `, el("strong", {}, run.status),
    ` at ${run.percent}% (step ${run.step}): ${run.reason}`);
}

function circuitView(pool) {
  const circuit = pool.circuit;
  if (!circuit || !circuit.open) return null;
  return el("div", { class: "circuit" }, el("span", { class: "badge state-ejected" }, "circuit open"),
    ` the fallback serves for ${circuit.open_for_s} s more`);
}

function drainButton(row) {
  if (!actions) return null;
  const draining = row.state === "draining";
  return el("button", { onclick: () => post(`/endpoints/${encodeURIComponent(row.endpoint)}`,
    { health: draining ? null : "DRAINING" }) }, draining ? "undrain" : "drain");
}

function affinityView(affinity) {
  if (!affinity) return null;
  const key = affinity.mode === "prefix" ? `first ${affinity.prefix_bytes} B of the prompt`
    : `${affinity.session_header} per tenant`;
  return el("span", { class: "affinity", "data-field": "affinity" },
    `affinity: ${affinity.mode} (${key}), bound ${affinity.hash_balance_factor}% of mean`);
}

function poolView(pool, windowS) {
  const lines = history[pool.model] || {};
  const rows = pool.endpoints.map((row) => {
    const points = lines[row.endpoint] || [];
    return el("tr", { "data-endpoint": row.endpoint, "data-state": row.state },
      el("td", {}, el("code", {}, row.endpoint),
        Object.keys(row.labels || {}).length ? el("div", { class: "labels", "data-field": "labels" },
          Object.entries(row.labels).map(([k, v]) => `${k}=${v}`).join(" · ")) : null,
        row.stale ? el("div", { class: "reason" }, "telemetry stale") : null),
      el("td", {}, stateBadge(row.state)),
      el("td", {}, bar((row.weight || 0) / 100, `${row.weight ?? "–"}`)),
      el("td", { class: "num", "data-field": "share" }, fmt.pct(row.share), spark(points, "share")),
      el("td", { class: "num", "data-field": "p99" }, `${fmt.ms(row.p99_ms)} ms`, spark(points, "p99_ms")),
      el("td", { class: "num" }, fmt.qps(row.qps), spark(points, "qps")),
      el("td", {}, gauge(row.memory_used_bytes, row.memory_total_bytes)),
      el("td", {}, kvGauge(row.kv_blocks_used, row.kv_blocks_total)),
      el("td", { class: "num", "data-field": "cache-hits" }, fmt.pct(row.prefix_cache_hit_rate)),
      el("td", { class: "reason", "data-field": "reason" }, row.reason),
      actions ? el("td", {}, drainButton(row)) : null);
  });
  const over = windowS ? ` (${windowS} s)` : "";
  const head = ["endpoint", "state", "weight", `share${over}`, `P99${over}`, `QPS${over}`, "memory", "KV cache", `cache hits${over}`, "why"];
  if (actions) head.push("");
  return el("div", { class: "pool", "data-pool": pool.model },
    el("div", { class: "pool-head" }, el("h2", {}, pool.model),
      pool.fail_open ? el("span", { class: "badge state-draining" }, "failing open") : null,
      affinityView(pool.affinity),
      splitView(pool)),
    canaryView(pool), circuitView(pool),
    el("div", { class: "scroll" }, el("table", {},
      el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))),
      el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: head.length }, "no endpoint has this model READY"))))));
}

function nodeView(node) {
  const types = Object.entries(node.types).map(([kind, t]) => el("div", {},
    `${kind}: acked `, el("code", {}, t.acked_version || "–"),
    t.in_sync ? " in sync" : " behind",
    t.last_nack ? el("div", { class: "reason" }, `last NACK: ${t.last_nack.error}`) : null));
  return el("div", { class: "node", "data-node": node.node_id },
    el("strong", {}, node.node_id), ` (${node.mode}) `,
    el("span", { class: `badge ${node.connected ? "state-serving" : "state-unreachable"}` },
      node.connected ? "connected" : "disconnected"), types);
}

function draw(frame) {
  document.getElementById("pools").replaceChildren(...frame.pools.map((p) => poolView(p, frame.window_s)));
  const decisions = [...frame.decisions].reverse().map((d) =>
    el("li", { "data-nack": d.nack ? "true" : null }, el("time", {}, fmt.time(d.at)),
      d.nack ? el("span", { class: "badge state-ejected" }, "NACK") : null, " ",
      d.pool ? el("strong", {}, `${d.pool}: `) : null, d.decision));
  document.getElementById("decisions").replaceChildren(...decisions);
  const nodes = frame.nodes.length ? frame.nodes.map(nodeView) : [el("div", { class: "reason" }, "no Envoy connected to this replica")];
  document.getElementById("nodes").replaceChildren(...nodes);
  document.getElementById("updated").textContent = `updated ${fmt.time(frame.at)}`;
  document.getElementById("snapshot").textContent = frame.snapshot ? `snapshot ${Object.values(frame.snapshot)[0] || ""}` : "";
  const error = document.getElementById("topology-error");
  error.hidden = !frame.topology_error;
  error.textContent = frame.topology_error ? `topology error (the last good one is in force): ${frame.topology_error}` : "";
  const warnings = document.getElementById("warnings");
  warnings.hidden = !(frame.warnings || []).length;
  warnings.textContent = (frame.warnings || []).map((w) => `warning: ${w}`).join("\n");
}

function setConnection(live) {
  const badge = document.getElementById("connection");
  badge.textContent = live ? "live" : "reconnecting";
  badge.className = `badge ${live ? "state-serving" : "state-unreachable"}`;
}

function connect() {
  // EventSource reconnects by itself (the server asks for 1 s), e.g. across a control-plane
  // restart; each (re)connection starts with the server's history.
  const source = new EventSource("/events");
  source.addEventListener("history", (event) => {
    const opening = JSON.parse(event.data);
    for (const key of Object.keys(history)) delete history[key];
    Object.assign(history, opening.history);
    if (opening.frame) draw(opening.frame);
    setConnection(true);
  });
  source.addEventListener("frame", (event) => {
    const frame = JSON.parse(event.data);
    remember(frame);
    draw(frame);
    setConnection(true);
  });
  source.addEventListener("error", () => setConnection(false));
}

async function start() {
  try {
    actions = Boolean((await (await fetch("/ui/config")).json()).actions);
  } catch (_) {
    actions = false;
  }
  if (actions) {
    const box = document.getElementById("token-box");
    const input = document.getElementById("token");
    box.hidden = false;
    input.value = sessionStorage.getItem("infermesh-token") || "";
    input.addEventListener("change", () => sessionStorage.setItem("infermesh-token", input.value));
  }
  connect();
}

start();
