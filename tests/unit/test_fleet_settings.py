"""pyqmgr.cf's fleet settings: off by default, every mistake a start-up error naming
the parameter, and the password file root's alone (pyqmgr/fleet/settings.py)."""

from __future__ import annotations

import os

import pytest

from pyqmgr.fleet.client import CLUSTER, SENTINEL, UNIX, Endpoint
from pyqmgr.fleet.settings import (
    HOLD,
    LOCAL,
    MAX_PASSWORD_FILE,
    fleet_settings,
    parse_shared_state,
    read_password,
)
from pyqmgr.pyqmgr_cf import PyqmgrCfError, from_text

PATH = "/etc/postfix/pyqmgr.cf"


def settings(text: str):
    return fleet_settings(from_text(text, PATH), "mx1.example")


def test_off_unless_shared_state_is_set():
    assert settings("") is None
    assert settings("shared_state =\n") is None
    with pytest.raises(PyqmgrCfError, match="shared_state_failure: has no effect without"):
        settings("shared_state_failure = hold\n")


def test_defaults():
    got = settings("shared_state = redis://127.0.0.1:6379\n")
    assert got is not None
    assert got.endpoint == Endpoint(host="127.0.0.1", port=6379)
    assert (got.failure, got.timeout, got.lease_time, got.prefix, got.node) == (
        LOCAL, 0.5, 60.0, "pyqmgr:", "mx1.example")


@pytest.mark.parametrize("text, endpoint", [
    ("redis://127.0.0.1:6379/2", Endpoint(host="127.0.0.1", port=6379, db=2)),
    ("redis://redis.example:7000", Endpoint(host="redis.example", port=7000)),
    ("redis://[::1]:6379/0", Endpoint(host="::1", port=6379)),
    ("unix:/run/redis/redis.sock", Endpoint(path="/run/redis/redis.sock", kind=UNIX)),
    ("unix:/run/redis/redis.sock?db=4", Endpoint(path="/run/redis/redis.sock", db=4,
                                                 kind=UNIX)),
    ("rediss://redis.example:6380", Endpoint(host="redis.example", port=6380, tls=True)),
    ("redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,[::1]:26379/mymaster/2",
     Endpoint(kind=SENTINEL, nodes=(("10.0.0.1", 26379), ("10.0.0.2", 26379),
                                    ("::1", 26379)), service="mymaster", db=2)),
    ("rediss+sentinel://s1.example:26379/fleet",
     Endpoint(kind=SENTINEL, nodes=(("s1.example", 26379),), service="fleet", tls=True)),
    ("redis+cluster://10.0.0.1:7000,10.0.0.2:7000",
     Endpoint(kind=CLUSTER, nodes=(("10.0.0.1", 7000), ("10.0.0.2", 7000)))),
    ("rediss+cluster://c.example:7000",
     Endpoint(kind=CLUSTER, nodes=(("c.example", 7000),), tls=True)),
])
def test_addresses(text, endpoint):
    assert parse_shared_state(text) == endpoint


@pytest.mark.parametrize("text, says", [
    ("redis://127.0.0.1", "the port is missing"),
    ("redis://127.0.0.1:0", "bad port"),
    ("redis://127.0.0.1:99999", "bad port"),
    ("redis://:6379", "empty host"),
    ("redis://::1:6379", "IPv6 address must be in brackets"),
    ("redis://127.0.0.1:6379/x", "bad database number"),
    ("redis://user:pw@127.0.0.1:6379", "no password in the address"),
    ("unix:run/redis.sock", "must be absolute"),
    ("unix:/run/redis.sock?database=1", "only db=N"),
    ("unix:/" + "x" * 200, "not a usable socket path"),
    ("http://127.0.0.1:6379", "expected redis://"),
    ("redis://a:1,b:2", "one server"),
    ("redis+sentinel://127.0.0.1:26379", "the Sentinel service name"),
    ("redis+sentinel://127.0.0.1:26379/my master", "the Sentinel service name"),
    ("redis+sentinel://127.0.0.1/mymaster", "the port is missing"),
    ("redis+cluster://127.0.0.1:7000/0", "no database number"),
    ("redis+cluster://" + ",".join(f"h{i}:1" for i in range(33)), "more than 32"),
])
def test_bad_addresses_name_the_parameter(text, says):
    with pytest.raises(PyqmgrCfError) as exc:
        settings(f"shared_state = {text}\n")
    assert f"{PATH}: parameter shared_state: " in str(exc.value) and says in str(exc.value)


