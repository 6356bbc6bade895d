"""Configuration's shape: frozen pydantic models, validated as a whole.

The root ``Config`` and its small sections are here; a model's entry, the keys and the tiers are
in ``config_models``, ``config_keys`` and ``config_tiers``; their base model and the limits they
share in ``config_base``; the check of a Redis URL's options in ``config_redis``.

``config_load.load_config`` reads the file and the environment into a ``Config`` at start and on
reload; it is passed down explicitly.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import math
import re
import socket
import ssl
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from redis.asyncio.connection import parse_url
from yarl import URL

from proxy.config_base import (
    OTHER_MODEL,
    USERINFO_CUT,
    Frozen,
    Period,
    a_path_the_system_takes,
    not_a_bool,
    userinfo_cut,
)
from proxy.config_egress import EgressProxy, proxy_url_parts
from proxy.config_keys import AdminKeyConfig, KeyConfig
from proxy.config_models import ModelConfig
from proxy.config_redis import DB_INDEX_MAX, bad_value, not_for_a_cluster, unknown_option
from proxy.config_tiers import TierConfig
from proxy.config_tls import trust_context
from proxy.pricing import MAX_AMOUNT, OUTPUT_RATES, TOKENS_PER_MILLION
from proxy.store import DEFAULT_SETTLED_MARKER_TTL_S, MARKER_TRUST, MAX_SETTLED_MARKER_TTL_S

if TYPE_CHECKING:
    from proxy.forward import UpstreamSending
    from proxy.scopes import KeyScopes

# limits.ledger_retention_s, when set. At most ten years, as the other TTLs.
MIN_LEDGER_RETENTION_S = 24 * 3600
MAX_LEDGER_RETENTION_S = 10 * 366 * 24 * 3600
# Repeated key names a refusal names: a file of thousands pasted twice would say them all.
_NAMED_MOST = 5


class ListenConfig(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)


class RedisConfig(Frozen):
    url: str | None = None
    # Read the URL from this environment variable when set there (containers: REDIS_URL).
    url_env: str | None = None
    cluster: bool = False
    # The embedded default keeps its data (AOF) here.
    data_dir: Path = Path(".llm-billing-proxy/redis")
    pool_size: int = Field(default=64, ge=1)
    socket_timeout_s: float = Field(default=5.0, gt=0)

    @property
    def effective_socket_timeout_s(self) -> float:
        """The longest a store command waits. redis-py takes a ``socket_timeout`` in the URL's
        query over the ``socket_timeout_s`` the proxy passes it: over rediss:// and on a Cluster
        every command, lease renewals included, goes through redis-py. Over redis:// and unix://
        the proxy's own pipelined client runs the scripts (reserves, renewals, settles, the
        reaper's reads) and waits ``socket_timeout_s`` whatever the URL says, redis-py the rest:
        the longer of the two is in force (a shorter one in the URL hid the scripts' wait)."""
        in_url = self._url_socket_timeout_s()
        if in_url is None:
            return self.socket_timeout_s
        return in_url if self._redis_py_alone else max(in_url, self.socket_timeout_s)

    @property
    def socket_timeout_named(self) -> str:
        """Where ``effective_socket_timeout_s`` comes from, as an error names it."""
        in_url = self._url_socket_timeout_s()
        if in_url is None or (not self._redis_py_alone and in_url <= self.socket_timeout_s):
            return "redis.socket_timeout_s"
        return "the Redis URL's socket_timeout"

    @property
    def _redis_py_alone(self) -> bool:
        # As ``RedisStore.from_url`` chooses: no pipelined connection on a Cluster or over TLS.
        return self.cluster or (self.url is not None and self.url.startswith("rediss://"))

    def _url_socket_timeout_s(self) -> float | None:
        # As redis-py reads it: a float (the URL's check refused one that is not a time).
        timeout = parse_url(self.url).get("socket_timeout") if self.url is not None else None
        return float(timeout) if isinstance(timeout, int | float) else None

    @field_validator("data_dir")
    @classmethod
    def _data_dir_usable(cls, value: Path) -> Path:
        return a_path_the_system_takes(value)

    @field_validator("url")
    @classmethod
    def _url_scheme(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not re.match(r"^(redis|rediss|unix)://", value):
            raise ValueError("invalid Redis URL (expected redis://, rediss:// or unix://)")
        try:
            return cls._checked_url(value)
        except ValueError:
            # A password with an unescaped '/', '?' or '#' ends the address early: the rest of it
            # reads as the port, the database or an option, which the messages below quote.
            if userinfo_cut(value):
                raise ValueError(f"invalid Redis URL: {USERINFO_CUT}") from None
            raise

    @staticmethod
    def _checked_url(value: str) -> str:
        parts = urlsplit(value)
        try:
            parts.port  # noqa: B018 (raises for a port that is not one)
        except ValueError:
            # The host and port only: a password before them would go to stderr and the logs.
            where = parts.netloc.rpartition("@")[2]
            raise ValueError(f"invalid Redis URL: the port of {where!r} is not a port") from None
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("invalid Redis URL: unix:// needs the socket's path")
        # Options redis-py reads (TLS's for rediss://); one its connection does not take failed
        # every connection it made.
        unknown = unknown_option(parts.scheme, sorted(parse_qs(parts.query, keep_blank_values=True)))
        if unknown is not None:
            raise ValueError(f"invalid Redis URL: {unknown}")
        try:
            options: dict[str, Any] = dict(parse_url(value))
        except ValueError as err:
            raise ValueError(f"invalid Redis URL: {err}") from None
        bad = bad_value(parse_qs(parts.query))
        if bad is not None:
            raise ValueError(f"invalid Redis URL: {bad}")
        # Values that parse as numbers but that no connection can use: redis-py takes the URL's
        # options over the proxy's own (socket_timeout_s), and every command it sent then failed
        # (a timeout of 0 or less or NaN times out at once, a negative database, a protocol other
        # than RESP2/3, a read size of 0) after check-config said ok.
        for name in ("socket_timeout", "socket_connect_timeout", "timeout"):
            timeout = options.get(name)
            if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
                raise ValueError(f"invalid Redis URL: {name} must be a number of seconds above 0")
        # A pool of no connection waits for ever; a check of a connection's health every -5 s
        # (or NaN) runs before every command.
        if options.get("max_connections", 1) < 1:
            raise ValueError("invalid Redis URL: max_connections must be 1 or more")
        interval = options.get("health_check_interval", 0)
        if not (math.isfinite(interval) and interval >= 0):
            raise ValueError(
                "invalid Redis URL: health_check_interval must be a number of seconds, 0 or more"
            )
        if not 0 <= options.get("db", 0) <= DB_INDEX_MAX:
            raise ValueError(f"invalid Redis URL: db must be from 0 to {DB_INDEX_MAX} (a Redis has no more)")
        if options.get("protocol", 2) not in (2, 3):
            raise ValueError("invalid Redis URL: protocol must be 2 or 3")
        if options.get("socket_read_size", 1) < 1:
            raise ValueError("invalid Redis URL: socket_read_size must be 1 or more")
        db = parts.path.lstrip("/") if parts.scheme != "unix" else ""
        # Decimal digits, as int() reads them: redis-py leaves out a path it cannot read (the
        # database 0 used), and the proxy's own client raised out of serve.
        if db and not db.isdecimal():
            raise ValueError(f"invalid Redis URL: the database {db[:40]!r} is not a number")
        return value

    @model_validator(mode="after")
    def _a_cluster_redis_cluster_can_be(self) -> Self:
        # What redis-py's cluster client refuses when it is made: a traceback at serve, ledger
        # and report, after check-config said ok.
        # Without a url, one may come from url_env or --redis-url, which the file does not say:
        # the embedded server is refused where it would be started (cli.store_url, exit 2).
        if not self.cluster or self.url is None:
            return self
        if self.url.startswith("unix://"):
            raise ValueError(
                "cluster: true needs a redis:// or rediss:// url: a cluster is not reached over a unix socket"
            )
        db = parse_url(self.url).get("db")
        if db not in (None, 0, "0"):
            raise ValueError(f"cluster: true needs database 0 (a cluster has no other), not {db}")
        refused = ", ".join(not_for_a_cluster(parse_qs(urlsplit(self.url).query)))
        if refused:
            raise ValueError(f"cluster: true: redis-py's cluster client does not take {refused[:80]}")
        return self


class UpstreamConfig(Frozen):
    base_url: str
    # openai: Bearer auth, OpenAI endpoints. anthropic: x-api-key + anthropic-version, /messages.
    kind: Literal["openai", "anthropic"] = "openai"
    anthropic_version: str = "2023-06-01"
    api_key_env: str | None = None
    api_key: SecretStr | None = Field(default=None, exclude=True)
    timeout_s: float = Field(default=600.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # Pass the caller's own bearer key upstream (the zero-config ``--upstream`` mode).
    passthrough_auth: bool = False
    # Where a chat call's output cap goes: OpenAI's field, or the older one that many
    # OpenAI-compatible servers read alone (one that ignores the cap would write past the
    # reserve; one that refuses unknown fields would fail every call).
    chat_output_cap_field: Literal["max_completion_tokens", "max_tokens"] = "max_completion_tokens"
    # Whether a chat or legacy completion stream is sent stream_options.include_usage: off for a
    # server that refuses the field (Mistral's API: 422, every stream failed) and tells its usage
    # unasked; a stream that then tells none is billed on a count of its text.
    stream_usage_option: bool = True
    # The egress proxy (http://HOST:PORT) its calls go through. Unset: the environment's
    # (HTTPS_PROXY...: ``config_egress``); null or "": none, whatever the environment says.
    # Neither shown nor dumped: its URL may hold the proxy's password (``egress`` keeps it secret).
    proxy: str | None = Field(default=None, repr=False, exclude=True)
    # The variable holding the proxy's USER:PASSWORD: its password out of the file.
    proxy_auth_env: str | None = None
    # The proxy in force, resolved at load (``config_load``) from the file and the environment.
    egress: EgressProxy | None = Field(default=None, exclude=True)
    # A PEM file of the CAs its TLS certificate is verified against, instead of the system's
    # (``config_tls``): a private CA's, or an egress proxy's that re-signs what it tunnels.
    ca_file: Path | None = None
    # That file's certificates, read and checked at load (``config_load``); their context is
    # ``ca_context``.
    ca_pem: str | None = Field(default=None, exclude=True, repr=False)

    @cached_property
    def ca_context(self) -> ssl.SSLContext | None:
        """The context of ``ca_file``'s CAs: built once per config in each process (never per
        call: a context built blocks the loop while it reads its CAs), never pickled
        (``Frozen.__getstate__``: a worker builds its own)."""
        return None if self.ca_pem is None else trust_context(self.ca_pem)

    @field_validator("ca_file", mode="before")
    @classmethod
    def _a_file_named(cls, value: Any) -> Any:
        if value == "":
            # Path("") is the working directory: said as what it is, not as a directory unread.
            raise ValueError("an empty path: name a PEM file, or leave ca_file out for the system's CAs")
        return value

    @field_validator("ca_file")
    @classmethod
    def _a_path(cls, value: Path | None) -> Path | None:
        return None if value is None else a_path_the_system_takes(value)

    @model_validator(mode="after")
    def _ca_file_for_tls(self) -> Self:
        if self.ca_file is not None and not self.base_url.lower().startswith("https:"):
            # Nothing would be verified against it: a base_url written http:// by mistake sends
            # the key in clear to whatever answers, which a CA named here must not seem to guard.
            raise ValueError("ca_file: the CAs of an https:// upstream; its base_url is http://")
        return self

    @field_validator("proxy")
    @classmethod
    def _http_proxy(cls, value: str | None) -> str | None:
        if value:
            proxy_url_parts(value)
        return value

    @model_validator(mode="after")
    def _proxy_credentials(self) -> Self:
        if self.proxy_auth_env and not self.proxy:
            raise ValueError(
                "proxy_auth_env: names the credentials of the upstream's own proxy: give proxy too "
                "(an environment's proxy carries its credentials in its URL)"
            )
        if self.proxy_auth_env and self.proxy and urlsplit(self.proxy).netloc.count("@"):
            raise ValueError("proxy: credentials in the URL and proxy_auth_env cannot go together")
        return self

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^\s/]+", value):
            raise ValueError("invalid URL")
        if userinfo_cut(value):
            # Never quoted (the rest of the password would read as the port), nor taken as it
            # reads: a numeric start of the password as the port, the call (and its key) to the
            # host named by the user name.
            raise ValueError(f"invalid URL: {USERINFO_CUT}")
        parts = urlsplit(value)
        # The endpoint's path is appended to base_url: a query or fragment would swallow it
        # (``...?api-version=1/chat/completions``: every call to the wrong path upstream).
        if parts.query or parts.fragment or "?" in value or "#" in value:
            raise ValueError("invalid URL: no query or fragment (the endpoint's path is appended to it)")
        try:
            parts.port  # noqa: B018 (raises for a port that is not one)
        except ValueError:
            raise ValueError(
                f"invalid URL: the port of {parts.netloc.rpartition('@')[2]!r} is not a port"
            ) from None
        # What aiohttp would refuse when a call is sent (every call a 502): said now, by
        # check-config, and never in words that quote the password.
        try:
            URL(value).raw_host  # noqa: B018 (raises for a host with no IDNA form)
        except (ValueError, UnicodeError):
            raise ValueError(
                f"invalid URL: the host {parts.hostname!r} cannot be sent (no IDNA form)"
            ) from None
        try:
            unquote(parts.username or "").encode("latin-1")
            unquote(parts.password or "").encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError(
                "invalid URL: its user name or password has a character outside latin-1, "
                "which HTTP basic auth cannot carry"
            ) from None
        return value.rstrip("/")

    @model_validator(mode="after")
    def _one_credential(self) -> Self:
        # aiohttp refuses a request carrying both the URL's credentials and an Authorization
        # header: every call was a 502 before it went out. An Anthropic upstream's key goes as
        # x-api-key: beside a gateway's basic auth in the URL, both are sent.
        if (
            self.kind == "openai"
            and urlsplit(self.base_url).username is not None
            and (self.api_key_env or self.passthrough_auth)
        ):
            raise ValueError(
                "base_url: credentials in the URL and a key sent as a header (api_key_env, "
                "passthrough_auth) cannot go together"
            )
        return self

    @cached_property
    def sending(self) -> UpstreamSending:
        """What every call to this upstream sends alike (its headers, timeouts, the operator's
        secrets), worked out once per config."""
        from proxy.forward import UpstreamSending  # forward reads this module: imported when first used

        return UpstreamSending.of(self)


def _tenants(names: list[str]) -> str:
    if len(names) == 1:
        return f"tenant {names[0]}"
    # A name reused across a thousand tenants is told by its first few, not a line of them all.
    more = f" and {len(names) - _NAMED_MOST} more" if len(names) > _NAMED_MOST else ""
    return f"tenants {', '.join(names[:_NAMED_MOST])}{more}"


_ANYWHERE = frozenset({"0.0.0.0", "::", ""})
_LOOPBACK = {"localhost": frozenset({"127.0.0.1", "::1"})}


def _as_resolved(host: str) -> str:
    """The host as the resolver reads it, asked of no server: a numeric address in its one
    form (``0`` is 0.0.0.0, ``127.1`` 127.0.0.1, ``::0001`` ::1), a name in lower case (names
    are read in any case: ``LOCALHOST`` is localhost)."""
    if host == "":
        return host
    try:
        # AI_NUMERICHOST: a name is refused, not looked up.
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError, ValueError):
        return host.lower()
    return str(found[0][4][0])


def _overlap(host: str, other: str) -> bool:
    """Whether a listener on ``host`` and one on ``other`` (same port) would take an address
    both: a wildcard takes every one, ``localhost`` its loopback addresses."""
    host, other = _as_resolved(host), _as_resolved(other)
    if host in _ANYWHERE or other in _ANYWHERE:
        return True
    return bool(_LOOPBACK.get(host, {host}) & _LOOPBACK.get(other, {other}))


class MetricsConfig(Frozen):
    # A separate address for Prometheus (no auth there: bind it where only scrapers reach).
    # On the main port /metrics needs an admin key.
    listen: ListenConfig | None = None


class PolicyConfig(Frozen):
    on_truncate: Literal["pass", "reject"] = "pass"
    on_invalid_json: Literal["pass", "reject"] = "pass"
    on_client_disconnect: Literal["drain", "cancel"] = "drain"


class LimitsConfig(Frozen):
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    # A request's body must arrive whole this long after the handler starts reading it, else
    # 408: a client that stalls (or whose chunked framing broke, which aiohttp never fails the
    # read for) would hold its connection and handler for ever. Nothing is reserved by then.
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    # All request header names and values together; larger requests get 431.
    max_header_bytes: int = Field(default=16 * 1024, ge=1024, le=60 * 1024)
    max_upstream_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Reserved for output when neither the request nor the model config caps it. At most a
    # count a provider may tell (``observe.MAX_SANE_TOKENS``): past the store's counts, every call
    # without a cap of its own was refused for the reserve of a cap the config set.
    default_max_output_tokens: int = Field(default=4096, ge=1, le=10**12)
    # Calls reserved for each priced hosted tool a request enables without a bound of its own
    # (Anthropic's max_uses, the Responses API's max_tool_calls): see ``tool_fees``.
    default_max_tool_calls: int = Field(default=10, ge=0, le=1_000_000)
    # A settled reservation leaves a marker this long: a second settle is recognised and changes
    # nothing, and within most of it a settle still bills a call whose reservation was lost.
    # At most ten years: settle.lua's EXPIRE of a marker past what Redis takes failed every
    # settle after its writes (each journaled, its marker kept for good).
    settled_marker_ttl_s: int = Field(
        default=DEFAULT_SETTLED_MARKER_TTL_S, ge=60, le=MAX_SETTLED_MARKER_TTL_S
    )
    # How long the size of a stored Responses context (an answer, a conversation) is kept for
    # the reserve of a call that continues it (0: not kept, such calls reserve their request).
    prior_context_ttl_s: int = Field(default=3600, ge=0, le=30 * 24 * 3600)
    # Token counts of long prompt texts are remembered, bounded by the characters kept (0: off).
    token_count_cache_chars: int = Field(default=8 * 1024 * 1024, ge=0)
    # Much new prompt text is reserved at its UTF-8 bytes at once and counted while the call runs
    # (false: counted before the reserve, on the estimate thread; the call waits for it).
    quick_estimates: bool = True
    lease_margin_s: float = Field(default=30.0, gt=0)
    # A run's meters and ledger index expire this long after its last call (every reserve and
    # settle pushes it back): a call without X-Run-Id is a run of its own, and its keys must not
    # stay for ever. 0: runs are kept for ever. The tenant ledger does not expire with them (below).
    run_ttl_s: int = Field(default=7 * 24 * 3600, ge=0, le=10 * 366 * 24 * 3600)
    # Every settle trims its tenant's ledger of entries older than this (0: every entry kept for
    # ever): about 260 bytes of Redis a call otherwise stay for good. Read at start only (the
    # store's), so that a reaper's or a journal's settle trims by the same setting as a call's.
    ledger_retention_s: int = 0

    @field_validator("default_max_output_tokens", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any) -> Any:
        # YAML's yes/on/true would be 1: every call without a cap of its own capped at 1 token.
        return not_a_bool(value)

    @field_validator("default_max_tool_calls", mode="before")
    @classmethod
    def _calls_not_a_bool(cls, value: Any) -> Any:
        # YAML's no/off/false would be 0: searches never reserved, a cost ceiling passed by them.
        return not_a_bool(value, "a count of calls")

    @field_validator("run_ttl_s")
    @classmethod
    def _run_outlives_its_calls(cls, value: int) -> int:
        # Shorter, a run's keys could expire under a call still in flight.
        if 0 < value < 3600:
            raise ValueError("0 (runs kept for ever) or at least 3600 seconds")
        return value

    @field_validator("ledger_retention_s")
    @classmethod
    def _a_day_of_ledger_at_least(cls, value: int) -> int:
        # A day at least: shorter, entries could go before a day's export or report read them.
        if value != 0 and not MIN_LEDGER_RETENTION_S <= value <= MAX_LEDGER_RETENTION_S:
            raise ValueError(
                f"0 (every ledger entry kept for ever) or a whole number of seconds from "
                f"{MIN_LEDGER_RETENTION_S} (a day) to {MAX_LEDGER_RETENTION_S} (ten years)"
            )
        return value

    reaper_interval_s: float = Field(default=5.0, gt=0)
    journal_replay_s: float = Field(default=1.0, gt=0)
    # A lease is reaped (billed at its reserve) only this long after it ran out, and after the
    # reaper reached the store again: time for the journal of a process that lost its store
    # mid-call to bill the call's real figures first (a replay, plus a socket timeout at worst).
    reap_grace_s: float = Field(default=10.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _grace_outlasts_a_replay(self) -> Self:
        if 0 < self.reap_grace_s <= self.journal_replay_s:
            raise ValueError(
                "reap_grace_s must be longer than journal_replay_s (or 0: leases reaped as soon as "
                "they run out), or a reaper bills at their reserve calls a journal holds"
            )
        if self.reap_grace_s and self.reaper_interval_s > self.reap_grace_s - self.journal_replay_s:
            # A reaper learns of an outage only by a round that meets it: one shorter than its
            # interval goes unseen, and its first round after it would bill at their reserve the
            # calls whose leases ran out meanwhile, before their journals landed.
            raise ValueError(
                "reaper_interval_s must be at most reap_grace_s - journal_replay_s (or reap_grace_s "
                "0): a reaper that sleeps through an outage would bill at their reserve calls a "
                "journal holds; raise reap_grace_s for a rarer reaper"
            )
        return self


class LogConfig(Frozen):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "text"] = "json"


EventLoopChoice = Literal["auto", "uvloop", "asyncio"]


class Config(Frozen):
    listen: ListenConfig = ListenConfig()
    log: LogConfig = LogConfig()
    redis: RedisConfig = RedisConfig()
    upstreams: dict[str, UpstreamConfig]
    models: dict[str, ModelConfig] = Field(default_factory=lambda: {"*": ModelConfig(upstream="openai")})
    keys: tuple[KeyConfig, ...] = ()
    admin_keys: tuple[AdminKeyConfig, ...] = ()
    metrics: MetricsConfig = MetricsConfig()
    policy: PolicyConfig = PolicyConfig()
    tiers: dict[str, TierConfig] = Field(default_factory=lambda: {"standard": TierConfig()})
    limits: LimitsConfig = LimitsConfig()
    currency: str = "USD"
    # Settlements the store could not take wait here (one file per process) until it is back.
    journal_dir: Path = Path(".llm-billing-proxy/journal")
    # On SIGTERM: in-flight calls get this long to finish; the rest are ended and settled.
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # The serving processes' event loop (start-only): auto is uvloop where it is installed.
    event_loop: EventLoopChoice = "auto"
    # Secrets resolved at load time: sha256 digests of keys given by env var.
    key_digests: tuple[tuple[str, KeyConfig], ...] = Field(default=(), exclude=True)
    admin_digests: tuple[str, ...] = Field(default=(), exclude=True)

    @field_validator("journal_dir")
    @classmethod
    def _journal_dir_usable(cls, value: Path) -> Path:
        return a_path_the_system_takes(value)

    @field_validator("event_loop")
    @classmethod
    def _loop_installed(cls, value: EventLoopChoice) -> EventLoopChoice:
        if value == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ValueError("uvloop is not installed here (pip install uvloop), or say auto or asyncio")
        return value

    @model_validator(mode="after")
    def _references(self) -> Config:
        scrape = self.metrics.listen
        main = self.listen
        if scrape is not None and scrape.port == main.port != 0 and _overlap(scrape.host, main.host):
            # serve would bind it first, then fail its own port as if another process held it.
            raise ValueError(
                f"metrics.listen: port {scrape.port} is the main listen port: give the metrics their own"
            )
        for pattern, model in self.models.items():
            if model.upstream not in self.upstreams:
                raise ValueError(f"models.{pattern}.upstream: unknown upstream {model.upstream!r}")
        if OTHER_MODEL in self.models:
            raise ValueError(
                f"models.{OTHER_MODEL}: the name is reserved (the metrics' label for models the config "
                "does not name): route it with a pattern or name the model otherwise"
            )
        tenants_of: dict[str, list[str]] = {}
        for key in self.keys:
            tenants_of.setdefault(key.name, []).append(key.tenant)
        repeated = [(name, tenants) for name, tenants in tenants_of.items() if len(tenants) > 1]
        if repeated:
            # Which, else the operator searches thousands of keys for it, and its tenants, to
            # tell the entries apart; never a key's secret or digest (a refusal goes to the log).
            said = "; ".join(
                f"{name} names {len(tenants)} keys ({_tenants(list(dict.fromkeys(tenants)))})"
                for name, tenants in repeated[:_NAMED_MOST]
            )
            more = f"; and {len(repeated) - _NAMED_MOST} names more" if len(repeated) > _NAMED_MOST else ""
            raise ValueError(f"keys: names must be unique: {said}{more}")
        for key in self.keys:
            if key.tier not in self.tiers:
                # Else every call of the key is refused (403 unknown_tier), found only by its
                # callers: a file with tiers of its own drops the default ``standard`` that a key
                # without ``tier`` names.
                defined = ", ".join(self.tiers) or "none"
                raise ValueError(
                    f"keys.{key.name}.tier: no tier {key.tier!r} in tiers ({defined}): name one of them, "
                    "or define it"
                )
        run_ttl_s = self.limits.run_ttl_s
        for name, upstream in self.upstreams.items():
            # A non-streaming call does not renew its reservation (a stream does): the run's keys
            # must outlive its lease, or its reserve and the run's past spend expire under it.
            lease_s = upstream.timeout_s + self.limits.lease_margin_s
            if run_ttl_s and run_ttl_s <= lease_s:
                raise ValueError(
                    f"limits.run_ttl_s ({run_ttl_s}) must be 0 (runs kept for ever) or longer than "
                    f"upstreams.{name}.timeout_s plus limits.lease_margin_s ({lease_s:g} s): a run's "
                    "meters would expire under a call still in flight"
                )
        too_short = self.settled_marker_too_short(self.limits.settled_marker_ttl_s)
        if too_short is not None:
            raise ValueError(too_short)
        too_long = self.socket_timeout_too_long(
            self.redis.effective_socket_timeout_s, named=self.redis.socket_timeout_named
        )
        if too_long is not None:
            raise ValueError(too_long)
        self._grace_outlasts_a_stuck_settle()
        for pattern, model in self.models.items():
            self._output_cap_fits_the_store(pattern, model)
        return self

    def _output_cap_fits_the_store(self, pattern: str, model: ModelConfig) -> None:
        """A call sending no cap of its own is reserved at its model's (else the default) cap at
        the dearest output price: past what the store holds, every such call was refused and
        told to lower a max_tokens it never sent."""
        cap = model.max_output_tokens or self.limits.default_max_output_tokens
        tables = [*model.priced_tiers.values(), *model.long_priced_tiers.values()]
        # Every price an answer's output may be billed at: a chat call asking for images is
        # reserved at the image output price too (``pricing.worst_rates``).
        kinds = (*OUTPUT_RATES, "image_output")
        top_rate = max((table[kind] for table in tables for kind in kinds), default=0)
        if cap * top_rate > MAX_AMOUNT * TOKENS_PER_MILLION:
            field = "limits.default_max_output_tokens"
            if model.max_output_tokens:
                field = f"models.{pattern}.max_output_tokens"
            raise ValueError(
                f"{field} ({cap}) at models.{pattern}'s dearest output price is past the most a "
                f"reserve holds ({MAX_AMOUNT} micro-units): every call without a cap of its own would "
                "be refused; lower the cap"
            )

    def settled_marker_too_short(self, settled_marker_ttl_s: int) -> str | None:
        """Why settled markers kept ``settled_marker_ttl_s`` leave calls of this config unbilled
        (None: they do not). A settle bills a call whose reservation the store lost (a failover)
        only within ``MARKER_TRUST`` of the marker's life after Redis last confirmed its lease
        (``settle.bill_if_lost_until_ms``): a whole answer's call confirms it once, at its
        reserve, and settles at most its lease later; a stream renews it every third of that."""
        slowest = max(self.upstreams.items(), key=lambda named: named[1].timeout_s, default=None)
        if slowest is None:
            return None
        name, upstream = slowest
        lease_s = upstream.timeout_s + self.limits.lease_margin_s
        if settled_marker_ttl_s * MARKER_TRUST >= lease_s:
            return None
        least_s = math.ceil(lease_s / MARKER_TRUST)
        while least_s * MARKER_TRUST < lease_s:  # the quotient rounded below what it must be
            least_s += 1
        return (
            f"limits.settled_marker_ttl_s ({settled_marker_ttl_s}) must be at least {least_s} s: a "
            f"call may take upstreams.{name}.timeout_s plus limits.lease_margin_s ({lease_s:g} s), "
            f"and one taking longer than {MARKER_TRUST:.0%} of the marker's life, its reservation "
            "lost in a store failover, goes unbilled; raise it, or lower those"
        )

    def socket_timeout_too_long(
        self, socket_timeout_s: float, *, named: str = "redis.socket_timeout_s"
    ) -> str | None:
        """Why a store whose commands wait up to ``socket_timeout_s`` lets this config's calls be
        reaped alive (None: it does not). A stream renews its lease every third of it
        (``lease.LeaseRenewal``). A Redis that stalls for less than the socket timeout (a fork, a
        slow disk, a long script) fails no command, so no outage is seen (nothing journaled, no
        reaper's grace started again): a renewal it holds lands when the stall ends, up to a socket
        timeout after it was sent, and past the two thirds of the lease left it lands after the
        lease ran out, which renew.lua refuses; a reaper then bills the live call at its reserve."""
        shortest = min(self.upstreams.items(), key=lambda named: named[1].timeout_s, default=None)
        if shortest is None:
            return None
        name, upstream = shortest
        lease_s = upstream.timeout_s + self.limits.lease_margin_s
        if 3 * socket_timeout_s < 2 * lease_s:  # not socket_timeout_s < lease_s * 2 / 3: no rounding
            return None
        return (
            f"{named} ({socket_timeout_s:g}) must be below two thirds of the shortest "
            f"lease: upstreams.{name}.timeout_s plus limits.lease_margin_s ({lease_s:g} s) gives "
            f"{lease_s * 2 / 3:g} s. A stream renews its lease every third of it, and a Redis that "
            "stalls for less than the socket timeout (a fork, a slow disk) fails no command: the "
            "renewals it holds land after the lease ran out, and a reaper bills the live call at its "
            f"reserve; lower {named} below {lease_s * 2 / 3:g} s, or raise those to "
            f"more than {socket_timeout_s * 3 / 2:g} s"
        )

    def _grace_outlasts_a_stuck_settle(self) -> None:
        """A settle sent as the store went away (a host gone, a partition) fails only after the
        socket timeout, and is journaled then; the journal applies it at its next replay. A
        reaper's grace runs from the store's first answer, which may come at once: shorter than
        both, it bills at its reserve a call the journal holds."""
        limits = self.limits
        worst_s = limits.journal_replay_s + self.redis.effective_socket_timeout_s
        if 0 < limits.reap_grace_s <= worst_s:
            raise ValueError(
                f"limits.reap_grace_s ({limits.reap_grace_s:g}) must be longer than "
                f"limits.journal_replay_s plus {self.redis.socket_timeout_named} ({worst_s:g} s), or 0: "
                "a settle the store stopped answering is journaled only after the socket timeout and applied "
                "at the journal's next replay, and a reaper whose grace ran out first bills the call "
                f"at its reserve; raise reap_grace_s above {worst_s:g} s, or lower those"
            )

    def build_ca_contexts(self) -> None:
        """Each upstream's ``ca_context`` built here, on the thread calling (a reload's, which
        loaded the file; at start, one before serving), not at the upstream's first call on the
        event loop: a context of the system's bundle blocks the thread building it for about
        17 ms. Not built at load and kept as a field: the config would not pickle (``Frozen``)."""
        for upstream in self.upstreams.values():
            _ = upstream.ca_context

    @cached_property
    def longest_lease_s(self) -> float:
        """The longest lease a call of this config writes: its slowest upstream's ``timeout_s``
        and the margin (read on every call: ``reaper.registration_s``)."""
        slowest_s = max((upstream.timeout_s for upstream in self.upstreams.values()), default=0.0)
        return slowest_s + self.limits.lease_margin_s

    @cached_property
    def tenants(self) -> frozenset[str]:
        return frozenset(key.tenant for key in self.keys)

    @cached_property
    def _tenant_periods(self) -> dict[str, tuple[frozenset[Period], frozenset[Period]]]:
        named: dict[str, set[Period]] = {}
        limited: dict[str, set[Period]] = {}
        for key in self.keys:
            tier = self.tiers.get(key.tier)
            windows = tier.tenant if tier is not None else ()
            named.setdefault(key.tenant, set()).update(w.period for w in windows)
            limited.setdefault(key.tenant, set()).update(w.period for w in windows if w.meters)
        return {tenant: (frozenset(named[tenant]), frozenset(limited[tenant])) for tenant in named}

    @cached_property
    def key_scopes(self) -> KeyScopes:
        """Where the scopes of this config's keys are kept, with room for each of them: a
        reload's config starts its own, its tiers' ceilings in them."""
        from proxy.scopes import KeyScopes  # scopes reads this module: imported when first used

        return KeyScopes(len(self.keys))

    def tenant_periods(self, tenant: str) -> tuple[frozenset[Period], frozenset[Period]]:
        """The periods of this tenant's windows that the tier of one of its keys names, and
        those it limits. Every key of the tenant counts in the first (a tenant window is all
        its keys, whatever a key's own tier names) and holds its calls' reserves in the second
        (else a key of another tier spends around the ceiling unseen while in flight)."""
        return self._tenant_periods.get(tenant, (frozenset(), frozenset()))

    def key_for_digest(self, digest: str) -> KeyConfig | None:
        """The key whose secret has this SHA-256 digest: one lookup whatever the number of keys.
        A lookup's timing can depend on the digest it is given, never on a secret's bytes: the
        caller cannot choose a digest's bytes without the key that makes them."""
        return self._keys_by_digest.get(digest)

    @cached_property
    def _keys_by_digest(self) -> dict[str, KeyConfig]:
        return dict(self.key_digests)

    def route(self, model: str) -> tuple[str, ModelConfig] | None:
        """The config entry for a model: an exact name first, then globs in file order."""
        entry = self.models.get(model)
        if entry is not None:
            return model, entry
        for pattern, entry in self._globs:
            if fnmatch.fnmatchcase(model, pattern):
                return pattern, entry
        return None

    @cached_property
    def _globs(self) -> tuple[tuple[str, ModelConfig], ...]:
        """The model entries whose names are patterns, in file order: a name without ``*?[``
        matches only itself, which the exact lookup found first. Walked on every call to a model
        no entry names (hundreds of fnmatch calls a call, in a config of hundreds of models)."""
        return tuple((name, entry) for name, entry in self.models.items() if any(c in name for c in "*?["))

    def policy_for(self, tier: str) -> PolicyConfig:
        found = self._tier_policies.get(tier)
        return self.policy if found is None else found

    @cached_property
    def _tier_policies(self) -> dict[str, PolicyConfig]:
        """Each tier's policy, merged once per config rather than on every call."""
        policies = {}
        for name, tier in self.tiers.items():
            changes = {k: v for k, v in tier.policy.model_dump().items() if v is not None}
            policies[name] = self.policy.model_copy(update=changes) if changes else self.policy
        return policies
