// Plots over time (uPlot, vendored: static/uPlot.iife.min.js) and the replica lifelines (SVG).
// Every figure is asked for at the timeline's position: live, the window ends now and the plots
// are asked again every few seconds; at a past seq, the window ends at that seq's time. Figures
// from the log are exact; queue figures are what this dashboard sampled (marked "sampled").

import { $, esc, fullTime, getJson, gibNum, hideTip, showTip, ticks } from "./util.js";

const COLORS = { HOT: "#d9480f", WARM: "#f59f00", COLD: "#4dabf7", loading: "#868e96", draining: "#343a40", failed: "#c92a2a" };
const CARD_COLORS = ["#1c7ed6", "#e8590c", "#2f9e44", "#ae3ec9", "#f08c00", "#0c8599", "#c2255c", "#5c940d"];
const REFRESH_MS = 2000;
const HEIGHT = 150;

function stepped() { return window.uPlot.paths.stepped({ align: 1 }); }

// The spans the cluster was off (the answer's `outages`, [from, to] in s), drawn over a plot as a
// grey band that says so: the figures the log holds through them are its last state, not what ran.
function drawOutages(u) {
  const spans = u.outages || [];
  if (!spans.length) return;
  const { ctx, bbox } = u;
  ctx.save();
  for (const [a, b] of spans) {
    const x0 = u.valToPos(a, "x", true), x1 = u.valToPos(b, "x", true);
    const left = Math.max(bbox.left, x0), w = Math.min(bbox.left + bbox.width, x1) - left;
    if (w <= 0) continue;
    ctx.fillStyle = "rgba(134, 142, 150, 0.35)";
    ctx.fillRect(left, bbox.top, Math.max(w, 2), bbox.height);
    if (w > 60 * devicePixelRatio) {
      ctx.fillStyle = "#495057"; ctx.font = `${11 * devicePixelRatio}px sans-serif`; ctx.textAlign = "center";
      ctx.fillText("cluster down", left + w / 2, bbox.top + 14 * devicePixelRatio);
    }
  }
  ctx.restore();
}

// A plot with no point in its window says so, instead of an empty frame.
function drawNoData(u) {
  const any = u.data.slice(1).some((col) => col.some((v) => v != null));
  if (any) return;
  const { ctx, bbox } = u;
  ctx.save();
  ctx.fillStyle = "#868e96"; ctx.font = `${12 * devicePixelRatio}px sans-serif`; ctx.textAlign = "center";
  ctx.fillText("no data in this window", bbox.left + bbox.width / 2, bbox.top + bbox.height / 2);
  ctx.restore();
}

// Time ticks in UTC, 24-hour, each with room to be read.
// Each plot keeps the labels it drew last (`u.drawn`), which the browser tests read.
const timeTicks = (u, vals) => ((u.drawn = u.drawn || {}).x = vals.map((v) => fullTime(v).slice(11, 19)));
const valueTicks = (u, vals) => ((u.drawn = u.drawn || {}).y = ticks(vals));

// Steps for an axis of counts (replicas, requests): whole numbers only, never "0.5 replicas".
const COUNT_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];

function makePlot(el, series, { yLabel, stepped: isStep = false, dots = false, counts = false } = {}) {
  const opts = {
    width: Math.max(200, el.clientWidth), height: HEIGHT,
    hooks: { draw: [drawOutages, drawNoData] },
    legend: { live: true },
    cursor: { drag: { x: false, y: false } },
    scales: { x: { time: true } },
    tzDate: (ts) => window.uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"), // the page's times are UTC
    axes: [{ space: 90, values: timeTicks }, { label: yLabel, size: 50, values: valueTicks, ...(counts ? { incrs: COUNT_INCRS } : {}) }],
    series: [{ value: (u, v) => (v == null ? "-" : fullTime(v)) },
      ...series.map((s) => ({ label: s.label, stroke: s.color, width: 1.5, spanGaps: false,
        paths: isStep ? stepped() : undefined, points: { show: dots, size: 5 } }))],
  };
  return new window.uPlot(opts, [[], ...series.map(() => [])], el);
}

