// The ndif dashboard page: no build step, no framework. It loads /api/state, then applies the
// server's pushed updates (server-sent events) to its copy; what changed is redrawn once per
// animation frame, so a burst of events costs one redraw. The timeline asks /api/state?until=
// and every panel follows it: one time on the whole page. Read-only: nothing here sends anything
// but GETs. No inline style or script (the server's Content-Security-Policy refuses them): widths
// are set through the CSSOM after each parse (util.js applyWidths).

// The printed URL carries the operator token; the server has put it in a cookie, so the address
// bar (and the history) keep the clean URL.
if (location.search) history.replaceState(null, "", location.pathname);

import { $, FAILED_STATES, applyWidths, esc, fullTime, getJson, gib, gibNum, hideTip, showTip } from "./util.js";
import { Lifelines, Trends } from "./plots.js";

// What tests and tools/bench/dashboard.py read: the seq on screen and when each frame was drawn.
const probe = (window.ndif = { renderedSeq: -1, renders: [], received: [], ready: false, mode: "live", t: {} });

const live = { seq: 0, last_seq: 0, ts: null, nodes: new Map(), models: new Map(), anomaly_count: 0 };
let past = null; // the state shown while the timeline is away from live
let queues = { models: {} };
const dirty = { nodes: new Set(), models: new Set(), all: true, events: [], model: false };
let frame = 0;
let selected = null; // the model whose plots, replicas and lifelines are shown
const trends = new Trends(probe);
const lifelines = new Lifelines(probe);

function loadState(target, body) {
  target.seq = body.seq; target.last_seq = body.last_seq; target.anomaly_count = body.anomaly_count;
  target.ts = body.ts;
  target.nodes = new Map(body.nodes.map((n) => [n.node_id, n]));
  target.models = new Map(body.models.map((m) => [m.model_key, m]));
  target.queuesAt = body.queues_at;
  return target;
}

function schedule() { if (!frame) frame = requestAnimationFrame(render); }

// ---- drawing: nodes ------------------------------------------------------------------------------

const label = (name) => name.split("/").pop();

// A block's width is its share of the card (at least a readable minimum, set in style.css); the
// tooltip gives the true share.
function blockHtml(b, total) {
  return `<div class="block ${esc(b.level)} ${esc(b.state)}" data-w="${((100 * b.bytes) / total).toFixed(3)}" data-model="${esc(b.model_key)}"
    data-replica="${b.replica_id}" data-level="${b.level}" data-state="${b.state}" data-bytes="${b.bytes}" data-total="${total}"
    data-label="${esc(label(b.name))}#${b.replica_id}">${esc(label(b.name))}#${b.replica_id}</div>`;
}

function nodeHtml(n) {
  const cards = n.gpus.map((c) => `<div class="card" data-gpu="${c.index}" data-reserved="${c.reserved_bytes}" data-used="${c.used_bytes}" data-total="${c.total_bytes}">
    <div class="clabel">gpu${c.index} <b>${gibNum(c.reserved_bytes)}/${gibNum(c.total_bytes)}</b> GiB</div>
    <div class="bar">${c.replicas.map((b) => blockHtml(b, c.total_bytes)).join("")}</div></div>`).join("");
  const pct = n.cpu_cache_bytes ? Math.min(100, (100 * n.cpu_cached_bytes) / n.cpu_cache_bytes) : 0;
  const warm = n.warm.map((w) => `<span class="block chip WARM Cached" data-model="${esc(w.model_key)}" data-replica="${w.replica_id}"
    data-level="WARM" data-state="Cached" data-bytes="${w.bytes}">${esc(label(w.name))}#${w.replica_id}</span>`).join("");
  return `<div class="node${n.alive ? "" : " lost"}" id="node-${esc(n.node_id)}" data-node="${esc(n.node_id)}">
    <div class="name" title="${esc(n.hostname)}">${esc(n.node_id)}${n.alive ? "" : " (lost)"}</div>
    <div class="cards">${cards}</div>
    <div class="cpu">WARM ${gib(n.cpu_cached_bytes)} / ${gib(n.cpu_cache_bytes)}
      <div class="cbar"><span data-w="${pct.toFixed(2)}"></span></div><span class="warm">${warm}</span></div></div>`;
}

