"""A link with delay and jitter between a host and the mesh bridge: this kernel has no ``sch_netem``,
so a relay in the switch namespace copies Ethernet frames between the host's veth and a port on the
bridge, each one held for ``delay`` plus a uniform draw in ``[-jitter, +jitter]``. A new draw comes
every ``every`` (0: for each frame), the same for both directions: a Wi-Fi link's round trips
wander with its radio's conditions, from one moment to the next.

    python -m harness.jitter HOST_PORT BRIDGE_PORT DELAY_MS JITTER_MS [EVERY_MS]

Frames in one direction leave in the order they came (a frame waits for the one before it, as on a
real link), so jitter never reorders TCP segments. The sockets carry the virtio-net header
(``PACKET_VNET_HDR``): veths hand over segmentation-offloaded frames larger than the MTU and
checksums left to the hardware, which the kernel finishes when the relay sends them on. Use
:meth:`harness.netns.Mesh.delay` rather than running this by hand.
"""

from __future__ import annotations

import heapq
import os
import random
import selectors
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263  # linux/socket.h; the socket module does not name it
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
FRAME = 1 << 18  # a segmentation-offloaded frame (up to the 64 KiB GSO limit and more under BIG TCP) and its header


def open_port(dev: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((dev, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def relay(
    host_port: str,
    bridge_port: str,
    delay_s: float,
    jitter_s: float = 0.0,
    every_s: float = 0.0,
    seed: int | None = None,
) -> None:
    rng = random.Random(seed)
    drawn = [0.0, delay_s]  # (when, the delay drawn then)

    def held() -> float:
        now = time.monotonic()
        if now - drawn[0] >= every_s:
            drawn[:] = [now, max(0.0, delay_s + rng.uniform(-jitter_s, jitter_s))]
        return drawn[1]

    ends = {host_port: open_port(host_port), bridge_port: open_port(bridge_port)}
    try:  # the delays are the link's, not the wait for a core on a busy machine
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except OSError:
        pass
    print("relaying", flush=True)
    other = {host_port: ends[bridge_port], bridge_port: ends[host_port]}
    sel = selectors.DefaultSelector()
    for dev, sock in ends.items():
        sel.register(sock, selectors.EVENT_READ, dev)
    queue: list[tuple[float, int, socket.socket, bytes]] = []  # (release, seq, out, frame)
    last = dict.fromkeys(ends, 0.0)  # each direction's latest release: FIFO
    seq = 0
    while True:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else None
        for key, _ in sel.select(timeout):
            dev, sock = key.data, key.fileobj
            while True:
                try:
                    frame, addr = sock.recvfrom(FRAME)  # type: ignore[union-attr]
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:  # the relay's own send, seen on the way out
                    continue
                release = max(last[dev], time.monotonic() + held())
                last[dev] = release
                heapq.heappush(queue, (release, seq, other[dev], frame))
                seq += 1
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            try:
                out.send(frame)
            except OSError:  # a full queue or a port going down: the frame is lost, as on a link
                pass


def main(argv: list[str]) -> None:
    host_port, bridge_port, delay_ms, jitter_ms, every_ms = [*argv, "0"][:5]
    relay(host_port, bridge_port, float(delay_ms) / 1e3, float(jitter_ms) / 1e3, float(every_ms) / 1e3)


if __name__ == "__main__":
    main(sys.argv[1:])