export class Trends {
  constructor(probe) {
    this.probe = probe;
    probe.plots = { rev: 0, model: null, node: null, t1: null, queue: null, replicas: null, cards: null };
    // For the browser tests: the colour a plot's canvas has at time `t`, a fraction `yFrac` down its plot area.
    probe.plotTicks = (name) => {
      const u = this.charts[name];
      return u && u.drawn ? { x: u.drawn.x, y: u.drawn.y, width: u.bbox.width / devicePixelRatio } : null;
    };
    // For the browser tests: each series' value drawn at time `t` (the step that holds then; null: a gap).
    probe.plotValues = (name, t) => {
      const u = this.charts[name];
      if (!u) return null;
      let i = -1;
      u.data[0].forEach((x, j) => { if (x <= t) i = j; });
      return i < 0 ? null : u.data.slice(1).map((col) => col[i]);
    };
    probe.plotPixel = (name, t, yFrac) => {
      const u = this.charts[name];
      if (!u) return null;
      const x = Math.round(u.valToPos(t, "x", true)), y = Math.round(u.bbox.top + u.bbox.height * yFrac);
      return [...u.ctx.getImageData(x, y, 1, 1).data];
    };
    this.model = null; this.node = null; this.window = "900"; this.until = null;
    this.charts = {};
    this.busy = false; this.again = false;
    this.timer = setInterval(() => { if (this.until === null && !document.hidden) this.refresh(); }, REFRESH_MS);
    window.addEventListener("resize", () => this.resize());
  }

  ensureCharts() {
    if (this.charts.queue || !window.uPlot) return !!this.charts.queue;
    this.charts.queue = makePlot($("plot-queue"), [{ label: "waiting", color: "#1c7ed6" }, { label: "running", color: "#2f9e44" }], { stepped: true, counts: true });
    this.charts.rate = makePlot($("plot-rate"), [{ label: "completed/s", color: "#2f9e44" }, { label: "errors/s", color: "#c92a2a" }]);
    this.charts.latency = makePlot($("plot-latency"), [{ label: "p50", color: "#1c7ed6" }, { label: "p99", color: "#ae3ec9" }],
      { dots: true }); // a slice alone between gaps still shows
    this.charts.replicas = makePlot($("plot-replicas"), Object.keys(COLORS).map((p) => ({ label: p, color: COLORS[p] })), { stepped: true, counts: true });
    return true;
  }

  resize() {
    for (const [k, c] of Object.entries(this.charts)) {
      const el = k === "node" ? $("plot-node") : $("plot-" + k);
      if (c && el) c.setSize({ width: Math.max(200, el.clientWidth), height: HEIGHT });
    }
  }

  set(changes) { Object.assign(this, changes); this.refresh(); }

  async refresh() {
    if (this.busy) { this.again = true; return; }
    this.busy = true;
    try {
      do { this.again = false; await this.load(); } while (this.again);
    } finally { this.busy = false; }
  }

  async load() {
    if (!this.ensureCharts()) return;
    const p = new URLSearchParams({ window: this.window, points: "300" });
    if (this.until !== null) p.set("until", this.until);
    const jobs = [];
    this.keptFrom = null;  // the latest time a plot was clamped to (the dashboard keeps the newest changes only)
    if (this.model) jobs.push(getJson(`/api/series?${p}&model=${encodeURIComponent(this.model)}`).then((b) => this.drawModel(b)));
    if (this.node) jobs.push(getJson(`/api/series?${p}&node=${encodeURIComponent(this.node)}`).then((b) => this.drawNode(b)));
    try {
      await Promise.all(jobs);
      $("plots-note").textContent = this.keptFrom == null ? ""
        : `replicas and memory from ${fullTime(this.keptFrom)} on: older changes are not kept (docs/dashboard.md)`;
    } catch (err) { $("plots-note").textContent = err.message; }
  }

