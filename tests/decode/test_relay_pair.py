"""Sender relays between real daemons (``lanekv prefill --fetch-relays 2``): every owner
rank's two streams go to its two relays, the relays carry every byte the decode side
places, greedy tokens equal transformers', and no relay outlives the prefill daemon."""

from __future__ import annotations

import re
import subprocess
import threading
import uuid
from pathlib import Path

import grpc
import pytest
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.grpcfetch import client as grpcfetch_client
from lanekv.transfer.protocol.descriptors import SHM_DIR

from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.decode.test_decode_engine import hf_greedy

PROMPT = [(5 * i + 2) % 120 + 3 for i in range(37)]  # 10 pages of 4
RELAY_LOG = re.compile(r"relay of rank (\d+): request '([^']+)': (\d+) bytes in (\d+) chunks")


def _relay_pids(tag: str) -> set[int]:
    """The relay processes started under this test's ``TAG_ENV`` (tests of another pytest
    process may run relays at the same time; an orphan keeps its environment)."""
    out = subprocess.run(["pgrep", "-f", "lanekv.transfer.rank.relay_main"], capture_output=True, text=True)
    mine = set()
    for pid in (int(p) for p in out.stdout.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if f"{TAG_ENV}={tag}".encode() in environ:
            mine.add(pid)
    return mine


TAG_ENV = "LANEKV_TEST_RELAY_TAG"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cp_size", [1, 2])
def test_relays_carry_the_kv_and_tokens_equal_transformers(tmp_path, monkeypatch, capfd, cp_size):
    checkpoint = write_llama(tmp_path / "llama", num_layers=2)
    expected = hf_greedy(checkpoint, [PROMPT], 5)[0]
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_ENV, tag)  # every process the daemons start inherits it
    lock, used, fetched = threading.Lock(), [], []
    rank_fetch, fetch = grpcfetch_client.KVClient._rank_fetch, grpcfetch_client.KVClient.fetch

    def recorded_rank_fetch(self, job, rank, endpoint, span, epoch, lane=0, fallback=None):
        with lock:
            used.append((rank, endpoint, fallback))
        return rank_fetch(self, job, rank, endpoint, span, epoch, lane, fallback=fallback)

    def recorded_fetch(self, *args, **kw):
        stats = fetch(self, *args, **kw)
        with lock:
            fetched.append(stats)
        return stats

    monkeypatch.setattr(grpcfetch_client.KVClient, "_rank_fetch", recorded_rank_fetch)
    monkeypatch.setattr(grpcfetch_client.KVClient, "fetch", recorded_fetch)
    engine = EngineConfig(str(checkpoint), cp_size=cp_size, page_size=4, pages_per_lane=32, start_timeout_s=120,
                          fetch_relays=2)
    with running_pair(engine, transport="grpc", fetch_streams=2, fetch_chunk_bytes=2048) as (prefill, decode):
        relays, epoch = prefill.relays, prefill.epoch
        assert len(list(SHM_DIR.glob(f"lanekv-{epoch}-rank*"))) == cp_size  # the pools the relays map
        assert len(relays) == cp_size and all(len(r) == 2 for r in relays)
        assert len(_relay_pids(tag)) == 2 * cp_size
        with grpc.insecure_channel(decode.endpoint) as channel:
            request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT), max_new_tokens=5,
                                                 request_id="relayed")
            tokens = [t for reply in lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=120)
                      for t in reply.token_ids]
    assert tokens == expected
    # Every stream of the request went to a relay of its rank, none to the rank itself.
    streams = [(rank, endpoint) for rank, endpoint, _ in used]
    assert sorted(streams) == sorted((rank, endpoint) for rank in range(cp_size) for endpoint in relays[rank])
    assert all(fallback == prefill.topology.endpoints[rank] for rank, _, fallback in used)
    stats = [s for s in fetched if s.bytes][-1]
    assert stats.retries == 0
    # The relays sent every byte the decode side received (so the ranks sent none).
    sent = [(int(m[1]), int(m[3])) for m in RELAY_LOG.finditer(capfd.readouterr().err) if m[2] == "relayed"]
    assert len(sent) == 2 * cp_size and all(n > 0 for _, n in sent), sent
    assert sum(n for _, n in sent) == stats.bytes
    assert not _relay_pids(tag)  # every relay ended with its rank
    assert not list(SHM_DIR.glob(f"lanekv-{epoch}-*"))  # the ranks' pool files are gone


