"""Keeping a request's prefix at a remote stage (the prompt cache) waits on the network only, so
the node's MLX baton goes to others meanwhile.

With two models whose heads are on different nodes, each with a first stage on the other (as in
tests/test_models_mesh.py), a head that kept its finished request's prefix holding its node's baton
would deadlock the two: each stage, to serve the other head's stream, would wait for that baton,
neither keep's answer would come, and the next chats would hang. Here the stage side takes the
keeper's own baton before it answers, which it gets at once: the keep waits without it."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest

from meshnode.model.scheduler import Baton
from meshnode.transport import hop
from meshnode.transport.dataport import recv_frame, send_frame

pytestmark = pytest.mark.timeout(60)


def test_keeping_a_prefix_at_a_remote_stage_lets_go_of_the_baton_while_it_waits(monkeypatch):
    head_end, stage_end = socket.socketpair()
    monkeypatch.setattr(hop, "connect", lambda *args, **kwargs: head_end)  # the stream, already open
    stage = SimpleNamespace(
        epoch=1, start=0, end=2, model="m", node_id="peer", hop_timeout=5.0, poll=0.05, check=lambda sent: None
    )
    session = hop.HopSession(stage, "request-1", "peer", 0, auth=None, node_id="me")
    baton = Baton()
    taken, in_time = threading.Event(), []

    def stage_side():
        assert recv_frame(stage_end) is not None  # the keep

        def take():
            baton.acquire()
            taken.set()
            baton.release()

        threading.Thread(target=take, daemon=True).start()
        in_time.append(taken.wait(5))  # serving it needs the baton the keeper held
        send_frame(stage_end, hop.KEPT_FRAME)

    server = threading.Thread(target=stage_side, daemon=True)
    server.start()
    try:
        baton.acquire()  # as a generation's thread: it holds the baton between its waits
        try:
            session.keep("prefix", 10)
        finally:
            baton.release()
        server.join(10)
        assert in_time == [True]
    finally:
        session.close()
        stage_end.close()
