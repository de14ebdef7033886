"""A daemon bound to a wildcard advertises an address its peers can reach.

A prefill daemon started with ``--host 0.0.0.0``, as operators run servers,
named its ranks ``0.0.0.0:PORT`` in its topology, and a decode daemon on
another host could not start ("0.0.0.0:PORT: UNAVAILABLE ... Connection
refused"). The choice (``runtime.advertise``) is tested here with its probes
replaced, and across two network namespaces joined by a veth pair: the
prefill daemon in one, bound to 0.0.0.0, the decode daemon and the client in
the other (needs root and iproute2; skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from lanekv.prefill.daemon import DaemonConfig
from lanekv.runtime.advertise import Advertised, advertise_host, join_host_port, primary_address
from lanekv.runtime.daemon import DaemonServer
from lanekv.runtime.security import SecurityConfig

from tests.checkpoints import EOS_TOKEN_ID, write_llama

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37]
NEW_TOKENS = 5


def _never(*_) -> None:
    return None


def test_the_advertised_host_is_chosen_in_order():
    primary = {socket.AF_INET: "10.1.2.3", socket.AF_INET6: "fd00::7"}
    pick = lambda bind, advertise=None, **kw: advertise_host(  # noqa: E731
        bind, advertise, **{"primary": primary.get, "resolve": lambda name: ["10.9.9.9"],
                            "hostname": lambda: "node-7", "interfaces": lambda: ["10.9.9.9", "10.1.2.3"],
                            **kw})
    assert pick("0.0.0.0", "prefill-3.example") == Advertised("prefill-3.example", "--advertise-host")
    assert pick("10.0.0.5").host == "10.0.0.5" and pick("127.0.0.1").host == "127.0.0.1"
    assert pick("0.0.0.0").host == pick("").host == pick("::").host == "10.1.2.3"
    assert pick("::", primary={socket.AF_INET6: "fd00::7"}.get).host == "fd00::7"  # IPv6 only for ::
    assert pick("0.0.0.0", primary={socket.AF_INET6: "fd00::7"}.get).host == "10.9.9.9"  # no IPv4 route
    assert pick("0.0.0.0", primary=_never).host == "10.9.9.9"
    assert "resolves" in pick("0.0.0.0", primary=_never).why


def test_without_a_default_route_only_an_address_of_this_host_is_advertised():
    """No default route, and the host name resolves to nothing or to an address this host
    does not have: its only non-loopback address, or a refusal with the flag to pass."""
    pick = lambda resolved, own: advertise_host(  # noqa: E731
        "0.0.0.0", primary=_never, resolve=lambda name: resolved, hostname=lambda: "node-7",
        interfaces=lambda: own)
    assert pick(["10.9.9.9", "10.0.0.4"], ["10.0.0.4", "10.0.0.5"]).host == "10.0.0.4"  # one of ours
    for resolved in ([], ["10.9.9.9"]):  # nothing, or not an address of this host
        assert pick(resolved, ["10.0.0.4"]) == Advertised(
            "10.0.0.4", "this host's only non-loopback address (no default route)")
        for own in ([], ["10.0.0.4", "10.0.0.5"]):
            with pytest.raises(ValueError) as err:
                pick(resolved, own)
            message = str(err.value)
            assert "\n" not in message and message.endswith("pass --advertise-host")
            assert "'node-7'" in message and f"{len(own)} non-loopback addresses" in message
    # On this machine: its own addresses are found, none of them loopback.
    from lanekv.runtime.advertise import host_addresses
    assert all(not a.startswith("127.") and a != "::1" for a in host_addresses())
    assert join_host_port("fd00::7", 50) == "[fd00::7]:50" and join_host_port("10.1.2.3", 50) == "10.1.2.3:50"
    for bad in ("0.0.0.0", "::", "", "a b", "x" * 300, "host/path"):
        with pytest.raises(ValueError, match="advertise_host"):
            DaemonConfig(advertise_host=bad)


def test_a_wildcard_bound_daemon_names_a_real_address_of_this_host():
    server = DaemonServer(SecurityConfig(), "0.0.0.0", 0, 2, None)
    try:
        host, _, port = server.endpoint.rpartition(":")
        assert int(port) == server.port and host not in ("0.0.0.0", "")
        expected = primary_address() or socket.gethostname()
        assert host == expected or host.startswith(expected), (host, expected)
    finally:
        server.close()


# -- two network namespaces -------------------------------------------------

SUBNET = "10.213.{}.{}"
PREFILL_PORT = 50070  # the prefill namespace is new: every port in it is free


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root and iproute2 (ip netns, ip link): not root"
    if shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns, ip link): no `ip` command"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str, str]]:
    """Two namespaces ("hosts") joined by a veth pair; (prefill ns, decode ns, prefill's address)."""
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    a, b = f"lkv{tag}a", f"lkv{tag}b"
    net = os.getpid() % 250 + 1
    addr_a, addr_b = SUBNET.format(net, 1), SUBNET.format(net, 2)
    try:
        _ip("netns", "add", a)
        _ip("netns", "add", b)
        _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for ns, dev, addr, peer in ((a, f"v{tag}a", addr_a, addr_b), (b, f"v{tag}b", addr_b, addr_a)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", peer)  # a host's usual default route
    except subprocess.CalledProcessError as err:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"needs root and iproute2 with network namespaces: {err.stderr.decode().strip()[:200]}")
    try:
        yield a, b, addr_a
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _in(ns: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "lanekv.cli", *args], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, text=True, **kw)


