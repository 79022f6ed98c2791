"""Reporter: seq/epoch, spool bound, newest first and backfill after an outage, 4xx handling."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from agent_helpers import TOKEN, Receiver, wait_until

from tierwatch.agent.netutil import free_port
from tierwatch.agent.protocol import Command, GpuSample, XidEvent, utcnow
from tierwatch.agent.reporter import Reporter, Spool


def _samples(temperature_c: float = 50.0) -> list[GpuSample]:
    return [GpuSample(index=i, ts=utcnow(), temperature_c=temperature_c) for i in range(2)]


def _reporter(url: str, spool: Path, token: str = TOKEN, **kw) -> Reporter:
    kw.setdefault("backoff_initial_s", 0.02)
    kw.setdefault("backoff_max_s", 0.1)
    return Reporter(
        node="node-a",
        server=url,
        token=token,
        spool_dir=spool,
        collector="simulated",
        simulated=True,
        interval_s=1.0,
        timeout_s=2.0,
        **kw,
    )


@pytest.fixture
def closing():
    """Collects reporters and closes them after the test."""
    reporters: list[Reporter] = []
    yield reporters.append
    for r in reporters:
        r.close(flush_timeout_s=0.2)


def test_seq_and_epoch(receiver, tmp_path, closing):
    rep = _reporter(receiver.url, tmp_path)
    closing(rep)
    rep.start()
    for _ in range(3):
        rep.report()
    wait_until(lambda: len(receiver.stored()) == 3, what="3 batches")
    batches = receiver.stored()
    assert sorted(b.seq for b in batches) == [1, 2, 3]  # (a backlog goes newest first)
    assert {b.epoch for b in batches} == {rep.epoch}
    assert len(rep.epoch) == 32
    assert all(b.simulated and b.node == "node-a" for b in batches)
    # the spool file of the last batch goes just after its ack is recorded: wait for both
    wait_until(
        lambda: (rep.status().last_acked_seq, rep.status().spool_depth) == (3, 0),
        what="ack and empty spool",
    )
    status = rep.status()
    assert (status.last_seq, status.last_sent_seq, status.spool_depth) == (3, 3, 0)
    rep.close(2.0)

    rep2 = _reporter(receiver.url, tmp_path)
    closing(rep2)
    assert rep2.epoch != rep.epoch
    rep2.start()
    rep2.report()
    wait_until(lambda: len(receiver.stored()) == 4, what="batch of the new epoch")
    assert (receiver.stored()[-1].epoch, receiver.stored()[-1].seq) == (rep2.epoch, 1)


def test_spool_files_sort_by_age_and_are_complete(tmp_path, closing):
    (tmp_path / ".tmp-0000000000000001.x.0000000001.json").write_text("{partial")
    rep = _reporter(f"http://127.0.0.1:{free_port()}", tmp_path)  # sender not started
    closing(rep)
    assert not list(tmp_path.glob(".tmp-*"))  # leftovers of a crash are removed
    for _ in range(12):
        rep.report()
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    seqs = [json.loads((tmp_path / n).read_text())["seq"] for n in names]
    assert seqs == list(range(1, 13))
    assert [i.seq for i in rep.spool.items()] == seqs


def test_full_spool_drops_oldest_and_counts(tmp_path, closing):
    port = free_port()
    rep = _reporter(f"http://127.0.0.1:{port}", tmp_path, spool_max_batches=3)
    closing(rep)
    for _ in range(5):
        rep.report()
    assert [i.seq for i in rep.spool.items()] == [3, 4, 5]
    assert rep.status().dropped_batches == 2
    rep.report()  # carries the count and the event
    receiver = Receiver(port=port)
    try:
        rep.start()
        wait_until(lambda: len(receiver.stored()) == 3, what="replay")
        batches = receiver.stored()
        assert [b.seq for b in batches] == [6, 4, 5]  # the newest first, then the backfill
        assert batches[0].dropped_batches == 3
        assert "spool_full" in [e.kind for e in batches[0].events]
    finally:
        rep.close(1.0)
        receiver.stop()


def test_outage_sends_the_newest_first_then_backfills_each_once(tmp_path, closing):
    port = free_port()
    rep = _reporter(f"http://127.0.0.1:{port}", tmp_path)
    closing(rep)
    rep.start()
    for i in range(5):
        rep.report(samples=_samples(50.0 + i))
    wait_until(lambda: rep.status().consecutive_failures >= 2, what="failed attempts")
    assert "cannot reach" in rep.status().last_error
    assert len(rep.spool) == 5
    receiver = Receiver(port=port)  # the server comes back
    try:
        wait_until(lambda: len(receiver.stored()) == 5, what="delivery after the outage")
        rep.report(samples=_samples())
        wait_until(lambda: len(receiver.stored()) == 6, what="new batch")
        batches = receiver.stored()
        assert [b.seq for b in batches] == [5, 1, 2, 3, 4, 6]
        assert batches[0].samples[0].temperature_c == 54.0  # the newest reading went first
        assert receiver.attempts == 6  # each batch exactly once, no duplicate POST
        assert "server_unreachable" in [e.kind for e in batches[-1].events]
        # the receiver stores a batch before the reporter has read its answer
        wait_until(lambda: rep.status().delivered_batches == 6, what="the last answer read")
        status = rep.status()
        assert (status.consecutive_failures, status.spool_depth, status.delivered_batches) == (
            0,
            0,
            6,
        )
        assert (status.last_sent_seq, status.last_acked_seq) == (6, 6)
    finally:
        rep.close(1.0)
        receiver.stop()


def test_backfill_puts_the_newest_samples_and_urgent_batches_first(tmp_path, closing):
    """While down: 1 samples, 2 heartbeat, 3 an XID push, 4 samples, 5 heartbeat. The
    heartbeat 5 is the newest, but the server must get samples 4 before it (else its GPUs
    look stale for an interval); then the XID, then the rest oldest first."""
    port = free_port()
    rep = _reporter(f"http://127.0.0.1:{port}", tmp_path)
    closing(rep)
    rep.report(samples=_samples())
    rep.report()
    rep.push_now(xids=[XidEvent(gpu=1, xid=79, ts=utcnow())])
    rep.report(samples=_samples())
    rep.report()
    receiver = Receiver(port=port)
    try:
        rep.start()
        wait_until(lambda: len(receiver.stored()) == 5, what="delivery")
        assert [b.seq for b in receiver.stored()] == [4, 5, 3, 1, 2]
    finally:
        rep.close(1.0)
        receiver.stop()


def test_a_batch_spooled_during_the_backfill_jumps_the_queue(tmp_path, closing):
    port = free_port()

    def on_commands(_commands):  # runs on the sender thread, right after the first delivery
        rep.report(samples=_samples())  # a new report while 1..3 wait to be backfilled

    rep = _reporter(f"http://127.0.0.1:{port}", tmp_path, on_commands=on_commands)
    closing(rep)
    for _ in range(4):
        rep.report(samples=_samples())
    receiver = Receiver(port=port)
    receiver.commands = [{"id": "c1", "kind": "isolate", "args": {"reason": "test"}}]
    try:
        rep.start()
        wait_until(lambda: len(receiver.stored()) == 5, what="delivery")
        assert [b.seq for b in receiver.stored()] == [4, 5, 1, 2, 3]
    finally:
        rep.close(1.0)
        receiver.stop()


def test_a_retry_sends_the_newest_batch_of_that_moment(receiver, tmp_path, closing):
    receiver.fail_with = 503
    receiver.retry_after = "0"
    rep = _reporter(receiver.url, tmp_path)
    closing(rep)
    rep.start()
    rep.report(samples=_samples())
    wait_until(lambda: rep.status().consecutive_failures >= 1, what="a failed attempt")
    rep.report(samples=_samples())  # spooled while the first one waits for its retry
    wait_until(lambda: len(rep.spool) == 2, what="two spooled")
    receiver.fail_with = None
    wait_until(lambda: len(receiver.stored()) == 2, what="delivery")
    assert [b.seq for b in receiver.stored()] == [2, 1]


def test_new_batches_during_an_outage_do_not_cut_the_backoff_short(receiver, tmp_path, closing):
    receiver.fail_with = 503  # no Retry-After: the reporter's own backoff, 0.3 s per attempt
    rep = _reporter(receiver.url, tmp_path, backoff_initial_s=0.3, backoff_max_s=0.3)
    closing(rep)
    rep.start()
    for _ in range(20):  # a new batch every 30 ms: each attempt picks another newest one
        rep.report(samples=_samples())
        time.sleep(0.03)  # pacing the reports (the outage itself), not waiting for a condition
    # ~0.6 s at 0.3 s per wait: 3 attempts (one more if the first came late); a retry per
    # new batch would be 20
    assert 2 <= receiver.attempts <= 5
    assert len(rep.spool) == 20


def test_previous_epoch_batches_are_backfilled_behind_this_run(receiver, tmp_path, closing):
    old = _reporter(receiver.url, tmp_path)  # never started: its batches stay spooled
    old.report(samples=_samples())
    old.report(samples=_samples())
    old.close(0.1)
    new = _reporter(receiver.url, tmp_path)
    closing(new)
    assert len(new.spool) == 2
    new.report(samples=_samples())
    new.start()
    wait_until(lambda: len(receiver.stored()) == 3, what="3 batches")
    assert [(b.epoch, b.seq) for b in receiver.stored()] == [
        (new.epoch, 1),
        (old.epoch, 1),
        (old.epoch, 2),
    ]
    wait_until(lambda: new.status().last_sent_seq == 1, what="status of this epoch")


@pytest.mark.parametrize("status", [403, 422])
def test_permanent_error_moves_batch_aside_without_spinning(receiver, tmp_path, closing, status):
    receiver.fail_with = status
    rep = _reporter(receiver.url, tmp_path)
    closing(rep)
    rep.start()
    rep.report()
    rejected = tmp_path / "rejected"
    wait_until(lambda: rep.status().rejected_batches == 1, what="rejection")
    assert len(list(rejected.glob("*.json"))) == 1
    assert len(rep.spool) == 0
    assert f"HTTP {status}" in rep.status().last_error
    receiver.fail_with = None
    rep.report()
    wait_until(lambda: receiver.stored(), what="next batch")
    batch = receiver.stored()[0]
    assert batch.seq == 2
    assert [e.kind for e in batch.events] == ["report_rejected"]
    assert receiver.attempts == 2  # the refused batch was tried once


def test_wrong_token_is_permanent(receiver, tmp_path, closing):
    rep = _reporter(receiver.url, tmp_path, token="wrong")
    closing(rep)
    rep.start()
    rep.report()
    wait_until(lambda: rep.status().rejected_batches == 1, what="rejection")
    assert "HTTP 401" in rep.status().last_error


@pytest.mark.parametrize("status", [503, 429])
def test_transient_status_is_retried(receiver, tmp_path, closing, status):
    receiver.fail_with = status
    receiver.retry_after = "0"
    rep = _reporter(receiver.url, tmp_path)
    closing(rep)
    rep.start()
    rep.report()
    wait_until(lambda: receiver.attempts >= 3, what="retries")
    assert len(rep.spool) == 1
    receiver.fail_with = None
    wait_until(lambda: receiver.stored(), what="delivery after retry")
    wait_until(lambda: len(rep.spool) == 0, what="spool emptied")


def test_push_now_cuts_backoff_short(receiver, tmp_path, closing):
    receiver.fail_with = 503
    rep = _reporter(receiver.url, tmp_path, backoff_initial_s=30.0, backoff_max_s=30.0)
    closing(rep)
    rep.start()
    rep.report()
    wait_until(lambda: rep.status().consecutive_failures == 1, what="first failure")
    receiver.fail_with = None
    xid = XidEvent(gpu=2, xid=79, ts=utcnow())
    rep.push_now(xids=[xid])
    wait_until(lambda: len(receiver.stored()) == 2, timeout=5, what="urgent delivery")
    assert [len(b.xids) for b in receiver.stored()] == [1, 0]  # the XID, newest, went first


def test_commands_reach_the_callback(receiver, tmp_path, closing):
    got: list[list[Command]] = []
    lock = threading.Lock()

    def on_commands(commands):
        with lock:
            got.append(commands)

    receiver.commands = [{"id": "c1", "kind": "isolate", "args": {"reason": "test"}}]
    rep = _reporter(receiver.url, tmp_path, on_commands=on_commands)
    closing(rep)
    rep.start()
    rep.report()
    wait_until(lambda: got, what="commands")
    assert got[0][0].kind == "isolate"


def test_spool_never_drops_the_batch_in_flight(tmp_path):
    spool = Spool(tmp_path, max_batches=2)
    spool.put(b"{}", "e", 1)
    spool.put(b"{}", "e", 2)
    spool.set_in_flight(spool.oldest())
    assert spool.put(b"{}", "e", 3) == 1
    assert [i.seq for i in spool.items()] == [1, 3]


def test_retry_after_is_waited_at_least_and_spread_over_half_again():
    from tierwatch.agent.reporter import retry_wait_s

    assert retry_wait_s(0.7, None, 30.0) == 0.7
    assert retry_wait_s(0.7, 4.0, 30.0, rand=lambda: 0.0) == 4.0
    assert retry_wait_s(0.7, 4.0, 30.0, rand=lambda: 0.999) == 4.0 * (1 + 0.5 * 0.999)
    assert retry_wait_s(9.0, 4.0, 30.0, rand=lambda: 0.0) == 9.0  # the longer backoff wins
    assert retry_wait_s(0.7, 120.0, 30.0, rand=lambda: 0.5) == 30.0  # capped
    # many agents shed at once come back spread out, not in one instant
    import random

    rng = random.Random(1)
    waits = sorted(retry_wait_s(0.5, 2.0, 30.0, rand=rng.random) for _ in range(1000))
    assert waits[0] >= 2.0
    assert waits[-1] <= 3.0
    assert waits[-1] - waits[0] > 0.9
