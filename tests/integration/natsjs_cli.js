// docs/nats-cli.md's `nats` commands, done by nats.js (an independent NATS client) from the context
// files `ndif up` writes, read as the `nats` CLI reads them: url, user, password, inbox_prefix and
// jetstream_api_prefix where the context names one. Run by tests/integration/test_nats_cli_independent.py:
//   node natsjs_cli.js NATSJS_DIR STEPS_JSON
// STEPS_JSON is a list of {ctx: path, op, ...}; every step's outcome is printed as one JSON list on
// stdout, each {ok: true, ...} or {ok: false, error}. "READY" goes to stderr once every `sub` is in place.
"use strict";
const fs = require("fs");
const path = require("path");
const nats = require(path.join(process.argv[2], "node_modules", "nats"));

const jc = nats.JSONCodec();
const sc = nats.StringCodec();

async function connect(ctxPath) {
  const ctx = JSON.parse(fs.readFileSync(ctxPath, "utf8"));
  const opts = { servers: ctx.url, name: "natsjs-cli-check", reconnect: false, timeout: 5000 };
  if (ctx.user) { opts.user = ctx.user; opts.pass = ctx.password; }
  if (ctx.inbox_prefix) opts.inboxPrefix = ctx.inbox_prefix;
  const nc = await nats.connect(opts);
  // checkAPI off: asking `$JS.API.INFO` (account info) first is nats.js's habit, not the commands'
  const jsOpts = { timeout: 5000, checkAPI: false };
  if (ctx.jetstream_api_prefix) jsOpts.apiPrefix = ctx.jetstream_api_prefix;
  return { nc, jsOpts };
}

function message(m) {
  const headers = {};
  if (m.headers) for (const [k, v] of m.headers) headers[k] = v.join(",");
  let body;
  try { body = jc.decode(m.data); } catch { body = sc.decode(m.data); }
  return { seq: m.seq ?? (m.info ? m.info.streamSequence : undefined), subject: m.subject, headers, body };
}

const ops = {
  // `nats stream view STREAM [--subject S]`: an ordered consumer from the first message
  async view({ nc, jsOpts }, step) {
    const js = nc.jetstream(jsOpts);
    const c = await js.consumers.get(step.stream, { filterSubjects: [step.subject || ">"] });
    const out = [];
    while (out.length < step.count) {
      const m = await c.next({ expires: 2000 });
      if (m === null) break;
      out.push(message(m));
    }
    return { messages: out };
  },
  // `nats stream subjects STREAM FILTER`
  async subjects({ nc, jsOpts }, step) {
    const jsm = await nc.jetstreamManager(jsOpts);
    const info = await jsm.streams.info(step.stream, { subjects_filter: step.filter });
    return { subjects: info.state.subjects || {} };
  },
  // `nats kv get BUCKET KEY` (bound without reading the bucket's stream info, which a client may not)
  async kv_get({ nc, jsOpts }, step) {
    const js = nc.jetstream(jsOpts);
    const kv = await js.views.kv(step.bucket, { bindOnly: true, allow_direct: true });
    const e = await kv.get(step.key);
    return e === null ? { entry: null } : { entry: { key: e.key, revision: e.revision, value: jc.decode(e.value) } };
  },
  // `nats stream get STREAM SEQ` through the direct get API
  async direct_get({ nc, jsOpts }, step) {
    const jsm = await nc.jetstreamManager(jsOpts);
    const m = await jsm.direct.getMessage(step.stream, { seq: step.seq });
    return { message: { seq: m.seq, subject: m.subject, headers: message(m).headers, body: jc.decode(m.data) } };
  },
  // `nats sub SUBJECT`: core messages until `count` arrived, one with status `until`, or `seconds` passed
  async sub({ nc }, step, ready) {
    const sub = nc.subscribe(step.subject);
    const out = [];
    const done = (async () => { for await (const m of sub) {
      out.push(message(m));
      if (out.length >= step.count || (step.until && out[out.length - 1].body.status === step.until)) break;
    } })();
    // A refused subscription's iterator can end (the server's -ERR) before flush's PONG is read:
    // marked handled now, or node ends the process on an unhandled rejection; awaited below.
    done.catch(() => {});
    await nc.flush();
    ready();
    const timer = new Promise((r) => setTimeout(r, step.seconds * 1000));
    await Promise.race([done, timer]);
    if (!sub.isClosed()) sub.unsubscribe();
    await done;  // a refused subscription ends its iterator with the server's error
    return { messages: out };
  },
};

async function run(step, ready) {
  let conn;
  try {
    conn = await connect(step.ctx);
    // the server's refusals arrive as asynchronous errors: count them so a silent refusal is seen
    const errors = [];
    (async () => { for await (const s of conn.nc.status()) if (s.type === "error") errors.push(String(s.data)); })();
    const got = await ops[step.op](conn, step, ready);
    await conn.nc.flush();
    if (errors.length) return { ok: false, error: errors.join("; "), ...got };
    return { ok: true, ...got };
  } catch (e) {
    ready();
    return { ok: false, error: `${e.code || ""} ${e.message}`.trim() };
  } finally {
    if (conn) await conn.nc.close();
  }
}

(async () => {
  const steps = JSON.parse(process.argv[3]);
  const subs = steps.filter((s) => s.op === "sub").length;
  let waiting = subs;
  const ready = () => { if (waiting > 0 && --waiting === 0) process.stderr.write("READY\n"); };
  if (!subs) process.stderr.write("READY\n");
  const once = () => { let called = false; return () => { if (!called) { called = true; ready(); } }; };
  const results = await Promise.all(steps.map((s) => run(s, s.op === "sub" ? once() : () => {})));
  process.stdout.write(JSON.stringify(results) + "\n");
})().catch((e) => { process.stderr.write(String(e.stack || e) + "\n"); process.exit(1); });