// A block's label is its model and id where that fits, else only `#id`, else nothing (the colour
// and the tooltip say the rest): never a few cut letters of a name. Measured once in the page.
function fitLabels(root) {
  for (const el of root.querySelectorAll(".bar .block")) {
    const id = "#" + el.dataset.replica;
    el.textContent = el.dataset.label;
    if (el.scrollWidth > el.clientWidth + 1) el.textContent = id;
    if (el.scrollWidth > el.clientWidth + 1) el.textContent = "";
  }
}

// ---- drawing: models, failures, one model's replicas ---------------------------------------------

const STATUS_CLASS = { Available: "good", Progressing: "warn", Failed: "bad", ScaledDown: "idle", Undeploying: "idle" };

// The queue figures of a model row: live ones, or at a past seq what this dashboard sampled then
// (marked "sampled"), or nothing (marked "live only"). Every such cell carries data-live.
function queueCells(m) {
  const view = past;
  let q, mark = "", title = "";
  if (!view) q = queues.models?.[m.model_key] || {};
  else if (view.queuesAt) {
    q = view.queuesAt.models[m.model_key] || {};
    mark = "sampled"; title = `sampled by this dashboard at ${fullTime(q.sampled_at ?? view.queuesAt.t)} (queue figures are not in the log)`;
  } else {
    mark = "liveonly"; title = "live only: queue figures are not in the log, and this dashboard was not sampling at that time";
  }
  const cell = (v) => `<td data-live class="num ${mark}" title="${esc(title)}">${mark === "liveonly" ? "n/a" : esc(v ?? "-")}</td>`;
  if (mark === "liveonly") return Array(6).fill(cell(null)).join("");
  const waiting = q.pending == null && q.queued == null ? null : (q.pending || 0) + (q.queued || 0);
  const wait = q.oldest_wait_s == null ? "-" : q.oldest_wait_s.toFixed(1) + " s";
  const serving = view ? "" : (q.serving_replicas ? q.serving_replicas.join(",") : "-");
  return cell(waiting) + cell(q.in_flight) + cell(q.completed) + cell(q.errors) + cell(wait) +
    (view ? `<td data-live class="liveonly" title="live only: which replicas serve is not in the log">n/a</td>` : cell(serving));
}

function modelRow(m) {
  const states = Object.entries(m.by_state).map(([s, n]) => `<span class="st${FAILED_STATES.has(s) ? " bad" : ""}">${esc(s)} ${n}</span>`).join("");
  return `<tr data-model="${esc(m.model_key)}" class="${m.model_key === selected ? "selected" : ""}"><td class="mname" title="${esc(m.model_key)}">${esc(m.name)}</td>
    <td><span class="status ${STATUS_CLASS[m.status] || ""}">${esc(m.status)}</span></td>
    <td class="num">${m.hot} / ${m.replica_count}</td><td>${states}</td><td class="num">${gib(m.charge_per_replica_bytes)}</td>
    ${queueCells(m)}</tr>`;
}

function failures(view) {
  const out = [];
  for (const m of view.models.values()) for (const r of m.replicas) if (FAILED_STATES.has(r.state)) out.push({ m, r });
  return out.sort((a, b) => b.r.since_seq - a.r.since_seq);
}

function failureRow({ m, r }) {
  return `<tr class="failed" data-model="${esc(m.model_key)}" data-replica="${r.replica_id}"><td>${esc(m.name)}</td><td class="num">${r.replica_id}</td>
    <td class="bad">${esc(r.state)}</td><td>${esc(r.node_id || "-")}${r.gpu_indices.length ? " gpu " + r.gpu_indices.join(",") : ""}</td>
    <td class="num">${r.since_seq}</td><td class="error errtext">${esc(r.error || "(no error text)")}</td></tr>`;
}

