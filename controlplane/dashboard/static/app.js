// The ndif dashboard page: no build step, no framework. It loads /api/state, then applies the
// server's pushed updates (server-sent events) to its copy; what changed is redrawn once per
// animation frame, so a burst of events costs one redraw. The timeline asks /api/state?until=.
// Read-only: nothing here sends anything but GETs. No inline style or script (the server's
// Content-Security-Policy refuses them): widths are set through the CSSOM after each parse.

// The printed URL carries the operator token; the server has put it in a cookie, so the address
// bar (and the history) keep the clean URL.
if (location.search) history.replaceState(null, "", location.pathname);

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const gib = (b) => (b == null ? "-" : (b / 2 ** 30).toFixed(b >= 2 ** 30 ? 1 : 3) + " GiB");

// What tests and tools/bench/dashboard.py read: the seq on screen and when each frame was drawn.
const probe = (window.ndif = { renderedSeq: -1, renders: [], received: [], ready: false, mode: "live", t: {} });

const live = { seq: 0, last_seq: 0, nodes: new Map(), models: new Map(), anomaly_count: 0 };
let past = null; // the state shown while the timeline is away from live
let queues = { models: {} };
const dirty = { nodes: new Set(), models: new Set(), all: true, events: [] };
let frame = 0;

function loadState(target, body) {
  target.seq = body.seq; target.last_seq = body.last_seq; target.anomaly_count = body.anomaly_count;
  target.nodes = new Map(body.nodes.map((n) => [n.node_id, n]));
  target.models = new Map(body.models.map((m) => [m.model_key, m]));
  return target;
}

function schedule() { if (!frame) frame = requestAnimationFrame(render); }

// Widths (percent) parsed from data-w into the style, which the CSP allows only through the CSSOM.
function widths(root) {
  for (const el of root.querySelectorAll("[data-w]")) el.style.width = el.dataset.w + "%";
}

// ---- drawing ----------------------------------------------------------------------------------

function blockHtml(b, total) {
  const w = Math.max(0.5, (100 * b.bytes) / total);
  return `<div class="block ${esc(b.level)} ${esc(b.state)}" data-w="${w}" data-model="${esc(b.model_key)}"
    data-replica="${b.replica_id}" data-level="${b.level}" data-state="${b.state}" data-bytes="${b.bytes}">${
    esc(label(b.name))}#${b.replica_id}</div>`;
}

const label = (name) => name.split("/").pop();

function nodeHtml(n) {
  const cards = n.gpus.map((c) => `<div class="card" data-gpu="${c.index}" data-reserved="${c.reserved_bytes}" data-total="${c.total_bytes}">${
    c.replicas.map((b) => blockHtml(b, c.total_bytes)).join("")}</div>`).join("");
  const pct = n.cpu_cache_bytes ? Math.min(100, (100 * n.cpu_cached_bytes) / n.cpu_cache_bytes) : 0;
  const warm = n.warm.map((w) => `<span class="block WARM Cached" data-model="${esc(w.model_key)}" data-replica="${w.replica_id}"
    data-level="WARM" data-state="Cached" title="${esc(w.name)} #${w.replica_id}: WARM, ${gib(w.bytes)}">${w.replica_id}</span>`).join("");
  return `<div class="node${n.alive ? "" : " lost"}" id="node-${esc(n.node_id)}" data-node="${esc(n.node_id)}">
    <div class="name" title="${esc(n.hostname)}">${esc(n.node_id)}${n.alive ? "" : " (lost)"}</div>
    <div class="cards">${cards}</div>
    <div class="cpu">WARM ${gib(n.cpu_cached_bytes)} / ${gib(n.cpu_cache_bytes)} <span class="warm">${warm}</span>
      <div class="bar"><span data-w="${pct}"></span></div></div></div>`;
}

function modelRow(m) {
  const q = queues.models?.[m.model_key] || {};
  const states = Object.entries(m.by_state).map(([s, n]) => `<span class="st">${esc(s)} ${n}</span>`).join("");
  const wait = q.oldest_wait_s == null ? "-" : q.oldest_wait_s.toFixed(1) + " s";
  const queued = q.pending == null ? (q.queued ?? "-") : q.pending + (q.queued ? ` (+${q.queued} held)` : "");
  return `<tr data-model="${esc(m.model_key)}"><td title="${esc(m.model_key)}">${esc(m.name)}</td><td>${esc(m.status)}</td>
    <td>${m.replica_count}</td><td>${states}</td><td>${gib(m.charge_per_replica_bytes)}</td><td>${esc(queued)}</td>
    <td>${q.in_flight ?? "-"}</td><td>${q.completed ?? "-"}</td><td>${q.errors ?? "-"}</td><td>${wait}</td>
    <td>${q.serving_replicas ? esc(q.serving_replicas.join(",")) : "-"}</td></tr>`;
}

