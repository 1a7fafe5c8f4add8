"""Throwaway Postfix instances, a sink SMTP server and policy servers, for tests, the demo
and benchmarks.

The names below are loaded on first use, so importing one submodule (say the maillog
reader) does not pull in aiosmtpd, which only the sink needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PostfixInstance": "instance",
    "TestbedError": "instance",
    "wait_until": "instance",
    "LOCAL_USER": "instance",
    "LOCAL_DOMAIN": "instance",
    "Maillog": "maillog",
    "LogLine": "maillog",
    "parse_line": "maillog",
    "SinkServer": "sink",
    "ReceivedMessage": "sink",
    "Postfwd": "postfwd",
    "FakePolicyServer": "policy_server",
    "RedisServer": "redis",
    "TlsRedisServer": "redis_tls",
    "SentinelSet": "redis_sentinel",
    "RedisCluster": "redis_cluster",
    "ValkeyServer": "valkey",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