function replicaRow(mk, r) {
  const bad = FAILED_STATES.has(r.state);
  return `<tr data-model="${esc(mk)}" data-replica="${r.replica_id}" class="${bad ? "failed" : ""}"><td class="num">${r.replica_id}</td>
    <td class="${bad ? "bad" : ""}">${esc(r.state)}</td><td><span class="lvl ${esc(r.level)}">${esc(r.level)}</span></td><td>${esc(r.desired)}</td>
    <td>${esc(r.node_id || "-")}</td><td>${r.gpu_indices.length ? "gpu " + r.gpu_indices.join(",") : esc(r.where)}</td><td class="num">${r.since_seq}</td>
    <td class="num">${r.restarts}</td><td class="${bad ? "error errtext" : "errtext"}">${esc(r.error || "")}</td></tr>`;
}

function drawModelPanel(view) {
  const pick = $("model-pick");
  if (pick.options.length !== view.models.size || dirty.all) { // a model's name never changes: its count does
    pick.innerHTML = [...view.models.values()].map((m) => `<option value="${esc(m.model_key)}">${esc(m.name)}</option>`).join("");
  }
  if (selected && !view.models.has(selected)) selected = null;
  if (!selected && view.models.size) {
    const failing = failures(view)[0];
    select(failing ? failing.m.model_key : view.models.keys().next().value, false);
  }
  pick.value = selected || "";
  const m = selected && view.models.get(selected);
  $("replicas").tBodies[0].innerHTML = m ? m.replicas.map((r) => replicaRow(m.model_key, r)).join("")
    : `<tr><td colspan="9" class="muted">no model</td></tr>`;
}

function select(mk, redraw = true) {
  if (mk === selected) return;
  selected = mk;
  trends.set({ model: mk });
  loadLifelines();
  if (redraw) { dirty.all = true; schedule(); }
}

function loadLifelines() {
  const scope = $("lifeline-scope").value;
  lifelines.load({ model: scope === "all" ? null : selected, window: trends.window, until: past ? past.seq : null });
}

// ---- drawing: events ---------------------------------------------------------------------------------

function eventRow(e) {
  if (e.type === "Skipped") return `<tr data-seq="${e.seq}"><td>${e.seq}</td><td></td><td>Skipped</td><td colspan="6">${esc(e.reason)}</td></tr>`;
  const bad = e.type === "ReplicaLoadFailed" || e.type === "ReplicaFailed" || e.type === "NodeLost";
  return `<tr data-seq="${e.seq}"${bad ? ' class="failed"' : ""}><td>${e.seq}</td><td>${esc(fullTime(e.ts))}</td>
    <td>${esc(e.type)}${e.drain ? ` (${esc(e.drain)})` : ""}</td><td title="${esc(e.model_key)}">${esc(shortName(e.model_key))}</td><td>${e.replica_id ?? ""}</td>
    <td>${esc(e.node_id ?? "")}</td><td>${esc(e.actor)}</td><td>${esc(e.command_id ?? "")}</td>
    <td class="${bad ? "error errtext" : "errtext"}">${esc(e.detail ?? "")}</td></tr>`;
}

function shortName(mk) {
  if (!mk) return "";
  const m = live.models.get(mk) || past?.models.get(mk);
  return m ? m.name : mk.length > 40 ? mk.slice(0, 37) + "..." : mk;
}

const rows = { nodes: new Map(), models: new Map() }; // id -> its element, so a redraw finds it in O(1)