  drawModel(b) {
    const q = b.queue, r = b.replicas;
    const scale = { min: b.t0, max: b.t1 };
    this.charts.queue.setData([q.t, q.waiting, q.running]);
    this.charts.rate.setData([q.t, q.completed_per_s, q.errors_per_s]);
    this.charts.latency.setData([q.t, q.p50_s, q.p99_s]);
    this.charts.replicas.setData([r.t, ...Object.keys(COLORS).map((k) => r[k])]);
    this.clamped(r.kept_from);
    for (const c of [this.charts.queue, this.charts.rate, this.charts.latency, this.charts.replicas]) {
      c.outages = b.outages; c.setScale("x", scale);
    }
    const since = q.sampled_since;
    for (const el of document.querySelectorAll("#plots .sampled-mark")) {
      el.textContent = since == null ? "sampled: no sample yet" : `sampled by this dashboard since ${fullTime(since)} (not in the log)`;
    }
    const pr = this.probe.plots;
    pr.rev += 1; pr.model = b.model_key; pr.t1 = b.t1; pr.live = b.live; pr.outages = b.outages;
    pr.queue = { t: q.t.slice(-60), completed_per_s: q.completed_per_s.slice(-60), waiting: q.waiting.slice(-60), p50_s: q.p50_s.slice(-60) };
    pr.replicas = Object.fromEntries(Object.keys(COLORS).map((k) => [k, r[k].at(-1)]));
  }

  clamped(t) {
    if (t != null && (this.keptFrom == null || t > this.keptFrom)) this.keptFrom = t;
  }

  drawNode(b) {
    const cards = b.node.cards;
    const key = cards.map((c) => c.index).join(",");
    if (this.nodeKey !== key || !this.charts.node) {
      if (this.charts.node) this.charts.node.destroy();
      $("plot-node").textContent = "";
      this.charts.node = makePlot($("plot-node"), cards.map((c, i) => ({ label: `gpu${c.index} (of ${gibNum(c.total_bytes)} GiB)`,
        color: CARD_COLORS[i % CARD_COLORS.length] })), { stepped: true });
      this.nodeKey = key;
    }
    // Each card has its own change times: put them on one time axis (the value holds between changes).
    const times = [...new Set(cards.flatMap((c) => c.t))].sort((a, b2) => a - b2);
    const cols = cards.map((c) => {
      let j = 0;
      return times.map((t) => { while (j + 1 < c.t.length && c.t[j + 1] <= t) j++; return c.committed[j] == null ? null : c.committed[j] / 2 ** 30; });
    });
    this.charts.node.setData([times, ...cols]);
    for (const c of cards) this.clamped(c.kept_from);
    this.charts.node.outages = b.outages;
    this.charts.node.setScale("x", { min: b.t0, max: b.t1 });
    const pr = this.probe.plots;
    pr.node = b.node.node_id; pr.cards = cards.map((c) => c.committed.at(-1));
  }
}

// ---- lifelines -----------------------------------------------------------------------------------

const ROW = 16, LABEL = 190, AXIS = 18;

export class Lifelines {
  constructor(probe) {
    this.probe = probe;
    probe.lifeline = { rev: 0, replicas: [] };
    this.data = null;
    const el = $("lifeline");
    el.addEventListener("mousemove", (e) => this.hover(e));
    el.addEventListener("mouseleave", hideTip);
    el.addEventListener("click", (e) => {
      const g = e.target.closest("[data-line]");
      if (g && this.onPick) { const l = this.data.replicas[+g.dataset.line]; this.onPick(l.model_key, l.replica_id); }
    });
  }

  async load({ model, window: win, until }) {
    const p = new URLSearchParams({ window: win });
    if (model) p.set("model", model);
    if (until !== null) p.set("until", until);
    try {
      this.data = await getJson(`/api/lifeline?${p}`);
      this.draw();
      $("lifeline-note").textContent = this.data.truncated ? `(the ${this.data.replicas.length} replicas that moved last; ${this.data.truncated} more)` : "";
    } catch (err) { $("lifeline-note").textContent = err.message; }
  }

