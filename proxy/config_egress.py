"""The egress proxy an upstream's calls go through: its own ``proxy``, else the one the
environment names (``https_proxy`` / ``HTTPS_PROXY`` for an https upstream, ``http_proxy`` /
``HTTP_PROXY`` for an http one, unless ``no_proxy`` / ``NO_PROXY`` names its host), read as
Python's urllib reads them.

Checked here; ``config_load.parse_config`` resolves it once per load into
``UpstreamConfig.egress`` (the environment is read there and nowhere else), and ``forward`` sends
the upstream's calls and its model list through it.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

from pydantic import SecretStr
from yarl import URL

from proxy.config_base import USERINFO_CUT, Frozen, userinfo_cut

# Lower case first (an https upstream: https_proxy, then HTTPS_PROXY); the first set decides,
# even blank (``_first_set``). HTTP_PROXY is read, as Python's urllib and requests read it: curl
# ignores it, lest a CGI script take a request's ``Proxy:`` header for it ("httpoxy"), but this
# process's environment is its operator's, not a request's.
PROXY_VARIABLES = {"https": ("https_proxy", "HTTPS_PROXY"), "http": ("http_proxy", "HTTP_PROXY")}
NO_PROXY_VARIABLES = ("no_proxy", "NO_PROXY")
_DEFAULT_PORTS = {"https": 443, "http": 80}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class EgressProxy(Frozen):
    """An upstream's egress proxy as resolved at load: its address without credentials (those go
    as ``Proxy-Authorization``, never in a URL an error or a log might quote), and where it was
    named (the file's field or the variable), for a refusal to say."""

    url: str
    user: str | None = None
    password: SecretStr | None = None
    source: str


def proxy_url_parts(value: str) -> tuple[str, str | None, str | None]:
    """``value`` (an egress proxy's URL) as its address ``http://HOST:PORT`` and the user name and
    password it carries; ValueError in words that never quote them."""
    scheme = _SCHEME.match(value)
    if scheme is None:
        raise ValueError("invalid proxy URL: write it as http://HOST:PORT")
    if scheme[1].lower() != "http":
        # aiohttp speaks plain HTTP to a proxy, and tunnels an https upstream through it (CONNECT):
        # a SOCKS proxy, or TLS to the proxy itself, it does not.
        raise ValueError(
            f"invalid proxy URL: only http:// proxies are supported, not {scheme[1][:16].lower()}:// "
            "(an https upstream is still reached through one, tunnelled with CONNECT)"
        )
    if userinfo_cut(value):
        raise ValueError(f"invalid proxy URL: {USERINFO_CUT}")
    parts = urlsplit(value)
    address = parts.netloc.rpartition("@")[2]
    if not parts.hostname:
        raise ValueError("invalid proxy URL: it names no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(f"invalid proxy URL: http://{address} with no path, query or fragment")
    try:
        parts.port  # noqa: B018 (raises for a port that is not one)
    except ValueError:
        raise ValueError(f"invalid proxy URL: the port of {address!r} is not a port") from None
    try:
        URL(f"http://{address}").raw_host  # noqa: B018 (raises for a host with no IDNA form)
    except (ValueError, UnicodeError):
        raise ValueError(
            f"invalid proxy URL: the host {parts.hostname!r} cannot be sent (no IDNA form)"
        ) from None
    user = None if parts.username is None else unquote(parts.username)
    password = None if parts.password is None else unquote(parts.password)
    if user is not None and ":" in user:  # basic auth's separator: the rest would read as the password
        raise ValueError("invalid proxy URL: its user name holds ':' (%3A), which basic auth cannot carry")
    if not latin1(user or "") or not latin1(password or ""):
        raise ValueError(
            "invalid proxy URL: its user name or password has a character outside latin-1, which "
            "HTTP basic auth cannot carry"
        )
    return f"http://{address}", user, password


def latin1(text: str) -> bool:
    """Whether basic auth (``Proxy-Authorization``) can carry ``text``."""
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def from_environment(base_url: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The variable naming the egress proxy of an upstream at ``base_url``, and its value (as
    written: a value without a scheme is an http:// proxy's, as curl and requests read it), or
    None: none named, or ``no_proxy`` names the upstream."""
    parts = urlsplit(base_url)
    scheme = parts.scheme.lower()
    named = _first_set(PROXY_VARIABLES.get(scheme, ()), environ)
    if named is None or not named[1]:
        return None
    no_proxy = (_first_set(NO_PROXY_VARIABLES, environ) or ("", ""))[1]
    port = parts.port or _DEFAULT_PORTS.get(scheme, 80)
    if bypassed(no_proxy, parts.hostname or "", port):
        return None
    name, value = named
    return name, value if "://" in value else f"http://{value}"


def _first_set(names: tuple[str, ...], environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The first of ``names`` (lower case first) the environment sets, even blank, and its value
    stripped (blank: none), as Python's urllib reads them (``getproxies_environment``, which
    requests, aiohttp and httpx take): ``https_proxy=""`` is how an environment says no proxy
    over an ``HTTPS_PROXY`` it inherited (curl takes a blank variable as unset)."""
    return next(((name, environ[name].strip()) for name in names if name in environ), None)


def bypassed(no_proxy: str, host: str, port: int) -> bool:
    """Whether ``no_proxy`` names ``host`` (at ``port``), as curl reads it: entries apart by
    commas or spaces, ``*`` alone for every host, a name for itself and every name under it (a
    leading ``.`` or ``*.`` changes nothing; a Unicode name is its punycode), an IP address for
    itself, a CIDR block for the addresses in it (an IPv6 one bracketed or not: ``[fd00::]/8`` is
    ``fd00::/8``); with ``:PORT`` (Python's and Go's reading), at that port only. A loopback host
    is proxied unless named, as curl and requests do."""
    host = _idna(host.lower().strip("[]").rstrip("."))
    address = _ip(host)
    for entry in re.split(r"[,\s]+", no_proxy.lower()):
        if not entry:
            continue
        if entry == "*":
            return True
        name, entry_port = _entry_parts(entry)
        if entry_port is not None and entry_port != port:
            continue
        if "/" in name:
            try:
                network = ipaddress.ip_network(name, strict=False)
            except ValueError:  # no block: skipped, as curl skips it
                continue
            if address is not None and address.version == network.version and address in network:
                return True
            continue
        named_address = _ip(name)
        if named_address is not None:
            if address == named_address:
                return True
            continue
        name = _idna(name.removeprefix("*").lstrip(".").rstrip("."))
        if name and (host == name or host.endswith("." + name)):
            return True
    return False


def _entry_parts(entry: str) -> tuple[str, int | None]:
    """A ``no_proxy`` entry as its host (or block) and its port, if it names one."""
    if entry.startswith("["):  # [::1], [::1]:8080 or [fd00::]/8
        inside, _, rest = entry[1:].partition("]")
        if rest.startswith("/"):
            # A block written as a URL writes its address: read as the address alone, the rest
            # of the block went through the proxy.
            return inside + rest, None
        return inside, _port(rest[1:]) if rest.startswith(":") else None
    if entry.count(":") == 1:  # a name or an IPv4 address with a port (an IPv6 address has more)
        name, _, port = entry.partition(":")
        return name, _port(port)
    return entry, None


def _idna(name: str) -> str:
    """``name`` as its host is sent (yarl's IDNA, aiohttp's): a Unicode name (``bücher.de``) and
    its punycode (``xn--bcher-kva.de``) are one host, whichever form the URL or NO_PROXY wrote;
    as written when it has no such form."""
    if name.isascii():  # already the form sent: most names, left without the encoder's cost
        return name
    try:
        return URL.build(scheme="http", host=name).raw_host or name
    except (ValueError, UnicodeError):
        return name


def _port(text: str) -> int | None:
    # A port that is none matches no port (the entry is then skipped), not every one.
    return int(text) if text.isdecimal() and len(text) <= 5 else -1


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None
