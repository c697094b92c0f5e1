"""PassPipe's bookkeeping (meshnode.serving.passes): passes in flight leave in order, and a cancel
cuts every stage back by what it was given, and stops cancelled passes where they are.

Pure logic: the stages here are in-process stand-ins that record what they are sent (the real
stages, local and over the data port and gRPC, run in tests/test_speculative.py and
tests/test_speculative_mesh.py)."""

from __future__ import annotations

import mlx.core as mx

from meshnode.serving.passes import PassPipe


class Ticket:
    def __init__(self, out):
        self.out = out

    def done(self):
        return True

    def check(self):
        pass

    def wait_handle(self):
        return None

    def result(self):
        return self.out


class Stage:
    """Passes its input on unchanged; logs what it is sent and cut by, in order."""

    def __init__(self, remote: bool):
        self.remote, self.log = remote, []

    def submit(self, x):
        self.log.append(("run", x.tolist()[0]))
        return Ticket(x)

    def forward(self, x, all_positions=False):
        self.log.append(("run", x.tolist()[0]))
        return x

    def rewind(self, n):
        self.log.append(("cut", n))


def test_a_cancel_cuts_each_stage_by_what_it_holds_and_cancelled_passes_go_no_further():
    first, middle, last = Stage(True), Stage(False), Stage(True)
    pipe = PassPipe([first, middle, last], held=10)
    pipe.send([1, 2])
    pipe.send([3])
    pipe.send([4, 5])
    assert first.log == [("run", [1, 2]), ("run", [3]), ("run", [4, 5])]  # a remote first stage gets each at once
    p, logits = pipe.result()
    assert (p.tokens, p.start, logits.tolist()) == ([1, 2], 10, [1, 2])
    assert len(pipe) == 2 and pipe.in_flight() == [3, 4, 5]
    # Here the last stage has been sent [3] but not [4, 5] (the head carries passes between stages).
    assert last.log == [("run", [1, 2]), ("run", [3])]
    pipe.cancel(11)  # the second position of [1, 2] was rejected
    assert len(pipe) == 0 and pipe.end == 11 and pipe.cut_pending
    assert first.log[-1] == ("cut", 4) and middle.log[-1] == ("cut", 4) and last.log[-1] == ("cut", 2)
    pipe.send([9])
    assert not pipe.cut_pending
    p, logits = pipe.result()
    assert (p.tokens, p.start, logits.tolist()) == ([9], 11, [9])
    assert last.log == [("run", [1, 2]), ("run", [3]), ("cut", 2), ("run", [9])]  # [4, 5] never reached it
    assert middle.log[-2:] == [("cut", 4), ("run", [9])]


def test_passes_leave_in_the_order_they_were_sent_and_only_a_lone_pass_is_timed():
    stages = [Stage(True), Stage(False)]
    pipe = PassPipe(stages, held=0)
    pipe.send([1])
    pipe.send([2, 3])
    got = [pipe.result() for _ in range(2)]
    assert [(p.tokens, p.start, p.alone) for p, _ in got] == [([1], 0, False), ([2, 3], 1, False)]
    pipe.send([4])
    p, out = pipe.result()
    assert (p.tokens, p.start, p.alone) == ([4], 3, True)
    assert isinstance(out, mx.array)


class Pending(Ticket):
    """A remote stage's reply that has not come yet (``ready``: it has)."""

    def __init__(self, out):
        super().__init__(out)
        self.ready = False

    def done(self):
        return self.ready


def test_a_pass_sent_while_a_cancelled_one_still_computes_at_a_remote_stage_is_not_timed():
    """After a rejection, the pass behind it is cancelled but its remote stage is still computing
    it; the next pass waits behind it there, so its time is not what its positions cost. Timed as
    alone, such passes would price a further position far above what it costs."""
    first, last = Stage(True), Stage(False)
    tickets: list[Pending] = []

    def submit(x):
        tickets.append(Pending(x))
        return tickets[-1]

    first.submit = submit
    pipe = PassPipe([first, last], held=0)
    pipe.send([1, 2])
    pipe.send([3])  # behind it
    tickets[0].ready = True
    p, _ = pipe.result()
    assert p.tokens == [1, 2] and not p.alone
    pipe.cancel(1)  # the guess 2 was wrong: [3] is cancelled while the first stage computes it
    pipe.send([7])
    assert not tickets[1].done()
    tickets[1].ready = tickets[2].ready = True
    p, _ = pipe.result()
    assert p.tokens == [7] and not p.alone
    pipe.send([8])  # nothing of this request's left in the stages now
    tickets[3].ready = True
    p, _ = pipe.result()
    assert p.tokens == [8] and p.alone