// Replace the elements of the changed ids (a new id is appended), one parse for all of them.
function redraw(ids, views, index, parent, html) {
  const todo = [...ids].filter((id) => views.has(id));
  if (!todo.length) return;
  const scratch = document.createElement(parent.tagName); // a <tbody> parses <tr>s, a <div> parses <div>s
  scratch.innerHTML = todo.map((id) => html(views.get(id))).join("");
  applyWidths(scratch);
  const fresh = [...scratch.children];
  todo.forEach((id, i) => {
    const old = index.get(id);
    if (old) old.replaceWith(fresh[i]);
    else parent.appendChild(fresh[i]);
    index.set(id, fresh[i]);
    fitLabels(fresh[i]);
  });
}

function drawHeader(view) {
  $("seq").textContent = view.seq;
  $("lastseq").textContent = live.last_seq;
  $("seqtime").textContent = view.ts ? fullTime(view.ts) : "";
  const a = view.anomaly_count;
  $("anomaly-count").textContent = a;
  $("anomalies-btn").className = "badge " + (a ? "bad" : "ok");
  const f = failures(view).length;
  $("failure-count").textContent = f;
  $("failures-btn").className = "badge " + (f ? "bad" : "ok");
  const slider = $("slider");
  slider.max = live.last_seq;
  if (!past) slider.value = live.seq;
}

function render() {
  const t0 = performance.now();
  frame = 0;
  const view = past || live;
  drawHeader(view);
  if (dirty.all) {
    $("nodes").classList.toggle("big", view.nodes.size > 100);
    $("nodes").innerHTML = [...view.nodes.values()].map(nodeHtml).join("");
    applyWidths($("nodes"));
    fitLabels($("nodes"));
    $("models").tBodies[0].innerHTML = [...view.models.values()].map(modelRow).join("");
    rows.nodes = new Map([...$("nodes").children].map((el) => [el.dataset.node, el]));
    rows.models = new Map([...$("models").tBodies[0].rows].map((el) => [el.dataset.model, el]));
  } else {
    redraw(dirty.nodes, view.nodes, rows.nodes, $("nodes"), nodeHtml);
    redraw(dirty.models, view.models, rows.models, $("models").tBodies[0], modelRow);
  }
  if (dirty.all || dirty.models.size) {
    const f = failures(view);
    $("failures").tBodies[0].innerHTML = f.length ? f.slice(0, 200).map(failureRow).join("")
      : `<tr><td colspan="6" class="good-text">no failed replica</td></tr>`;
    drawModelPanel(view);
    drawNodePick(view);
  }
  if (dirty.events.length && !past) {
    const tb = $("events").tBodies[0];
    const fresh = dirty.events.filter(matches).reverse();
    tb.insertAdjacentHTML("afterbegin", fresh.map(eventRow).join(""));
    while (tb.rows.length > 300) tb.deleteRow(-1);
  }
  dirty.nodes.clear(); dirty.models.clear(); dirty.events = []; dirty.all = false;
  probe.renderedSeq = view.seq;
  probe.t.lastFrameMs = performance.now() - t0; // the script's part of the frame
  probe.mode = past ? "past" : "live";
  probe.renders.push([view.seq, Date.now()]);
  if (probe.renders.length > 20000) probe.renders.splice(0, 10000);
}

function drawNodePick(view) {
  const pick = $("node-pick");
  const ids = [...view.nodes.keys()];
  if (pick.options.length !== Math.min(ids.length, 2000) || dirty.all) {
    // A cluster of thousands of nodes: the picker lists the first 2,000 (any node: double-click its row).
    pick.innerHTML = ids.slice(0, 2000).map((id) => `<option>${esc(id)}</option>`).join("");
  }
  if (!trends.node && ids.length) { trends.set({ node: ids[0] }); }
  pick.value = trends.node || "";
}

// ---- live stream --------------------------------------------------------------------------------

