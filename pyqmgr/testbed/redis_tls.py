"""A throwaway redis-server that speaks TLS only and knows the fleet by an ACL user
(issue #35): Redis as operators run it across hosts.

At its first start the server makes, with ``openssl`` in its own directory, a CA, a
server certificate for 127.0.0.1 and localhost (subjectAltName, as a client that checks
the host name needs) and a client certificate signed by the same CA. It listens on
``tls-port`` alone (``port 0``: no plaintext), asks for client certificates
(``tls-auth-clients optional``, or ``yes`` with ``require_client_cert``), and has three
users: ``default`` off, an administrator for the test bed's own commands, and the
fleet's user with exactly :func:`pyqmgr.fleet.acl.acl_rules` for its prefix, so a
command pyqmgr sends without its rule there fails the tests as NOPERM.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import redis

from pyqmgr.fleet.acl import acl_rules
from pyqmgr.testbed import redis_common as common
from pyqmgr.testbed.instance_base import TestbedError, free_port
from pyqmgr.testbed.redis import REDIS_SERVER

#: The extensions of each certificate: a CA that may sign only certificates, and leaf
#: certificates for their one use. Strict verifiers (Python 3.13's default
#: VERIFY_X509_STRICT) want key usages and key identifiers present.
_OPENSSL_CNF = """\
[req]
distinguished_name = dn
[dn]
[pyqmgr_ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
[pyqmgr_server]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1,DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[pyqmgr_client]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""
#: Two days: long enough for any run, short enough that nothing lives on.
DAYS = "2"


@dataclass(frozen=True)
class Certificates:
    """PEM files: the CA, the server's certificate and key, a client's."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(args: list[str], cwd: str) -> None:
    try:
        proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"openssl {args[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise TestbedError(f"openssl {' '.join(args)} failed ({proc.returncode}):\n"
                           f"{proc.stderr.strip()}")


def make_certificates(directory: str) -> Certificates:
    """A CA and the certificates it signs, made in ``directory`` (keys mode 0600)."""
    cnf = os.path.join(directory, "openssl.cnf")
    with open(cnf, "w") as f:
        f.write(_OPENSSL_CNF)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", DAYS,
              "-subj", "/CN=pyqmgr test bed CA", "-config", cnf, "-extensions", "pyqmgr_ca"],
             directory)
    for name in ("server", "client"):
        _openssl(["req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                  "-subj", f"/CN=pyqmgr test bed {name}", "-config", cnf], directory)
        _openssl(["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                  "-CAcreateserial", "-days", DAYS, "-out", f"{name}.crt",
                  "-extfile", cnf, "-extensions", f"pyqmgr_{name}"], directory)
    for key in ("ca.key", "server.key", "client.key"):
        os.chmod(os.path.join(directory, key), 0o600)
    return Certificates(*(os.path.join(directory, name) for name in (
        "ca.crt", "server.crt", "server.key", "client.crt", "client.key")))


class TlsRedisServer(common.OneServer):
    """redis-server on a TLS port of 127.0.0.1, ``default`` off, the fleet's ACL user."""

    __test__ = False

    def __init__(self, require_client_cert: bool = False, user: str = "pyqmgr",
                 prefix: str = "pyqmgr:") -> None:
        self.require_client_cert = require_client_cert
        self.user = user
        self.prefix = prefix
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="pyqmgr-redis-tls-")
        os.chmod(self.dir, 0o755)
        self.log_path = os.path.join(self.dir, "redis.log")
        self.password = secrets.token_hex(16)
        self.admin_password = secrets.token_hex(16)
        self.password_file = common.write_secret(os.path.join(self.dir, "fleet.pw"), self.password)
        self.certs: Certificates | None = None
        self.process = common.ServerProcess([REDIS_SERVER, os.path.join(self.dir, "redis.conf")],
                                            self.dir, self.log_path,
                                            f"redis-server on TLS port {self.port}")
        self._client: redis.Redis | None = None

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}"

    @property
    def key_file(self) -> str:
        return common.fleet_key_file(self.dir)

    def fleet_cf(self, node: str, client_cert: bool = True) -> dict[str, str]:
        """pyqmgr.cf's fleet settings for ``node``: the ACL user, the CA, and (unless
        ``client_cert`` is false) the client certificate and key."""
        certs = self._certificates()
        cf = {"shared_state": self.url, "shared_state_node": node,
              "shared_state_key_file": self.key_file, "shared_state_user": self.user,
              "shared_state_password_file": self.password_file,
              "shared_state_tls_ca_file": certs.ca}
        if client_cert:
            cf.update(shared_state_tls_cert_file=certs.client_cert,
                      shared_state_tls_key_file=certs.client_key)
        return cf

    def _certificates(self) -> Certificates:
        if self.certs is None:
            self.certs = make_certificates(self.dir)
        return self.certs

    def _write_config(self) -> None:
        certs = self._certificates()
        lines = [
            "bind 127.0.0.1", "port 0", f"tls-port {self.port}",
            f"tls-cert-file {certs.server_cert}", f"tls-key-file {certs.server_key}",
            f"tls-ca-cert-file {certs.ca}",
            f"tls-auth-clients {'yes' if self.require_client_cert else 'optional'}",
            'save ""', "appendonly no", f"dir {self.dir}", f"logfile {self.log_path}",
            "daemonize no",
            "user default off",
            f"user admin on >{self.admin_password} ~* &* +@all",
            " ".join(["user", self.user, "on", f">{self.password}",
                      *acl_rules(self.prefix)]),
        ]
        with open(os.path.join(self.dir, "redis.conf"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self, timeout: float = 20) -> TlsRedisServer:
        self._write_config()
        self.process.start(lambda: common.answers(self.client()), timeout)
        return self

    def client(self, user: str | None = None, password: str | None = None,
               client_cert: bool = True) -> redis.Redis:
        """A client over TLS: the administrator's (the test bed's own, kept) unless
        ``user`` is given."""
        certs = self._certificates()
        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": certs.ca}
        if client_cert:
            tls.update(ssl_certfile=certs.client_cert, ssl_keyfile=certs.client_key)
        if user is not None:
            return common.sync_client(port=self.port, username=user, password=password, **tls)
        if self._client is None:
            self._client = common.sync_client(port=self.port, username="admin",
                                              password=self.admin_password, **tls)
        return self._client

    def command(self, *args: str) -> common.Reply:
        """One command by hand, as the administrator."""
        return common.command(self.client(), *args)

    def acl_log(self) -> list[dict[str, str]]:
        """``ACL LOG``: what was refused to whom (reason, object, username, command)."""
        entries = self.command("ACL", "LOG")
        out = []
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, list):
                pairs = zip(entry[::2], entry[1::2], strict=False)
                out.append({_text(k): _text(v) for k, v in pairs})
        return out

    def log_tail(self, n: int = 20) -> str:
        return self.process.log_tail(n)





def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
