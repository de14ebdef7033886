"""Every pairing of a prefill layout with a decode layout, both transports: greedy tokens
equal transformers'.

Prefill cp 1, 2 and 3 (DeepSeek-V3 also with EP at cp 2 and 3) x decode tp 1, 2 and 4
x gRPC and the same-host fast path, for Llama (GQA, 4 KV heads: a tp rank fetches
its heads) and DeepSeek-V3 (MLA + MoE: every rank the whole latent row), each case
with concurrent prompts.

Cost: the prefill daemons are shared by every case of their model (one per layout,
all started at the model's first case, stopped at the module's end). Each case is
one decode layout, whose daemon pairs with every prefill daemon of its model (xPyD),
so one case drives every prefill layout into it; each prefill daemon must have
served some of the case's prompts. The decode daemon lives for its case only: no
two cases share a decode layout, and a process holds one TP group at a time (rank 0
joins torch's default process group).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import torch
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE, write_deepseek_v3, write_llama_4kv
from tests.daemons import LONG_LEASE

PAGE_SIZE = 4
MAX_NEW_TOKENS = 6
MODELS = ("llama", "deepseek_v3")
# (cp_size, ep) of each model's prefill daemons; EP only where the model has experts.
LAYOUTS = {"llama": ((1, False), (2, False), (3, False)),
           "deepseek_v3": ((1, False), (2, False), (3, False), (2, True), (3, True))}
TRANSPORTS = {"grpc": ("grpc", "grpc"), "fast": ("auto", "shm")}  # case -> (--transport, the path taken)
PROMPT_LENGTHS = (3, 9, 17, 30, 4, 13, 21, 6, 11, 26)


class _Counted:
    """A prefill daemon and how many prompts it took (its ``submit`` wrapped)."""

    def __init__(self, daemon: PrefillDaemon) -> None:
        self.daemon, self.served, self._lock = daemon, 0, threading.Lock()
        submit = daemon.submit

        def counted(*args, **kwargs):
            with self._lock:
                self.served += 1
            return submit(*args, **kwargs)

        daemon.submit = counted


class Cluster:
    """The module's daemons, each started at first use and stopped at the module's end."""

    def __init__(self, root) -> None:
        self._root = root
        self._checkpoints: dict[str, str] = {}
        self._prefills: dict[str, list[_Counted]] = {}
        self._hf: dict[str, object] = {}

    def checkpoint(self, model: str) -> str:
        if model not in self._checkpoints:
            path = self._root / model
            # 2 layers, hidden 64; DeepSeek: the first layer dense, 12 experts (cp 3 and tp 4 divide them).
            written = write_llama_4kv(path) if model == "llama" else \
                write_deepseek_v3(path, num_layers=2, num_experts=12)
            self._checkpoints[model] = str(written)
        return self._checkpoints[model]

    def prefills(self, model: str) -> list[_Counted]:
        if model not in self._prefills:
            checkpoint = self.checkpoint(model)
            configs = [EngineConfig(checkpoint, cp_size=cp, ep=ep, page_size=PAGE_SIZE, pages_per_lane=64,
                                    start_timeout_s=120, cpu_threads=1) for cp, ep in LAYOUTS[model]]
            self._prefills[model] = [_Counted(d) for d in _all(lambda c: PrefillDaemon(c, LONG_LEASE), configs)]
        return self._prefills[model]

    @contextlib.contextmanager
    def decode(self, model: str, tp_size: int, transport: str) -> Iterator[DecodeDaemon]:
        """A decode daemon of this layout paired with every prefill daemon of the model."""
        first, *extra = [p.daemon.endpoint for p in self.prefills(model)]
        daemon = DecodeDaemon(DecodeConfig(
            self.checkpoint(model), first, extra_prefill_endpoints=tuple(extra), page_size=PAGE_SIZE,
            device="cpu", pool_pages=128, tp_size=tp_size, transport=TRANSPORTS[transport][0]))
        try:
            yield daemon
        finally:
            daemon.stop(grace_s=1.0)

    def reference(self, model: str, ids: list[int]) -> list[int]:
        from transformers import AutoModelForCausalLM

        if model not in self._hf:
            self._hf[model] = AutoModelForCausalLM.from_pretrained(
                self.checkpoint(model), attn_implementation="eager", dtype=torch.float32).eval()
        with torch.inference_mode():
            x = torch.tensor([ids])
            out = self._hf[model].generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                           max_new_tokens=MAX_NEW_TOKENS, pad_token_id=EOS_TOKEN_ID)
        return out[0, len(ids):].tolist()

    def close(self) -> None:
        _all(lambda p: p.daemon.stop(), [p for ps in self._prefills.values() for p in ps])


def _all(run, items: list) -> list:
    """``run`` of every item at once (daemons start and stop mostly waiting on their processes)."""
    if not items:
        return []
    with futures.ThreadPoolExecutor(len(items)) as pool:
        jobs = [pool.submit(run, item) for item in items]
        futures.wait(jobs)
    return [job.result() for job in jobs]  # the first error, once every item is done


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    made = Cluster(tmp_path_factory.mktemp("tp-matrix"))
    try:
        yield made
    finally:
        made.close()


def _generate_all(endpoint: str, prompts: list[list[int]]) -> list[tuple[list[int], dict]]:
    """Every prompt's Generate at once: its tokens and trailing metadata."""
    with grpc.insecure_channel(endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)

        def run(ids: list[int]) -> tuple[list[int], dict]:
            call = stub.Generate(lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids),
                                                            max_new_tokens=MAX_NEW_TOKENS), timeout=120)
            return [t for reply in call for t in reply.token_ids], dict(call.trailing_metadata())

        with futures.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(run, prompts))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_every_prefill_layout_feeds_this_decode_layout(cluster, model: str, tp_size: int, transport: str) -> None:
    prefills = cluster.prefills(model)
    case = MODELS.index(model) * 100 + tp_size * 10 + list(TRANSPORTS).index(transport)
    gen = torch.Generator().manual_seed(case)  # prompts of its own: no prefix cache of another case serves them
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist()
               for n in PROMPT_LENGTHS[:2 * len(prefills)]]
    served = [p.served for p in prefills]
    with cluster.decode(model, tp_size, transport) as decode:
        results = _generate_all(decode.endpoint, prompts)
        counts = decode.stats()
        a = decode.agreement
    assert (counts.free_pages, counts.active_requests) == (counts.total_pages, 0)
    page_bytes = a.kv_planes * a.num_layers * PAGE_SIZE * a.num_kv_heads * a.head_dim * 4  # float32
    mla = model == "deepseek_v3"
    path = TRANSPORTS[transport][1]
    for ids, (tokens, stats) in zip(prompts, results):
        assert tokens == cluster.reference(model, ids), f"prompt of {len(ids)} tokens"
        # Every owner rank's KV came by this case's transport, to every decode rank.
        paths = dict(item.split(":") for item in stats["lanekv-transfer-paths"].split(","))
        assert set(paths.values()) == {path}, stats["lanekv-transfer-paths"]
        # GQA: each decode rank its heads, the whole pages' bytes once; MLA: each rank whole rows.
        assert int(stats["lanekv-transfer-bytes"]) == (tp_size if mla else 1) * -(-len(ids) // PAGE_SIZE) \
            * page_bytes
    assert all(p.served > before for p, before in zip(prefills, served)), \
        f"prompts per prefill layout {[p.served - b for p, b in zip(prefills, served)]}"