function applyUpdate(u) {
  probe.received.push([u.seq, Date.now()]);
  if (probe.received.length > 20000) probe.received.splice(0, 10000);
  const fresh = u.events.filter((e) => e.seq > live.seq); // an update may overlap the state the page loaded
  live.seq = u.seq; live.last_seq = u.last_seq; live.anomaly_count = u.anomaly_count;
  for (const e of fresh) if (e.ts) { const t = Date.parse(e.ts) / 1000; if (!(live.ts >= t)) live.ts = t; }
  for (const n of u.nodes) { live.nodes.set(n.node_id, n); if (!past) dirty.nodes.add(n.node_id); }
  for (const m of u.models) { live.models.set(m.model_key, m); if (!past) dirty.models.add(m.model_key); }
  dirty.events.push(...fresh);
  if (!past && u.models.some((m) => m.model_key === selected)) lifelinesSoon();
  schedule();
}

let lifelineTimer = 0;
function lifelinesSoon() { if (!lifelineTimer) lifelineTimer = setTimeout(() => { lifelineTimer = 0; if (!past) loadLifelines(); }, 500); }

let source = null;
async function connect() {
  if (source) source.close();
  probe.t.fetch = performance.now();
  const body = await getJson("/api/state");
  probe.t.fetched = performance.now();
  loadState(live, body);
  dirty.all = true;
  schedule();
  source = new EventSource(`/api/stream?since=${live.seq}`);
  source.addEventListener("update", (e) => applyUpdate(JSON.parse(e.data)));
  source.addEventListener("queues", (e) => {
    const old = queues.models || {};
    queues = JSON.parse(e.data);
    $("dispatcher").textContent = queues.dispatcher ? `dispatcher ${queues.dispatcher}` : (queues.error || "");
    for (const [mk, q] of Object.entries(queues.models)) {  // redraw only the rows whose figures moved
      if (!past && JSON.stringify(q) !== JSON.stringify(old[mk])) dirty.models.add(mk);
    }
    schedule();
  });
  source.addEventListener("resync", () => connect());
  source.onopen = () => { $("conn").textContent = "live stream"; };
  source.onerror = () => { $("conn").textContent = "reconnecting"; };
  probe.ready = true;
}

// ---- timeline: one time for every panel ------------------------------------------------------------

let wanted = null, fetching = false;
async function goTo(until) {
  wanted = until;
  if (fetching) return; // the latest position wins; one request at a time
  fetching = true;
  try {
    while (wanted !== null) {
      const u = wanted; wanted = null;
      try {
        const body = await getJson(`/api/state?until=${encodeURIComponent(u)}`);
        if (body.live) { backToLive(); continue; }
        past = loadState({}, body);
        $("mode").textContent = `AT SEQ ${body.seq}`; $("mode").className = "mode past";
        $("live").disabled = false;
        $("slider").value = body.seq;
        $("f-error").textContent = "";
        $("queues-note").textContent = body.queues_at ? "queue figures: as sampled at that time (not in the log)"
          : "queue figures: live only (not in the log; not sampled at that time)";
        document.body.classList.add("past");
        trends.set({ until: String(body.seq) });
        loadLifelines();
        eventsAt(body.seq);
      } catch (err) { $("f-error").textContent = err.message; }
      dirty.all = true; schedule();
    }
  } finally { fetching = false; }
}

function backToLive() {
  const was = past;
  past = null;
  $("mode").textContent = "LIVE"; $("mode").className = "mode live"; $("live").disabled = true;
  $("queues-note").textContent = "";
  document.body.classList.remove("past");
  dirty.all = true; schedule();
  if (was) { trends.set({ until: null }); loadLifelines(); loadEvents(false); }
}

$("slider").addEventListener("input", (e) => goTo(e.target.value));
$("go").addEventListener("click", () => goTo($("seqbox").value.trim()));
$("seqbox").addEventListener("keydown", (e) => { if (e.key === "Enter") goTo($("seqbox").value.trim()); });
$("live").addEventListener("click", backToLive);

// ---- events tail and filters -------------------------------------------------------------------

