// Small helpers shared by the page's modules: escaping, sizes, times, JSON GETs.
// The page runs under a strict content security policy: no inline script or style, no eval. Sizes
// that depend on data (block widths) are set through the CSSOM (`el.style.width`), never in markup.

export const $ = (id) => document.getElementById(id);
// What a node or a request reports is shown as it is stored, never acted on: controls, format
// characters (direction marks, invisible ones) and line separators are written as their escapes.
// A tooltip's own line breaks and tabs stay.
const UNSAFE = /(?![\n\t])[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/gu;
export const shown = (s) => String(s ?? "").replace(UNSAFE, (c) => "\\u{" + c.codePointAt(0).toString(16) + "}");
export const esc = (s) => shown(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

// Bytes as GiB: 3 decimals below 1 GiB (tiny models stay readable), 1 below 100, none above.
export function gib(b) {
  if (b == null) return "-";
  const g = b / 2 ** 30;
  return (g < 1 ? g.toFixed(3) : g < 100 ? g.toFixed(1) : g.toFixed(0)) + " GiB";
}
export const gibNum = (b) => { const g = b / 2 ** 30; return g < 1 ? g.toFixed(3) : g < 100 ? g.toFixed(1) : g.toFixed(0); };

// An axis's tick labels, all with the decimals their step has (uPlot's steps include 2.5 and 0.25:
// never "3" for 2.5, nor "200.0" beside "0.000").
export function ticks(vals) {
  const step = vals.length > 1 ? Math.abs(vals[1] - vals[0]) : Math.abs(vals[0] || 1);
  const decimals = step > 0 ? (String(+step.toPrecision(6)).split(".")[1] || "").length : 0;
  if (decimals > 6) return vals.map((v) => (v == null ? "" : v.toExponential(2)));
  return vals.map((v) => (v == null ? "" : v.toFixed(decimals)));
}

// A full time, to the millisecond, in UTC: "2026-01-01 14:02:03.456Z".
export function fullTime(t) {
  if (t == null || t === "") return "";
  const d = typeof t === "number" ? new Date(t * 1000) : new Date(t);
  return isNaN(d) ? String(t) : d.toISOString().replace("T", " ");
}

export const FAILED_STATES = new Set(["Failed", "LoadFailed", "Lost"]);

export async function getJson(url) {
  const r = await fetch(url);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

// Width of every `[data-w]` element under `root`, in percent (the CSSOM: allowed by the policy).
export function applyWidths(root) {
  for (const el of root.querySelectorAll("[data-w]")) el.style.width = el.dataset.w + "%";
}

// The tooltip that follows the pointer (one element for the whole page).
export function showTip(text, x, y) {
  const tip = $("tip");
  tip.textContent = shown(text);
  tip.hidden = false;
  const w = tip.offsetWidth, h = tip.offsetHeight;
  tip.style.left = Math.max(4, Math.min(x + 12, window.innerWidth - w - 8)) + "px";
  tip.style.top = Math.max(4, y + 16 + h > window.innerHeight ? y - h - 8 : y + 16) + "px";
}
export function hideTip() { $("tip").hidden = true; }
