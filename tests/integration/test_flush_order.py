"""`flush()` keeps its promise: what was sent before it is on the server when it returns.

nats-py 2.16 writes the flush's PING to the socket ahead of the commands still in its buffer, so a
SUB made just before can reach the server after the PONG came back: the subscription then misses
what another connection publishes at once. The client of `connect()`
(controlplane/store/eventstore/connection.py) writes them first. Checked on the wire, in the order
the bytes are handed to the socket, against a real nats-server.
"""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client

from controlplane.ops.nats_server import EmbeddedNats
from controlplane.store.eventstore import connect


async def _wire_after_subscribe_and_flush(nc: Any) -> bytes:
    """The bytes handed to the socket by `subscribe(); flush()`, in order."""
    wire: list[bytes] = []
    transport = nc._transport
    write, writelines = transport.write, transport.writelines

    def spy_write(data: bytes) -> None:
        wire.append(bytes(data))
        write(data)

    def spy_writelines(lines: list[bytes]) -> None:
        wire.extend(bytes(x) for x in lines)
        writelines(lines)

    transport.write, transport.writelines = spy_write, spy_writelines
    try:
        await nc.subscribe("flush.order.x")
        await nc.flush()
    finally:
        transport.write, transport.writelines = write, writelines
    return b"".join(wire)


async def test_a_subscription_reaches_the_server_before_the_flush_ping(nats_server: EmbeddedNats) -> None:
    nc = await connect(nats_server.url)
    try:
        wire = await _wire_after_subscribe_and_flush(nc)
        assert wire.index(b"SUB flush.order.x") < wire.index(b"PING\r\n"), wire
    finally:
        await nc.close()


async def test_the_upstream_client_sends_its_ping_first(nats_server: EmbeddedNats) -> None:
    """Why the override is there. When a nats-py release orders its PING after its buffer this
    fails: then drop `NdifNatsClient._send_ping` and this test."""
    nc = Client()
    await nc.connect(nats_server.url)
    try:
        wire = await _wire_after_subscribe_and_flush(nc)
        assert wire.index(b"PING\r\n") < wire.index(b"SUB flush.order.x"), wire
    finally:
        await nc.close()