@pytest.mark.parametrize("line, says", [
    ("shared_state_failure = stop", "expected local or hold"),
    ("shared_state_timeout = 0", "a duration must be more than 0"),
    ("shared_state_timeout = 5ms", "outside 0.01s to 10s"),
    ("shared_state_timeout = 1h", "outside"),
    ("shared_state_timeout = soon", "shared_state_timeout"),
    ("shared_state_lease_time = 1s", "outside 2s to 3600s"),
    ("shared_state_prefix = a b", "a word of 1 to 64"),
    ("shared_state_node = mx 1", "a name without spaces"),
])
def test_bad_values_name_the_parameter(line, says):
    with pytest.raises(PyqmgrCfError) as exc:
        settings(f"shared_state = redis://127.0.0.1:6379\n{line}\n")
    name = line.split(" = ")[0]
    assert f"parameter {name}: " in str(exc.value) and says in str(exc.value)


def test_hold_and_the_others_set():
    got = settings("shared_state = unix:/run/r.sock\nshared_state_failure = hold\n"
                   "shared_state_timeout = 200ms\nshared_state_lease_time = 30s\n"
                   "shared_state_prefix = eu:\nshared_state_node = relay-2\n")
    assert got is not None and (got.failure, got.timeout, got.lease_time, got.prefix,
                                got.node) == (HOLD, 0.2, 30.0, "eu:", "relay-2")


@pytest.mark.skipif(os.geteuid() != 0, reason="the password file must belong to root")
def test_the_password_file(tmp_path):
    pw = tmp_path / "redis.pw"
    pw.write_text("s3cret\nignored\n")
    os.chmod(pw, 0o600)
    assert read_password(str(pw)) == "s3cret"
    got = settings(f"shared_state = redis://127.0.0.1:6379\nshared_state_password_file = {pw}\n")
    assert got is not None and got.endpoint.password == "s3cret"
    # The password never shows in what is printed of the address.
    assert "s3cret" not in str(got.endpoint)
    os.chmod(pw, 0o640)
    with pytest.raises(ValueError, match="readable by root alone"):
        read_password(str(pw))
    os.chmod(pw, 0o600)
    os.chown(pw, 65534, 0)
    with pytest.raises(ValueError, match="must belong to root"):
        read_password(str(pw))
    os.chown(pw, 0, 0)
    link = tmp_path / "link"
    link.symlink_to(pw)
    with pytest.raises(ValueError, match="cannot open"):
        read_password(str(link))
    pw.write_bytes(b"x" * (MAX_PASSWORD_FILE + 1))
    with pytest.raises(ValueError, match="larger than"):
        read_password(str(pw))
    pw.write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        read_password(str(pw))
    with pytest.raises(ValueError, match="not an absolute path"):
        read_password("redis.pw")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="not a regular file"):
        read_password(str(fifo))
    with pytest.raises(PyqmgrCfError, match="parameter shared_state_password_file: "):
        settings(f"shared_state = redis://127.0.0.1:6379\n"
                 f"shared_state_password_file = {tmp_path}/missing\n")


def test_per_transport_limits_follow_postfixs_naming_rule():
    got = settings("shared_state = redis://127.0.0.1:6379\n"
                   "fleet_destination_concurrency_limit = 20\n"
                   "smtp_fleet_destination_concurrency_limit = 5\n"
                   "smtp_fleet_destination_rate = 10/1s\n"
                   "smtp_fleet_destination_rate_burst = 3\n")
    assert got is not None
    smtp, relay = got.limits_for("smtp"), got.limits_for("relay")
    assert (smtp.sessions, str(smtp.rate), smtp.burst) == (5, "10/s", 3)
    assert (relay.sessions, relay.rate, relay.burst) == (20, None, 1) and relay.active
    none = settings("shared_state = redis://127.0.0.1:6379\n")
    assert none is not None and not none.limits_for("smtp").active