const filters = {};
function matches(e) {
  if (filters.model) {
    const n = shortName(e.model_key);
    if (!(e.model_key === filters.model || n === filters.model || label(n) === filters.model.replace(/\/+$/, ""))) return false;
  }
  if (filters.replica !== undefined && e.replica_id !== filters.replica) return false;
  if (filters.type && e.type !== filters.type) return false;
  if (filters.actor && !(e.actor || "").includes(filters.actor)) return false;
  return true;
}
function eventsQuery(extra) {
  const p = new URLSearchParams({ limit: "100", ...extra });
  for (const k of ["model", "type", "actor"]) if (filters[k]) p.set(k, filters[k]);
  if (filters.replica !== undefined) p.set("replica", filters.replica);
  return p;
}
let nextBefore = null;
async function loadEvents(more) {
  const p = eventsQuery(more && nextBefore ? { before: nextBefore } : past ? { before: past.seq + 1 } : {});
  try {
    const body = await getJson(`/api/events?${p}`);
    const tb = $("events").tBodies[0];
    if (!more) tb.innerHTML = "";
    tb.insertAdjacentHTML("beforeend", body.events.map(eventRow).join(""));
    nextBefore = body.next_before;
    $("f-error").textContent = "";
  } catch (err) { $("f-error").textContent = err.message; }
}

// The events table at a past seq: a few newer rows above it, the seq's row highlighted and scrolled
// to the middle of the table's box (the page itself does not jump).
async function eventsAt(seq) {
  try {
    const body = await getJson(`/api/events?${eventsQuery({ before: seq + 21 })}`);
    if (!past || past.seq !== seq) return;
    const tb = $("events").tBodies[0];
    tb.innerHTML = body.events.map(eventRow).join("");
    nextBefore = body.next_before;
    const row = [...tb.rows].find((r) => +r.dataset.seq <= seq);
    if (row) {
      row.classList.add("at");
      const box = $("events-scroll");
      box.scrollTop = row.offsetTop - box.clientHeight / 2;
    }
    probe.eventsAt = row ? +row.dataset.seq : null;
  } catch (err) { $("f-error").textContent = err.message; }
}
$("f-apply").addEventListener("click", () => {
  for (const k of ["model", "type", "actor"]) filters[k] = $("f-" + k).value.trim() || undefined;
  const r = $("f-replica").value.trim();
  filters.replica = r === "" ? undefined : Number(r);
  if (past) eventsAt(past.seq); else loadEvents(false);
});
$("f-more").addEventListener("click", () => loadEvents(true));

// ---- replica drill-down, anomalies ---------------------------------------------------------------------

// One page of history covers a stretch of the log (the newest first); "older steps" pages back.
let drill = null;
async function openHistory(model, replica, before) {
  const p = new URLSearchParams({ model, replica: String(replica) });
  if (before) p.set("before", before);
  try {
    const h = await getJson(`/api/history?${p}`);
    const rows = h.steps.map((s) => `<tr data-seq="${s.seq}"${past && s.seq > past.seq ? ' class="later"' : ""}><td>${s.seq}</td>
      <td>${esc(fullTime(s.ts))}</td><td>${esc(s.type)}</td><td>${esc(s.node_id ?? "")}</td>
      <td>${s.gpus && s.gpus.length ? "gpu " + s.gpus.join(",") : ""}</td><td>${esc(s.actor)}</td>
      <td>${esc(s.command_id ?? "")}</td><td class="${FAILED_STATES.has(s.state) ? "bad" : ""}">${esc(s.state ?? "")}</td><td>${esc(s.level ?? "")}</td>
      <td>${esc(s.desired ?? "")}</td><td class="errtext${s.anomaly || /Failed$/.test(s.type) ? " error" : ""}">${esc(s.detail ?? "")}${
        s.anomaly ? ` anomaly: ${esc(s.anomaly)}` : ""}</td></tr>`).join("");
    const tb = $("history").tBodies[0];
    if (before) tb.insertAdjacentHTML("afterbegin", rows); else tb.innerHTML = rows;
    drill = { model, replica, before: h.next_before };
    $("drill-title").textContent = `${h.name} replica ${h.replica_id}: ${tb.rows.length} steps` +
      (h.next_before ? ` since seq ${h.next_before}` : "");
    $("drill-older").hidden = !h.next_before;
    $("drill").hidden = false;
  } catch (err) { $("f-error").textContent = err.message; }
}

