"""A stage's refusals: the same kinds on both ends of a stream."""

from __future__ import annotations

import socket

import grpc
import pytest

from meshnode.proto import mesh_pb2
from meshnode.transport.dataport import recv_frame
from meshnode.transport.hop import read_reply, refuse
from meshnode.transport.refusals import (
    FAULT,
    KINDS,
    STATUS,
    InvalidInput,
    StageError,
    StageFault,
    StagePending,
    StageRefused,
    StageUnavailable,
    refusal_kind,
)


@pytest.mark.parametrize("kind", list(STATUS), ids=lambda k: k.__name__)
def test_a_refusal_s_status_reads_back_as_its_kind(kind):
    message = f"{FAULT}layers [0, 4) failed" if issubclass(kind, StageFault) and kind is not InvalidInput else "no"
    code = kind(message).code
    assert code == STATUS[kind] and KINDS[code] is kind
    assert refusal_kind(code, message) is kind


def test_the_table_gives_each_kind_its_own_status():
    assert len(set(STATUS.values())) == len(STATUS) == len(KINDS)
    # The statuses older peers send and read.
    assert STATUS[StagePending] == grpc.StatusCode.ABORTED
    assert STATUS[StageFault] == grpc.StatusCode.INTERNAL and FAULT == "stage fault: "
    assert STATUS[InvalidInput] == grpc.StatusCode.INVALID_ARGUMENT
    assert STATUS[StageRefused] == grpc.StatusCode.FAILED_PRECONDITION
    assert STATUS[StageUnavailable] == grpc.StatusCode.UNAVAILABLE


def test_statuses_outside_the_table_and_grpc_s_own_internal_are_a_lost_stage():
    assert refusal_kind(grpc.StatusCode.DEADLINE_EXCEEDED, "") is StageError
    assert refusal_kind(grpc.StatusCode.INTERNAL, "Internal error from Core") is StageError
    assert refusal_kind(None, None) is StageError


def test_a_refusal_frame_carries_the_status_and_details_the_head_maps_back():
    class St:  # what read_reply asks of a remote stage
        start, end, node_id, poll = 0, 4, "n1", 0.1

        def check(self, sent: float) -> None:
            pass

    a, b = socket.socketpair()
    with a, b:
        refuse(a, StagePending("epoch 7 is not served here yet (serving [6])"))
        reply = mesh_pb2.ForwardReply.FromString(bytes(recv_frame(b)))
        assert reply.code == grpc.StatusCode.ABORTED.value[0]
        assert reply.error == "epoch 7 is not served here yet (serving [6])"
        refuse(a, StagePending("epoch 7 is not served here yet (serving [6])"))
        with pytest.raises(StageError) as again:  # the head's own reading of the same frame
            read_reply(b, St(), 0.0)
    assert type(again.value) is StagePending
    assert str(again.value).endswith("ABORTED: epoch 7 is not served here yet (serving [6])")