def test_site_limits_are_their_own_and_follow_the_naming_rule():
    got = settings("shared_state = redis://127.0.0.1:6379\n"
                   "fleet_destination_concurrency_limit = 20\n"
                   "fleet_site_concurrency_limit = 40\n"
                   "smtp_fleet_site_concurrency_limit = 8\n"
                   "smtp_fleet_site_rate = 100/1m\n"
                   "smtp_fleet_site_rate_burst = 4\n")
    assert got is not None
    smtp, relay = got.site_limits_for("smtp"), got.site_limits_for("relay")
    assert (smtp.sessions, str(smtp.rate), smtp.burst) == (8, "100/m", 4)
    assert (relay.sessions, relay.rate, relay.burst) == (40, None, 1)
    assert got.limits_for("smtp").sessions == 20, "the destinations' limits stay apart"
    none = settings("shared_state = redis://127.0.0.1:6379\n")
    assert none is not None and not none.site_limits_for("smtp").active


def key_file(tmp_path, key: str = "k" * 64) -> str:
    path = tmp_path / "fleet.key"
    path.write_text(key + "\n")
    os.chmod(path, 0o600)
    return str(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="the key file must belong to root")
def test_throttling_is_the_fleets_with_a_key_unless_a_transport_says_no(tmp_path):
    key = f"shared_state_key_file = {key_file(tmp_path)}\n"
    got = settings("shared_state = redis://127.0.0.1:6379\n" + key +
                   "relay_fleet_throttling = no\n")
    assert got is not None and got.key == b"k" * 64
    assert got.shares_throttling("smtp") and not got.shares_throttling("relay")
    off = settings("shared_state = redis://127.0.0.1:6379\nfleet_throttling = NO\n"
                   "smtp_fleet_throttling = yes\n" + key)
    assert off is not None
    assert off.shares_throttling("smtp") and not off.shares_throttling("relay")


