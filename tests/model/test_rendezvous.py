"""The group's rendezvous is held by its starter from the moment its port is known."""

import errno
import socket

import pytest
from lanekv.model.parallel.rendezvous import HOST, host_store, join_store


def test_the_port_handed_to_the_ranks_is_already_bound_and_joinable():
    store = host_store(0, timeout_s=10)
    assert store.port > 0
    with socket.socket() as other, pytest.raises(OSError) as err:
        other.bind((HOST, store.port))  # no other process can take it before the ranks join
    assert err.value.errno == errno.EADDRINUSE
    rank = join_store(store.port, timeout_s=10)
    rank.set("seen", "1")
    assert store.get("seen") == b"1"


def test_a_configured_port_that_is_busy_fails_at_once_naming_it():
    with socket.socket() as holder:
        holder.bind((HOST, 0))
        holder.listen()
        with pytest.raises(RuntimeError, match=str(holder.getsockname()[1])):
            host_store(holder.getsockname()[1], timeout_s=5)
