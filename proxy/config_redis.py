"""A Redis URL's query options, checked as redis-py's asyncio client will read them.

redis-py hands the options of ``redis.url`` to every connection it makes: a name the connection
does not take, or a value it cannot use, fails each of them (every call and /readyz a 503
store_unavailable against a Redis that is up), where check-config and a reload must refuse it.
"""

from __future__ import annotations

import inspect
import ssl
from collections.abc import Iterable, Mapping

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, SSLConnection, to_bool

# What redis-py's to_bool reads as false (its FALSE_STRINGS) and the words that say true: any
# other word it reads as true (socket_keepalive=maybe), which no one meant.
_BOOLEAN_WORDS = frozenset({"0", "F", "FALSE", "N", "NO", "OFF", "1", "T", "TRUE", "Y", "YES", "ON"})
# Redis counts its databases in a C int (the databases setting is at most 2^31 - 1): SELECT
# refuses an index past the last, every connection with it.
DB_INDEX_MAX = 2**31 - 2
# redis-py's RedisSSLContext takes these words alone, in lower case.
_CERT_REQS = ("none", "optional", "required")


def tls_options() -> frozenset[str]:
    """The ``ssl_*`` options the TLS connection (rediss://) takes: its keyword arguments."""
    parameters = inspect.signature(SSLConnection.__init__).parameters
    return frozenset(name for name in parameters if name.startswith("ssl_"))


def unknown_option(scheme: str, names: list[str]) -> str | None:
    """Why the first of a URL's option ``names`` that cannot go with ``scheme`` cannot, if one
    cannot: redis-py passes an option it does not parse to the connection as it is written."""
    tls = tls_options()
    for name in names:
        if name not in (tls if name.startswith("ssl_") else URL_QUERY_ARGUMENT_PARSERS):
            return f"unknown option {name[:80]}"
        if name in tls and scheme != "rediss":
            return f"{name} is a TLS option, which only a rediss:// URL takes"
    return None


def not_for_a_cluster(names: Iterable[str]) -> list[str]:
    """The options among ``names`` redis-py's cluster client does not take (timeout,
    retry_on_timeout, ssl_password, ...): it takes keyword arguments by name alone, and raised
    for one of them when it was made."""
    parameters = inspect.signature(RedisCluster.__init__).parameters
    return sorted(name for name in names if name not in parameters)


def bad_value(values: Mapping[str, list[str]]) -> str | None:
    """Why an option's value (the first given, as redis-py reads it) is one redis-py would
    misread or that no connection can use, if one is. The values are those redis-py's
    ``parse_url`` took: the numbers among them are numbers."""
    for name, given in values.items():
        value = given[0]
        if URL_QUERY_ARGUMENT_PARSERS.get(name) is to_bool and value.upper() not in _BOOLEAN_WORDS:
            return f"{name} must be true or false (or yes/no, on/off, 1/0), not {value[:40]!r}"
        if name == "ssl_cert_reqs" and value not in _CERT_REQS:
            return f"ssl_cert_reqs must be {', '.join(_CERT_REQS[:-1])} or {_CERT_REQS[-1]}"
        if name == "ssl_min_version" and int(value) not in {v.value for v in ssl.TLSVersion}:
            versions = ", ".join(f"{v.value} ({v.name})" for v in ssl.TLSVersion if v.value > 0)
            return f"ssl_min_version must be a TLS version's number: {versions}"
        if name == "ssl_ciphers":
            try:
                # Parsed alone: no certificate is read, nothing is reached.
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).set_ciphers(value)
            except ssl.SSLError:
                return f"ssl_ciphers: OpenSSL selects no cipher from {value[:80]!r}"
    return None