async function openAnomalies() {
  try {
    const q = past ? `?until=${past.seq}` : "";
    const a = await getJson(`/api/anomalies${q}`);
    $("anomalies-title").textContent = `Anomalies: ${a.anomaly_count}` + (a.anomalies.length < a.anomaly_count ? ` (the last ${a.anomalies.length} kept)` : "");
    $("anomalies").tBodies[0].innerHTML = a.anomalies.length ? a.anomalies.map((x) => `<tr><td><a href="#" data-seq="${x.seq}">${x.seq}</a></td>
      <td>${esc(x.event_type)}</td><td title="${esc(x.model_key)}">${esc(x.name ?? "")}</td><td>${x.replica_id ?? ""}</td>
      <td class="error errtext">${esc(x.message)}</td></tr>`).join("") : `<tr><td colspan="5" class="good-text">none</td></tr>`;
    $("anomalies-panel").hidden = false;
  } catch (err) { $("f-error").textContent = err.message; }
}

function onReplicaClick(e) {
  const b = e.target.closest("[data-replica]");
  if (b && b.dataset.model) openHistory(b.dataset.model, b.dataset.replica);
}
for (const id of ["nodes", "failures", "replicas"]) $(id).addEventListener("click", onReplicaClick);
lifelines.onPick = (mk, rid) => openHistory(mk, rid);
$("models").addEventListener("click", (e) => { const tr = e.target.closest("tr[data-model]"); if (tr) select(tr.dataset.model); });
$("model-pick").addEventListener("change", (e) => select(e.target.value));
$("node-pick").addEventListener("change", (e) => trends.set({ node: e.target.value }));
$("window").addEventListener("change", (e) => { trends.set({ window: e.target.value }); loadLifelines(); });
$("lifeline-scope").addEventListener("change", loadLifelines);
$("drill-older").addEventListener("click", () => { if (drill) openHistory(drill.model, drill.replica, drill.before); });
$("drill-close").addEventListener("click", () => { $("drill").hidden = true; });
$("anomalies-close").addEventListener("click", () => { $("anomalies-panel").hidden = true; });
$("anomalies-btn").addEventListener("click", openAnomalies);
$("failures-btn").addEventListener("click", () => $("failures-section").scrollIntoView());
$("anomalies").addEventListener("click", (e) => { const a = e.target.closest("a[data-seq]"); if (a) { e.preventDefault(); goTo(a.dataset.seq); } });
$("nodes").addEventListener("dblclick", (e) => { const n = e.target.closest(".node"); if (n) trends.set({ node: n.dataset.node }); });

// Tooltips are made when the pointer gets there (not 13,000 title attributes on a large cluster).
$("nodes").addEventListener("mouseover", (e) => {
  const b = e.target.closest(".block, .card");
  if (!b) { hideTip(); return; }
  const d = b.dataset;
  const text = b.classList.contains("card")
    ? `gpu${d.gpu}: ${gib(+d.reserved)} held of ${gib(+d.total)} (${((100 * d.reserved) / d.total).toFixed(1)}%); ${gib(+d.used)} HOT`
    : `${shortName(d.model)} #${d.replica}: ${d.level} / ${d.state}, ${gib(+d.bytes)}` +
      (d.total ? ` = ${((100 * d.bytes) / d.total).toFixed(2)}% of the card (${gib(+d.total)})` : " in the CPU cache");
  showTip(text, e.clientX, e.clientY);
});
$("nodes").addEventListener("mouseleave", hideTip);

connect().then(() => loadEvents(false)).catch((err) => { $("conn").textContent = "error: " + err.message; });

window.addEventListener("resize", () => fitLabels($("nodes"))); // a card's width follows the page's