def _ready(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float = 150.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.2)
    return path.read_text().strip()


def _hf_greedy(checkpoint: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.inference_mode():
        x = torch.tensor([PROMPT])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                          pad_token_id=EOS_TOKEN_ID)
    return out[0, len(PROMPT):].tolist()


def test_a_decode_daemon_on_another_host_reaches_a_wildcard_bound_prefill_daemon(hosts, tmp_path):
    prefill_ns, decode_ns, prefill_addr = hosts
    checkpoint = write_llama(tmp_path / "llama")
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("prefill", "decode")}
    port = PREFILL_PORT
    try:
        with logs["prefill"].open("w") as err:
            procs.append(_in(prefill_ns, "prefill", "--model", str(checkpoint), "--cp-size", "2", "--page-size", "4",
                             "--pool-pages", "32", "--device", "cpu", "--host", "0.0.0.0", "--port", str(port),
                             "--ready-file", str(tmp_path / "prefill.ready"), stdout=subprocess.DEVNULL, stderr=err))
        # Started at once, the decode daemon waits for the prefill daemon (--connect-timeout-s):
        # the ranks' endpoints it dials then are those the prefill daemon's topology advertises.
        with logs["decode"].open("w") as err:  # another host: only the veth reaches the prefill daemon
            procs.append(_in(decode_ns, "decode", "--model", str(checkpoint), "--prefill", f"{prefill_addr}:{port}",
                             "--connect-timeout-s", "150", "--page-size", "4", "--pool-pages", "64", "--device",
                             "cpu", "--transport", "grpc", "--ready-file", str(tmp_path / "decode.ready"),
                             stdout=subprocess.DEVNULL, stderr=err))
        expected = _hf_greedy(checkpoint)  # while both start
        prefill = _ready(tmp_path / "prefill.ready", procs[0], logs["prefill"])
        assert prefill == f"{prefill_addr}:{port}"  # not 0.0.0.0
        assert f"advertising {prefill_addr}" in logs["prefill"].read_text()
        decode = _ready(tmp_path / "decode.ready", procs[1], logs["decode"])
        generated = _in(decode_ns, "generate", "--decode", decode, "--ids", ",".join(map(str, PROMPT)),
                        "--max-new-tokens", str(NEW_TOKENS), "--print-ids", stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE)
        out, err = generated.communicate(timeout=120)
        assert generated.returncode == 0, err[-2000:]
        tokens = [int(t) for t in out.replace(",", " ").split()]
        assert tokens == expected, (tokens, out)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