def test_the_relays_a_reply_names_are_checked():
    from lanekv.decode.prefill_call import relays_of
    from lanekv.runtime.status import Refusal

    def reply(*relays):
        return lanekv_pb2.PrefillReply(endpoints=["h:1", "h:2"],
                                       relays=[lanekv_pb2.RankRelays(endpoints=list(r)) for r in relays])

    assert relays_of(lanekv_pb2.PrefillReply(endpoints=["h:1"])) == ()  # an older prefill: none
    assert relays_of(reply(["h:3", "h:4"], [])) == (("h:3", "h:4"), ())
    with pytest.raises(Refusal, match="relays of 1 ranks, its endpoints 2") as err:
        relays_of(reply(["h:3"]))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(Refusal, match="relay 'h:0' of rank 1: not 'host:port'"):
        relays_of(reply(["h:3"], ["h:0"]))


@pytest.mark.timeout(240)
def test_staged_relays_carry_the_kv_and_a_damaged_slot_falls_back_to_the_rank(tmp_path, monkeypatch, capfd):
    # Staged relays forced on CPU ranks (a GPU's default): each rank reads into its relays'
    # /dev/shm slots; the damaged request's slots fail the relays' digests, the rank sends.
    from lanekv.transfer.rank.staging import DAMAGE_ENV, STAGED_ENV

    checkpoint = write_llama(tmp_path / "llama", num_layers=2)
    expected = hf_greedy(checkpoint, [PROMPT], 5)[0]
    tag = uuid.uuid4().hex
    monkeypatch.setenv(TAG_ENV, tag)
    monkeypatch.setenv(STAGED_ENV, "1")
    monkeypatch.setenv(DAMAGE_ENV, "damaged")
    lock, fetched = threading.Lock(), []
    fetch = grpcfetch_client.KVClient.fetch

    def recorded_fetch(self, *args, **kw):
        stats = fetch(self, *args, **kw)
        with lock:
            fetched.append(stats)
        return stats

    monkeypatch.setattr(grpcfetch_client.KVClient, "fetch", recorded_fetch)
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=4, pages_per_lane=32, start_timeout_s=120,
                          fetch_relays=2)
    with running_pair(engine, transport="grpc", fetch_streams=2, fetch_chunk_bytes=2048) as (prefill, decode):
        epoch = prefill.epoch
        assert len(list(SHM_DIR.glob(f"lanekv-{epoch}-rank0-*-stage*"))) == 2  # one staging file per relay
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            for rid in ("relayed", "damaged"):
                request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT), max_new_tokens=5,
                                                     request_id=rid)
                tokens = [t for reply in stub.Generate(request, timeout=120) for t in reply.token_ids]
                assert tokens == expected, rid
    relayed, damaged = [s for s in fetched if s.bytes]
    assert relayed.retries == 0 and damaged.retries >= 1  # the damaged streams went on at the rank
    sent = [(m[2], int(m[3])) for m in RELAY_LOG.finditer(capfd.readouterr().err)]
    assert sum(n for rid, n in sent if rid == "relayed") == relayed.bytes  # the relays carried every byte
    assert not [n for rid, n in sent if rid == "damaged"]  # no relay finished a damaged stream
    assert not _relay_pids(tag)
    assert not list(SHM_DIR.glob(f"lanekv-{epoch}-*"))  # pools and staging files are gone