function eventRow(e) {
  if (e.type === "Skipped") return `<tr><td>${e.seq}</td><td></td><td>Skipped</td><td colspan="5">${esc(e.reason)}</td></tr>`;
  return `<tr data-seq="${e.seq}"><td>${e.seq}</td><td>${esc((e.ts || "").replace("T", " ").slice(0, 23))}</td>
    <td>${esc(e.type)}${e.drain ? ` (${esc(e.drain)})` : ""}</td><td title="${esc(e.model_key)}">${esc(shortName(e.model_key))}</td><td>${e.replica_id ?? ""}</td>
    <td>${esc(e.node_id ?? "")}</td><td>${esc(e.actor)}</td><td>${esc(e.command_id ?? "")}</td></tr>`;
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
  widths(scratch);
  const fresh = [...scratch.children];
  todo.forEach((id, i) => {
    const old = index.get(id);
    if (old) old.replaceWith(fresh[i]);
    else parent.appendChild(fresh[i]);
    index.set(id, fresh[i]);
  });
}

function render() {
  const t0 = performance.now();
  frame = 0;
  const view = past || live;
  $("seq").textContent = view.seq;
  $("lastseq").textContent = live.last_seq;
  const slider = $("slider");
  slider.max = live.last_seq;
  if (!past) slider.value = live.seq;
  if (dirty.all) {
    $("nodes").innerHTML = [...view.nodes.values()].map(nodeHtml).join("");
    widths($("nodes"));
    $("models").tBodies[0].innerHTML = [...view.models.values()].map(modelRow).join("");
    rows.nodes = new Map([...$("nodes").children].map((el) => [el.dataset.node, el]));
    rows.models = new Map([...$("models").tBodies[0].rows].map((el) => [el.dataset.model, el]));
  } else {
    redraw(dirty.nodes, view.nodes, rows.nodes, $("nodes"), nodeHtml);
    redraw(dirty.models, view.models, rows.models, $("models").tBodies[0], modelRow);
  }
  if (dirty.events.length) {
    const tb = $("events").tBodies[0];
    const rows = dirty.events.filter(matches).reverse();
    tb.insertAdjacentHTML("afterbegin", rows.map(eventRow).join(""));
    while (tb.rows.length > 300) tb.deleteRow(-1);
  }
  dirty.nodes.clear(); dirty.models.clear(); dirty.events = []; dirty.all = false;
  probe.renderedSeq = view.seq;
  probe.t.lastFrameMs = performance.now() - t0; // the script's part of the frame
  probe.mode = past ? "past" : "live";
  probe.renders.push([view.seq, Date.now()]);
  if (probe.renders.length > 20000) probe.renders.splice(0, 10000);
}

// ---- live stream ------------------------------------------------------------------------------

function applyUpdate(u) {
  probe.received.push([u.seq, Date.now()]);
  if (probe.received.length > 20000) probe.received.splice(0, 10000);
  const fresh = u.events.filter((e) => e.seq > live.seq); // an update may overlap the state the page loaded
  live.seq = u.seq; live.last_seq = u.last_seq; live.anomaly_count = u.anomaly_count;
  for (const n of u.nodes) { live.nodes.set(n.node_id, n); if (!past) dirty.nodes.add(n.node_id); }
  for (const m of u.models) { live.models.set(m.model_key, m); if (!past) dirty.models.add(m.model_key); }
  dirty.events.push(...fresh);
  schedule();
}

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
      if (JSON.stringify(q) !== JSON.stringify(old[mk])) dirty.models.add(mk);
    }
    schedule();
  });
  source.addEventListener("resync", () => connect());
  source.onopen = () => { $("conn").textContent = "live stream"; };
  source.onerror = () => { $("conn").textContent = "reconnecting"; };
  probe.ready = true;
}

async function getJson(url) {
  const r = await fetch(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

// ---- timeline ---------------------------------------------------------------------------------

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
      } catch (err) { $("f-error").textContent = err.message; }
      dirty.all = true; schedule();
    }
  } finally { fetching = false; }
}