  draw() {
    const d = this.data, el = $("lifeline");
    const width = Math.max(400, el.clientWidth), span = Math.max(1e-3, d.t1 - d.t0), plotW = width - LABEL - 8;
    const x = (t) => LABEL + ((t - d.t0) / span) * plotW;
    const ticks = [];
    for (let i = 0; i <= 4; i++) {
      const t = d.t0 + (span * i) / 4;
      ticks.push(`<text x="${x(t).toFixed(1)}" y="12" class="tick" text-anchor="${i === 0 ? "start" : i === 4 ? "end" : "middle"}">${esc(fullTime(t).slice(11, 19))}</text>`);
    }
    // an outage's caption gets a line of its own under the time labels, so the two never touch
    const axis = (d.outages || []).length ? AXIS + 12 : AXIS;
    const rows = d.replicas.map((l, i) => {
      const y = axis + i * ROW;
      let cursor = 0; // a segment too short to see is widened to 2 px, and the next starts after it
      const segs = l.segments.map((s, j) => {
        const x0 = Math.max(x(s.t0), cursor), w = Math.max(2, x(s.t1) - x0);
        cursor = x0 + w;
        return `<rect class="ph-${esc(s.phase)}${s.anomaly ? " anomaly" : ""}" x="${x0.toFixed(1)}" y="${y + 2}" width="${w.toFixed(1)}" height="${ROW - 4}" data-seg="${j}" data-phase="${esc(s.phase)}" data-state="${esc(s.state)}"></rect>`;
      }).join("");
      return `<g data-line="${i}" data-model="${esc(l.model_key)}" data-replica="${l.replica_id}"><text x="4" y="${y + ROW - 4}" class="lname">${esc(l.name.split("/").pop())} #${l.replica_id}</text>${segs}</g>`;
    }).join("");
    const h = axis + d.replicas.length * ROW + 4;
    const hatch = `<defs><pattern id="down-hatch" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">` +
      `<rect width="6" height="6" fill="#f1f3f5"></rect><rect width="3" height="6" fill="#adb5bd"></rect></pattern></defs>`;
    const bands = (d.outages || []).map(([a, b]) => `<text x="${((x(a) + x(b)) / 2).toFixed(1)}" y="${axis - 4}" class="tick down-label" text-anchor="middle">cluster down</text>`).join("");
    el.innerHTML = `<svg width="${width}" height="${h}" viewBox="0 0 ${width} ${h}">${hatch}${ticks.join("")}${bands}${rows}</svg>` +
      (d.replicas.length ? "" : `<p class="muted">no replica in this window</p>`);
    const pr = this.probe.lifeline;
    pr.rev += 1;
    pr.replicas = d.replicas.map((l) => ({ model_key: l.model_key, replica_id: l.replica_id, phases: l.segments.map((s) => s.phase) }));
    pr.outages = d.outages || [];
  }

  hover(e) {
    const r = e.target.closest("rect[data-seg]");
    if (!r) { hideTip(); return; }
    const l = this.data.replicas[+r.parentNode.dataset.line], s = l.segments[+r.dataset.seg];
    const secs = (s.t1 - s.t0).toFixed(s.t1 - s.t0 < 10 ? 2 : 0);
    if (s.phase === "down") {
      showTip(`cluster down: nothing of it heard from ${fullTime(s.t0)} to ${fullTime(s.t1)} (${secs} s)\n` +
        `${l.name} #${l.replica_id} was ${s.level} (desired ${s.desired}) in the log before it`, e.clientX, e.clientY);
      return;
    }
    const lines = [
      `${l.name} #${l.replica_id}: ${s.phase} (state ${s.state}, level ${s.level}, desired ${s.desired})`,
      `${fullTime(s.t0)} to ${fullTime(s.t1)} (${secs} s)`,
      `moved by seq ${s.seq} ${s.type} from ${s.actor}`,
    ];
    if (s.detail) lines.push(`  ${s.detail}`);
    const d = s.decision;
    if (d) {
      lines.push(`decision: seq ${d.seq} ${d.type} by ${d.actor} (${d.verb ? d.verb + ", " : ""}command ${d.command_id})`);
      if (d.detail && d.seq !== s.seq) lines.push(`  ${d.detail}`);
    }
    if (s.anomaly) lines.push(`anomaly: ${s.anomaly}`);
    showTip(lines.join("\n"), e.clientX, e.clientY);
  }
}
