"""Throwaway certificates for TLS tests, made with the ``openssl`` command-line tool.

Two unrelated CAs: ``ca`` signs a server certificate (for 127.0.0.1 and
localhost) and a client certificate; ``other_ca`` signs a client certificate
that servers trusting ``ca`` must refuse.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = lanekv-test
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
[client]
basicConstraints = CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
"""
# EC P-256 keys: key generation takes milliseconds, where RSA takes up to a second.
_NEW_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


class Pair(NamedTuple):
    cert: str
    key: str


class CertSet(NamedTuple):
    ca: str  # PEM of the CA that signed server and client
    server: Pair
    client: Pair
    other_ca: str
    other_client: Pair  # signed by other_ca


def openssl_or_skip() -> str:
    path = shutil.which("openssl")
    if path is None:
        pytest.skip("the openssl command-line tool is not installed; it makes the test certificates")
    return path


def make_certs(directory: Path) -> CertSet:
    """Write CAs, keys and certificates under ``directory`` (skips the test without openssl)."""
    openssl = openssl_or_skip()
    config = directory / "openssl.cnf"
    config.write_text(_CONFIG)

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=30)
        if done.returncode:
            raise RuntimeError(f"openssl {' '.join(args[:2])} failed:\n{done.stderr}")

    def ca(name: str) -> Pair:
        pair = Pair(str(directory / f"{name}.pem"), str(directory / f"{name}.key"))
        run("req", "-x509", *_NEW_KEY, "-keyout", pair.key, "-out", pair.cert, "-days", "2",
            "-subj", f"/CN=lanekv test {name}", "-config", str(config), "-extensions", "ca")
        return pair

    def signed(name: str, by: Pair, extensions: str, serial: int) -> Pair:
        pair = Pair(str(directory / f"{name}.pem"), str(directory / f"{name}.key"))
        request = str(directory / f"{name}.csr")
        run("req", "-new", *_NEW_KEY, "-keyout", pair.key, "-out", request,
            "-subj", f"/CN={name}", "-config", str(config))
        run("x509", "-req", "-in", request, "-CA", by.cert, "-CAkey", by.key, "-set_serial", str(serial),
            "-days", "2", "-out", pair.cert, "-extfile", str(config), "-extensions", extensions)
        return pair

    root, other = ca("ca"), ca("other-ca")
    return CertSet(
        ca=root.cert,
        server=signed("localhost", root, "server", 1),
        client=signed("client", root, "client", 2),
        other_ca=other.cert,
        other_client=signed("other-client", other, "client", 3),
    )