function backToLive() {
  past = null;
  $("mode").textContent = "LIVE"; $("mode").className = "mode live"; $("live").disabled = true;
  dirty.all = true; schedule();
}

$("slider").addEventListener("input", (e) => goTo(e.target.value));
$("go").addEventListener("click", () => goTo($("seqbox").value.trim()));
$("seqbox").addEventListener("keydown", (e) => { if (e.key === "Enter") goTo($("seqbox").value.trim()); });
$("live").addEventListener("click", backToLive);

// ---- events tail and filters -------------------------------------------------------------------

const filters = {};
function matches(e) {
  if (filters.model && !(e.model_key === filters.model || shortName(e.model_key) === filters.model)) return false;
  if (filters.replica !== undefined && e.replica_id !== filters.replica) return false;
  if (filters.type && e.type !== filters.type) return false;
  if (filters.actor && !(e.actor || "").includes(filters.actor)) return false;
  return true;
}
let nextBefore = null;
async function loadEvents(more) {
  const p = new URLSearchParams({ limit: "100" });
  for (const k of ["model", "type", "actor"]) if (filters[k]) p.set(k, filters[k]);
  if (filters.replica !== undefined) p.set("replica", filters.replica);
  if (more && nextBefore) p.set("before", nextBefore);
  try {
    const body = await getJson(`/api/events?${p}`);
    const tb = $("events").tBodies[0];
    if (!more) tb.innerHTML = "";
    tb.insertAdjacentHTML("beforeend", body.events.map(eventRow).join(""));
    nextBefore = body.next_before;
    $("f-error").textContent = "";
  } catch (err) { $("f-error").textContent = err.message; }
}
$("f-apply").addEventListener("click", () => {
  for (const k of ["model", "type", "actor"]) filters[k] = $("f-" + k).value.trim() || undefined;
  const r = $("f-replica").value.trim();
  filters.replica = r === "" ? undefined : Number(r);
  loadEvents(false);
});
$("f-more").addEventListener("click", () => loadEvents(true));

// ---- replica drill-down ------------------------------------------------------------------------

// One page of history covers a stretch of the log (the newest first); "older steps" pages back.
let drill = null;
async function openHistory(model, replica, before) {
  const p = new URLSearchParams({ model, replica: String(replica) });
  if (before) p.set("before", before);
  try {
    const h = await getJson(`/api/history?${p}`);
    const rows = h.steps.map((s) => `<tr><td>${s.seq}</td>
      <td>${esc((s.ts || "").replace("T", " ").slice(0, 23))}</td><td>${esc(s.type)}</td><td>${esc(s.actor)}</td>
      <td>${esc(s.command_id ?? "")}</td><td>${esc(s.state ?? "")}</td><td>${esc(s.level ?? "")}</td>
      <td>${esc(s.desired ?? "")}${s.anomaly ? ` <span class="error">${esc(s.anomaly)}</span>` : ""}</td></tr>`).join("");
    const tb = $("history").tBodies[0];
    if (before) tb.insertAdjacentHTML("afterbegin", rows); else tb.innerHTML = rows;
    drill = { model, replica, before: h.next_before };
    $("drill-title").textContent = `${h.name} replica ${h.replica_id}: ${tb.rows.length} steps` +
      (h.next_before ? ` since seq ${h.next_before}` : "");
    $("drill-older").hidden = !h.next_before;
    $("drill").hidden = false;
  } catch (err) { $("f-error").textContent = err.message; }
}
$("drill-older").addEventListener("click", () => { if (drill) openHistory(drill.model, drill.replica, drill.before); });
$("nodes").addEventListener("click", (e) => {
  const b = e.target.closest(".block");
  if (b) openHistory(b.dataset.model, b.dataset.replica);
});
$("drill-close").addEventListener("click", () => { $("drill").hidden = true; });
// Tooltips are made when the pointer gets there (not 13,000 title attributes on a large cluster).
$("nodes").addEventListener("mouseover", (e) => {
  const b = e.target.closest(".block, .card");
  if (!b || b.title) return;
  const d = b.dataset;
  b.title = b.classList.contains("card") ? `gpu${d.gpu}: ${gib(+d.reserved)} of ${gib(+d.total)} reserved`
    : `${shortName(d.model)} #${d.replica}: ${d.level} / ${d.state}, ${gib(+d.bytes)}`;
});

connect().then(() => loadEvents(false)).catch((err) => { $("conn").textContent = "error: " + err.message; });
