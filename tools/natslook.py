"""Read the NDIF streams and buckets with nats-py, as the `nats` CLI would (used for docs/nats-cli.md).

The `nats` CLI (natscli) was not installable on the machine the docs were written on; this does the
same reads through nats-py and prints what each read returned, in a layout of its own:

    python tools/natslook.py --nats URL view [--stream S] [--subject F] [--count N] [--start-seq S]
    python tools/natslook.py --nats URL subjects [--stream S] [--filter F]
    python tools/natslook.py --nats URL sub SUBJECT [--count N] [--seconds S]
    python tools/natslook.py --nats URL kv-watch BUCKET [--key K] [--count N] [--seconds S]

`view` = `nats stream view NDIF_EVENTS [--subject F]` (stored messages by sequence; `--stream
NDIF_FACTS`: the agents' facts as they sent them; `--stream NDIF_REFUSED`: those the gate refused), `subjects` = `nats stream subjects
NDIF_EVENTS [F]`, `sub` = `nats sub SUBJECT` (live messages only),
`kv-watch` = `nats kv watch BUCKET [KEY]` (the latest value of each key, then updates).

Credentials: `--creds FILE` (a `$NDIF_HOME/auth/<user>.creds` file that `ndif up` wrote; default
`NDIF_CREDS`, else the admin's file of `$NDIF_HOME/auth/` for a loopback URL), or `--user` and
`--password`; none against `ndif up --open`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats
from nats.aio.client import Client as NatsClient
from nats.js import api
from nats.js.kv import KeyValue

from controlplane.store.credentials import load_creds, resolve
from schemas.subjects import EVENTS_STREAM, FACTS_STREAM, REFUSED_STREAM


def show(seq: int | None, subject: str, headers: dict[str, str] | None, data: bytes) -> None:
    print(f"[{seq}] subject: {subject}" if seq is not None else f"subject: {subject}")
    for k, v in (headers or {}).items():
        print(f"  {k}: {v}")
    print(f"  {data.decode(errors='replace')}\n", flush=True)


async def view(js: nats.js.JetStreamContext, stream: str, subject: str, count: int, start: int) -> None:
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True,
                             config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                                       opt_start_seq=start))
    try:
        for _ in range(count):
            try:
                msg = await sub.next_msg(timeout=2)
            except nats.errors.TimeoutError:
                break
            show(msg.metadata.sequence.stream, msg.subject, msg.headers, msg.data)
    finally:
        await sub.unsubscribe()


async def subjects(js: nats.js.JetStreamContext, stream: str, flt: str) -> None:
    info = await js.stream_info(stream, subjects_filter=flt)
    for subject, n in sorted((info.state.subjects or {}).items()):
        print(f"{n:>6}  {subject}")


async def live(nc: NatsClient, subject: str, count: int, seconds: float) -> None:
    sub = await nc.subscribe(subject)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    try:
        for _ in range(count):
            try:
                msg = await sub.next_msg(timeout=max(0.01, end - loop.time()))
            except nats.errors.TimeoutError:
                break
            show(None, msg.subject, msg.headers, msg.data)
    finally:
        await sub.unsubscribe()


async def kv_watch(js: nats.js.JetStreamContext, bucket: str, key: str, count: int, seconds: float) -> None:
    kv = await js.key_value(bucket)
    w = await kv.watch(key)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    try:
        n = 0
        while n < count and loop.time() < end:
            try:
                e: KeyValue.Entry | None = await w.updates(timeout=max(0.01, end - loop.time()))
            except nats.errors.TimeoutError:
                break
            if e is None:  # the end of the initial values
                print("(initial values done; updates follow)", flush=True)
                continue
            print(f"[rev {e.revision}] {e.operation or 'PUT'} {bucket} > {e.key}: "
                  f"{(e.value or b'').decode(errors='replace')}", flush=True)
            n += 1
    finally:
        await w.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nats", default=os.environ.get("NDIF_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL")
    ap.add_argument("--creds", default=None, help="credentials file (default: NDIF_CREDS, else the local admin's)")
    ap.add_argument("--user", default=None, help="NATS user (with --password)")
    ap.add_argument("--password", default=None, help="NATS password")
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("view", help="stored events by sequence")
    p.add_argument("--stream", default=EVENTS_STREAM, help=f"stream (default {EVENTS_STREAM}; or {FACTS_STREAM}, {REFUSED_STREAM})")
    p.add_argument("--subject", default=">", help="subject filter (default: the stream's every subject)")
    p.add_argument("--count", type=int, default=10, help="messages to print")
    p.add_argument("--start-seq", type=int, default=1, help="first sequence")
    p = sub.add_parser("subjects", help="stored subjects and their message counts")
    p.add_argument("--stream", default=EVENTS_STREAM, help=f"stream (default {EVENTS_STREAM}; or {FACTS_STREAM})")
    p.add_argument("--filter", default=">", help="subject filter (default: the stream's every subject)")
    for name in ("sub", "kv-watch"):
        p = sub.add_parser(name, help="live messages" if name == "sub" else "a bucket's values and updates")
        p.add_argument("target", help="subject filter" if name == "sub" else "bucket")
        p.add_argument("--count", type=int, default=10, help="messages to print")
        p.add_argument("--seconds", type=float, default=10.0, help="stop after this long")
        if name == "kv-watch":
            p.add_argument("--key", default=">", help="key filter (default: every key)")
    a = ap.parse_args()
    if a.user:
        opts = {"user": a.user, "password": a.password or "", "inbox_prefix": f"_INBOX_{a.user}"}
    else:
        creds = load_creds(Path(a.creds)) if a.creds else resolve("admin", url=a.nats)
        opts = creds.connect_options() if creds else {}
    nc = await nats.connect(a.nats, **opts)
    js = nc.jetstream()
    try:
        if a.what == "view":
            await view(js, a.stream, a.subject, a.count, a.start_seq)
        elif a.what == "subjects":
            await subjects(js, a.stream, a.filter)
        elif a.what == "sub":
            await live(nc, a.target, a.count, a.seconds)
        else:
            await kv_watch(js, a.target, a.key, a.count, a.seconds)
    finally:
        await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
