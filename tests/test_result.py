"""Root-cause ordering: the rank that died first is the cause, even when the agent learns of
its death (a signal, seen as a closed pipe) after a surviving peer has already raised
"connection closed by peer"."""

import pytest

from elastic_magic.result import RankFailure, root_cause_order

pytestmark = pytest.mark.unit

PEER_LOSS = ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:27307. "
             "This is typically caused by a remote worker crashing.")


def failure(rank, time, **kwargs):
    return RankFailure(rank=rank, local_rank=rank, attempt=0, pid=100 + rank, time=time,
                       **kwargs)


def test_a_death_seen_late_still_comes_before_the_peer_loss_it_caused():
    peer = failure(1, 10.0, exc_type="RuntimeError", message=PEER_LOSS)
    killed = failure(0, 10.4, signal="SIGKILL", exit_code=-9)
    assert [f.rank for f in root_cause_order([peer, killed])] == [0, 1]


def test_a_peer_loss_alone_or_long_before_other_failures_stays_first():
    peer = failure(1, 10.0, exc_type="RuntimeError", message=PEER_LOSS)
    assert root_cause_order([peer]) == [peer]
    much_later = failure(0, 30.0, exc_type="ValueError", message="boom")
    assert [f.rank for f in root_cause_order([much_later, peer])] == [1, 0]


def test_genuine_failures_keep_their_time_order():
    first = failure(2, 5.0, exc_type="ValueError", message="first")
    second = failure(0, 5.5, exit_code=3)
    assert root_cause_order([second, first]) == [first, second]