def test_without_a_key_no_throttling_is_shared():
    """Anyone who can reach Redis can publish on its channels: unsigned news would be
    anyone's news, so without the fleet's key there is none."""
    got = settings("shared_state = redis://127.0.0.1:6379\n")
    assert got is not None and got.key == b""
    assert not got.shares_throttling("smtp")
    for line in ("fleet_throttling = yes", "smtp_fleet_throttling = yes"):
        with pytest.raises(PyqmgrCfError, match=line.split(" ")[0] + ": yes needs "
                                                "shared_state_key_file"):
            settings(f"shared_state = redis://127.0.0.1:6379\n{line}\n")
    assert settings("shared_state = redis://127.0.0.1:6379\nfleet_throttling = no\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="the key file must belong to root")
def test_a_key_file_must_be_roots_alone_and_long_enough(tmp_path):
    base = "shared_state = redis://127.0.0.1:6379\nshared_state_key_file = "
    path = key_file(tmp_path, "short")
    with pytest.raises(PyqmgrCfError, match="the key is 5 characters, fewer than 32"):
        settings(base + path + "\n")
    path = key_file(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(PyqmgrCfError, match="shared_state_key_file: .*readable by root "
                                            "alone"):
        settings(base + path + "\n")
    with pytest.raises(PyqmgrCfError, match="shared_state_key_file: has no effect"):
        settings(f"shared_state_key_file = {path}\n")


@pytest.mark.parametrize("line, says", [
    ("relay_fleet_destination_concurrency_limit = many", "bad numerical value"),
    ("fleet_destination_concurrency_limit = -1", "out of range"),
    ("smtp_fleet_destination_rate = fast", "bad rate"),
    ("smtp_fleet_destination_rate_burst = 0", "out of range"),
    ("relay_fleet_throttling = maybe", "bad boolean value"),
    ("smtp_fleet_site_concurrency_limit = lots", "bad numerical value"),
    ("fleet_site_concurrency_limit = 100001", "out of range"),
    ("fleet_site_rate = 5 a second", "bad rate"),
    ("relay_fleet_site_rate_burst = 0", "out of range"),
])
def test_bad_limits_are_start_up_errors_in_every_form(line, says):
    name = line.split(" = ")[0]
    with pytest.raises(PyqmgrCfError) as exc:
        settings(f"shared_state = redis://127.0.0.1:6379\n{line}\n")
    assert f"parameter {name}: " in str(exc.value) and says in str(exc.value)
    with pytest.raises(PyqmgrCfError, match=f"{name}: has no effect without shared_state"):
        settings(f"{line}\n")


def test_site_limits_that_could_never_apply_are_start_up_errors():
    from pyqmgr.fleet.settings import check_site_limits

    def cf(line: str):
        return from_text(f"shared_state = redis://127.0.0.1:6379\n{line}\n", PATH)

    smtp_only = {"smtp", "lmtp"}.__contains__
    with pytest.raises(PyqmgrCfError, match="parameter fleet_site_concurrency_limit: has "
                                            "no effect without site_grouping = mx"):
        check_site_limits(cf("fleet_site_concurrency_limit = 5"), None)
    with pytest.raises(PyqmgrCfError, match="parameter relay_fleet_site_rate: has no "
                                            "effect: the relay transport's destinations"):
        check_site_limits(cf("relay_fleet_site_rate = 5/1s"), smtp_only)
    # The bare form applies to the grouped transports; a grouped one's own is fine.
    check_site_limits(cf("fleet_site_concurrency_limit = 5"), smtp_only)
    check_site_limits(cf("smtp_fleet_site_rate_burst = 3"), smtp_only)
    check_site_limits(cf("fleet_destination_concurrency_limit = 5"), None)


def secret(tmp_path, name: str, text: str, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_an_acl_user_needs_its_password(tmp_path):
    pw = secret(tmp_path, "pw", "s3cret\n")
    got = settings(f"shared_state = redis://127.0.0.1:6379\nshared_state_user = pyqmgr\n"
                   f"shared_state_password_file = {pw}\n")
    assert got is not None and got.endpoint.user == "pyqmgr"
    assert got.endpoint.password == "s3cret"
    # Never in the text every warning carries.
    assert "s3cret" not in str(got.endpoint) and "s3cret" not in repr(got.endpoint)
    with pytest.raises(PyqmgrCfError, match="shared_state_user: an ACL user needs"):
        settings("shared_state = redis://127.0.0.1:6379\nshared_state_user = pyqmgr\n")
    with pytest.raises(PyqmgrCfError, match="shared_state_user: an ACL user name"):
        settings(f"shared_state = redis://127.0.0.1:6379\nshared_state_user = a\tb\n"
                 f"shared_state_password_file = {pw}\n")
    with pytest.raises(PyqmgrCfError, match="shared_state_user: has no effect without"):
        settings("shared_state_user = pyqmgr\n")


def test_the_sentinels_password_is_for_sentinel_only(tmp_path):
    pw = secret(tmp_path, "spw", "sentinel-pw\n")
    got = settings(f"shared_state = redis+sentinel://127.0.0.1:26379/m\n"
                   f"shared_state_sentinel_password_file = {pw}\n")
    assert got is not None and got.endpoint.sentinel_password == "sentinel-pw"
    with pytest.raises(PyqmgrCfError, match="has no effect without redis\\+sentinel"):
        settings(f"shared_state = redis://127.0.0.1:6379\n"
                 f"shared_state_sentinel_password_file = {pw}\n")


def make_tls_files(tmp_path) -> tuple[str, str, str]:
    """A CA and a client certificate signed by it, made by openssl as an admin would."""
    import subprocess

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
        "ca.crt", "-days", "2", "-subj", "/CN=test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out",
        "client.csr", "-subj", "/CN=pyqmgr")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "client.crt", "-days", "2")
    os.chmod(tmp_path / "client.key", 0o600)
    return str(tmp_path / "ca.crt"), str(tmp_path / "client.crt"), str(tmp_path / "client.key")


def test_tls_files_are_read_at_start_up(tmp_path):
    ca, cert, key = make_tls_files(tmp_path)
    got = settings(f"shared_state = rediss://127.0.0.1:6380\nshared_state_tls_ca_file = {ca}\n"
                   f"shared_state_tls_cert_file = {cert}\nshared_state_tls_key_file = {key}\n")
    assert got is not None and got.endpoint.tls and got.endpoint.ssl_context is not None
    assert str(got.endpoint) == "rediss://127.0.0.1:6380"
    # The system's CAs when no file is named.
    plain = settings("shared_state = rediss://127.0.0.1:6380\n")
    assert plain is not None and plain.endpoint.ssl_context is not None


@pytest.mark.parametrize("lines, says", [
    ("shared_state = redis://127.0.0.1:6379\nshared_state_tls_ca_file = {ca}\n",
     "shared_state_tls_ca_file: has no effect without TLS"),
    ("shared_state = rediss://127.0.0.1:6379\nshared_state_tls_cert_file = {cert}\n",
     "a client certificate needs both"),
    ("shared_state = rediss://127.0.0.1:6379\nshared_state_tls_ca_file = {cert}x\n",
     "shared_state_tls_ca_file: "),
    ("shared_state = rediss://127.0.0.1:6379\nshared_state_tls_ca_file = {key}\n",
     "shared_state_tls_ca_file: "),
    ("shared_state = rediss://127.0.0.1:6379\nshared_state_tls_ca_file = ca.crt\n",
     "is not an absolute path"),
    ("shared_state = rediss://127.0.0.1:6379\nshared_state_tls_cert_file = {cert}\n"
     "shared_state_tls_key_file = {ca}\n", "must be readable by root alone"),
    ("shared_state = rediss://127.0.0.1:6379\nshared_state_tls_cert_file = {ca}\n"
     "shared_state_tls_key_file = {key}\n", "shared_state_tls_cert_file: "),
])
def test_bad_tls_settings_are_start_up_errors(tmp_path, lines, says):
    ca, cert, key = make_tls_files(tmp_path)
    os.chmod(ca, 0o644)
    with pytest.raises(PyqmgrCfError, match=says.replace("+", "\\+")):
        settings(lines.format(ca=ca, cert=cert, key=key))


def test_a_prefix_with_braces_would_break_the_hash_tags():
    with pytest.raises(PyqmgrCfError, match="shared_state_prefix: .*without braces"):
        settings("shared_state = redis://127.0.0.1:6379\nshared_state_prefix = a{b}:\n")


def test_tls_to_sentinels_and_their_primary_uses_the_start_up_context(tmp_path):
    """rediss+sentinel://: the sentinels' clients and the primary's connections all
    speak TLS with the context built at start-up (redis-py's Sentinel takes no
    connection class for its sentinels: a TypeError at the first connection once)."""
    import asyncio

    from pyqmgr.fleet.client import make_redis

    ca, cert, key = make_tls_files(tmp_path)
    got = settings(f"shared_state = rediss+sentinel://127.0.0.1:26379,127.0.0.1:26380/m\n"
                   f"shared_state_tls_ca_file = {ca}\nshared_state_tls_cert_file = {cert}\n"
                   f"shared_state_tls_key_file = {key}\n")
    assert got is not None

    async def build() -> None:
        client = make_redis(got.endpoint, 1.0)
        pool = client.connection_pool
        sentinels = pool.sentinel_manager.sentinels
        assert len(sentinels) == 2
        for conn_class in [pool.connection_class,
                           *(s.connection_pool.connection_class for s in sentinels)]:
            assert conn_class.__name__.startswith("Tls"), conn_class
            made = conn_class(host="127.0.0.1", port=1) if "Sentinel" not in \
                conn_class.__name__ else None
            if made is not None:
                assert made._connection_arguments()["ssl"] is got.endpoint.ssl_context
        await client.aclose()

    asyncio.run(build())
