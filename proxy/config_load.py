"""Reading the configuration: the one place that reads the YAML file and the environment.

``load_config`` is called at start and on reload; secrets named by ``*_env`` fields are read from
the environment here and nowhere else. The shapes are in ``config``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import SecretStr, ValidationError

from proxy.config import Config, ListenConfig, RedisConfig, UpstreamConfig
from proxy.config_egress import EgressProxy, from_environment, latin1, proxy_url_parts
from proxy.config_keys import AdminKeyConfig, KeyConfig
from proxy.config_tls import trusted_pem
from proxy.errors import ConfigError

log = logging.getLogger("proxy.config")


def _bare(mark: yaml.Mark) -> yaml.Mark:
    return yaml.Mark(mark.name, mark.index, mark.line, mark.column, None, 0)


# YAML 1.1 (PyYAML's) reads a number with a leading 0 as octal (010: 8) and one with colons as
# base 60 (1:30: 90): a ceiling, a price or a cap no one wrote.
_OCTAL = re.compile(r"[-+]?0[0-9_]+")


def _refuse_another_figure(node: yaml.ScalarNode) -> None:
    text = str(node.value)
    if ":" in text or _OCTAL.fullmatch(text):
        read = "a base-60 number" if ":" in text else "an octal number"
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"{text} is {read} in YAML 1.1, not the figure it looks like: write it without the "
            "leading 0 or the colons (or quote it, for a string)",
            _bare(node.start_mark),
        )


def _refuse_a_rounded_float(node: yaml.ScalarNode, value: float) -> None:
    # A float keeps about 17 digits: 2.5000000000000001 was read as 2.5, and a price or a cost
    # past 6 decimal places passed the check made of what was read, billed at another figure.
    text = str(node.value).replace("_", "")
    try:
        written = Decimal(text)
    except InvalidOperation:  # .inf, .nan: no digits to lose
        return
    if written != Decimal(repr(value)):
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"{text} has more digits than a YAML number keeps (read as {value!r}, not the figure "
            "written): write fewer (a price or a cost has at most 6 decimal places)",
            _bare(node.start_mark),
        )


class _UniqueKeys(yaml.constructor.SafeConstructor):
    """YAML's safe constructor, refusing a key written twice in one mapping: PyYAML keeps the last
    silently (a second ``standard:`` tier, a second ``limits:``, would drop the first's
    ceilings unseen). Keys a merge (``<<: *anchor``) brings in may still be overridden.

    Checked as each mapping is first flattened, before its merges are written into it: a merge
    elsewhere flattens an anchored mapping in place (its merged keys in front of its own), at
    times before that mapping is constructed, and its own overrides would then read as keys
    written twice."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)  # type: ignore[call-arg]  # the parser's, next in a loader's order
        self._checked: set[int] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the constructor reports it
                    continue
                if duplicate:
                    # Where, not what: the line's text (a snippet) would quote the value beside
                    # the key, a URL's password among them.
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        _bare(node.start_mark),
                        f"found duplicate key {key!r}",
                        _bare(key_node.start_mark),
                    )
        super().flatten_mapping(node)


class _CUniqueKeyLoader(_UniqueKeys, yaml.CSafeLoader):
    """libyaml's parser under ``_UniqueKeys``' constructor: the file read about 10 times faster
    than by PyYAML's pure-Python parser (a reload of thousands of keys took seconds)."""


class _PyUniqueKeyLoader(_UniqueKeys, yaml.SafeLoader):
    """``_CUniqueKeyLoader`` where PyYAML was built without libyaml."""


def _construct_int(loader: _CUniqueKeyLoader | _PyUniqueKeyLoader, node: yaml.ScalarNode) -> int:
    _refuse_another_figure(node)
    return int(yaml.constructor.SafeConstructor.construct_yaml_int(loader, node))


def _construct_float(loader: _CUniqueKeyLoader | _PyUniqueKeyLoader, node: yaml.ScalarNode) -> float:
    _refuse_another_figure(node)
    value = float(yaml.constructor.SafeConstructor.construct_yaml_float(loader, node))
    _refuse_a_rounded_float(node, value)
    return value


_CUniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_CUniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)
_PyUniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_PyUniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)

_UniqueKeyLoader = _CUniqueKeyLoader if yaml.__with_libyaml__ else _PyUniqueKeyLoader


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(part) for part in item["loc"]) or "config"
        message = str(item["msg"]).removeprefix("Value error, ")
        lines.append(f"{where}: {message}")
    return "; ".join(lines)


def parse_config(
    raw: Any, environ: Mapping[str, str], *, key_secrets: bool = True, warnings: list[str] | None = None
) -> Config:
    """Validate a parsed YAML document and resolve the secrets it names from ``environ``.
    Without ``key_secrets`` (the ledger and report commands, which read only the store) the
    proxy keys' and admin keys' secrets are not read: no call is authenticated with it.
    ``warnings``: where the load's warnings go, for a caller whose logging is not set up yet to
    log them once it is (``log_warnings``); None: logged at once."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("config: the top level must be a mapping")
    try:
        config = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None

    redis = config.redis
    if redis.url_env and environ.get(redis.url_env):
        try:
            redis = RedisConfig.model_validate({**redis.model_dump(), "url": environ[redis.url_env]})
        except ValidationError as err:
            raise ConfigError(f"redis.url_env ({redis.url_env}): " + _format_validation_error(err)) from None
        # The Config's checks ran on the file's url: the one in force may name a socket_timeout.
        config = cross_checked(config.model_copy(update={"redis": redis}), f"redis.url_env ({redis.url_env})")
    upstreams = {}
    for name, upstream in config.upstreams.items():
        key = _secret(f"upstreams.{name}.api_key_env", upstream.api_key_env, environ)
        if upstream.api_key_env and not key and key_secrets:
            # Not refused (a variable set later for a reload), but every call to the upstream is
            # answered a 502 upstream_auth, not forwarded (``forward.operator_key_unset``).
            variable = f"upstreams.{name}.api_key_env: {upstream.api_key_env}"
            said = f"{variable} is not set: its calls are refused (502 upstream_auth)"
            if warnings is None:
                log.warning(said)
            else:
                warnings.append(said)
        update: dict[str, object] = {"api_key": SecretStr(key) if key else None}
        if key_secrets:  # the ledger and report commands call no upstream
            update["egress"] = _egress(name, upstream, environ, warnings)
            if upstream.ca_file is not None:
                # Read at every load: a reload with the same path takes the file as it is now.
                try:
                    update["ca_pem"] = trusted_pem(upstream.ca_file)
                except ValueError as err:
                    raise ConfigError(f"upstreams.{name}.ca_file: {upstream.ca_file}: {err}") from None
        upstreams[name] = upstream.model_copy(update=update)
    if not key_secrets:
        return config.model_copy(update={"redis": redis, "upstreams": upstreams})
    digests = [(_digest("keys", key, environ), key) for key in config.keys]
    named: dict[str, str] = {}
    for digest, key_config in digests:
        if digest in named:
            # One secret, two keys: which tenant and tier it bills would depend on file order.
            raise ConfigError(f"keys.{key_config.name}: the same secret as keys.{named[digest]}")
        named[digest] = key_config.name
    admin = tuple(_digest("admin_keys", key, environ) for key in config.admin_keys)
    for digest, admin_key in zip(admin, config.admin_keys, strict=True):
        if digest in named:
            # The tenant holding it would read /metrics: every tenant's spend.
            raise ConfigError(f"admin_keys.{admin_key.name}: the same secret as keys.{named[digest]}")
    return config.model_copy(
        update={"redis": redis, "upstreams": upstreams, "key_digests": tuple(digests), "admin_digests": admin}
    )


def _egress(
    name: str, upstream: UpstreamConfig, environ: Mapping[str, str], warnings: list[str] | None
) -> EgressProxy | None:
    """The egress proxy ``upstream``'s calls go through: its own ``proxy`` (null or "": none),
    else the one the environment names for it (``config_egress.from_environment``)."""
    if "proxy" in upstream.model_fields_set:
        if not upstream.proxy:
            return None
        url, user, password = proxy_url_parts(upstream.proxy)  # checked with the file
        field = f"upstreams.{name}.proxy_auth_env"
        credentials = _secret(field, upstream.proxy_auth_env, environ)
        if upstream.proxy_auth_env and not credentials:
            # As an unset api_key_env: said, not refused; the proxy's 407 then fails each call
            # before it goes out (nothing billed).
            said = f"{field}: {upstream.proxy_auth_env} is not set: calls go to the proxy without credentials"
            if warnings is None:
                log.warning(said)
            else:
                warnings.append(said)
        elif credentials:
            user, colon, password = credentials.partition(":")
            if not colon:
                raise ConfigError(
                    f"{field}: environment variable {upstream.proxy_auth_env} must hold USER:PASSWORD"
                )
            if not (latin1(user) and latin1(password)):
                raise ConfigError(
                    f"{field}: environment variable {upstream.proxy_auth_env} has a character outside "
                    "latin-1, which HTTP basic auth cannot carry"
                )
        source = f"upstreams.{name}.proxy"
    else:
        named = from_environment(upstream.base_url, environ)
        if named is None:
            return None
        source, value = named
        try:
            url, user, password = proxy_url_parts(value)
        except ValueError as err:
            raise ConfigError(
                f"upstreams.{name}: the egress proxy {source} names: {err}; or give the upstream "
                'proxy: "" to reach it directly'
            ) from None
    return EgressProxy(
        url=url, user=user, password=None if password is None else SecretStr(password), source=source
    )


def log_warnings(warnings: list[str]) -> None:
    """The warnings a load collected (``parse_config``), logged as its own would have been."""
    for said in warnings:
        log.warning(said)


def log_egress(config: Config, before: Config | None = None) -> None:
    """An info line for each upstream whose calls go through an egress proxy (its host:port and
    where it was named, never its credentials): at start (``before`` None), and at a reload for
    each upstream whose proxy ``before`` (the config in force) did not have, or had and lost.

    Said because an upgrade from a version that read no environment sends an upstream that went
    direct through the ``HTTPS_PROXY`` / ``HTTP_PROXY`` its container inherited: an internal
    http upstream's key then goes to that proxy in clear, which an operator must be able to see.
    Logged by whoever applies the config (``serve``, the reloader), once logging is set up."""
    for name, upstream in config.upstreams.items():
        egress = upstream.egress
        was = None if before is None or name not in before.upstreams else before.upstreams[name].egress
        if before is not None and _egress_seen(egress) == _egress_seen(was):
            continue
        if egress is not None:
            log.info(
                "upstream goes through an egress proxy",
                extra={"upstream": name, "egress_proxy": _host_port(egress.url), "named_by": egress.source},
            )
        elif was is not None:
            log.info("upstream goes direct, through no egress proxy now", extra={"upstream": name})


def _egress_seen(egress: EgressProxy | None) -> tuple[str, str] | None:
    return None if egress is None else (egress.url, egress.source)


def _host_port(url: str) -> str:
    """An egress proxy's ``http://HOST[:PORT]`` as ``HOST:PORT`` (80 where it names none)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"[{host}]:{parts.port or 80}" if ":" in host else f"{host}:{parts.port or 80}"


def with_flags(
    config: Config, *, host: str | None = None, port: int | None = None, redis_url: str | None = None
) -> Config:
    """``config`` with the command line's overrides, validated as the file's values are."""
    updates: dict[str, object] = {}
    try:
        if host is not None or port is not None:
            listen = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
            updates["listen"] = ListenConfig.model_validate({**config.listen.model_dump(), **listen})
        if redis_url is not None:
            updates["redis"] = RedisConfig.model_validate({**config.redis.model_dump(), "url": redis_url})
    except ValidationError as err:
        raise ConfigError("command line: " + _format_validation_error(err)) from None
    return cross_checked(config.model_copy(update=updates), "command line") if updates else config


def cross_checked(config: Config, where: str) -> Config:
    """``config`` once its checks across fields have passed again, an error said as ``where``'s: a
    copy (``model_copy``) skips them, and a ``--port`` onto the metrics port was served, exit 4."""
    try:
        return Config.model_validate({name: getattr(config, name) for name in Config.model_fields})
    except ValidationError as err:
        # Said as the file's would be, less the "config" a check across fields is said under.
        raise ConfigError(f"{where}: " + _format_validation_error(err).removeprefix("config: ")) from None


def _digest(section: str, key: KeyConfig | AdminKeyConfig, environ: Mapping[str, str]) -> str:
    if key.key_env is None:
        assert key.sha256 is not None
        return key.sha256
    plain = _secret(f"{section}.{key.name}.key_env", key.key_env, environ)
    if not plain:
        raise ConfigError(f"{section}.{key.name}.key_env: environment variable {key.key_env} is not set")
    return hashlib.sha256(plain.encode()).hexdigest()


def _secret(field: str, name: str | None, environ: Mapping[str, str]) -> str | None:
    """A secret from the environment, without the line break a secrets file or an .env often
    ends with: as given, an upstream key could not be sent at all (no header holds one), and a
    proxy key could never match (the presented key arrives stripped)."""
    value = environ.get(name) if name else None
    if value is None:
        return None
    value = value.strip()
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"{field}: environment variable {name} holds a control character inside the key")
    try:
        value.encode()
    except UnicodeEncodeError:
        # A byte that is no UTF-8 (a secrets file written in Latin-1) comes as a surrogate: taken,
        # an upstream key failed each call's settle (its lease left for the reaper to bill at
        # the reserve), a proxy key's digest a traceback.
        raise ConfigError(f"{field}: environment variable {name} is not UTF-8 text") from None
    return value


def load_config(
    path: Path,
    environ: Mapping[str, str] | None = None,
    *,
    key_secrets: bool = True,
    warnings: list[str] | None = None,
) -> Config:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        if isinstance(err, yaml.MarkedYAMLError) and err.problem == "exceeded maximum nesting depth":
            # libyaml's bound, said as the pure-Python parser's (a RecursionError) is.
            raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
        if isinstance(err, yaml.MarkedYAMLError):
            # Where, not the line's text: PyYAML's snippet would quote the values on it (a URL's
            # password among them) to the terminal, or to the log when a reload is refused.
            for name in ("context_mark", "problem_mark"):
                mark = getattr(err, name)
                if mark is not None:
                    setattr(err, name, _bare(mark))
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    except (ValueError, OverflowError, TypeError, AttributeError, KeyError, IndexError) as err:
        # A value PyYAML parses but cannot build, which its constructors report as whatever
        # their code ran into: a date that does not exist (2001-02-30), a tag on what it does
        # not fit (!!int 0x, !!int '', !!bool maybe, !!timestamp x).
        raise ConfigError(f"{path}: invalid YAML value: {err}") from None
    return parse_config(
        raw, os.environ if environ is None else environ, key_secrets=key_secrets, warnings=warnings
    )


def passthrough_config(
    upstream_url: str,
    *,
    host: str,
    port: int,
    redis_url: str | None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Zero-config mode: every model goes to one upstream with the caller's own key, through the
    egress proxy ``environ`` names (HTTPS_PROXY...; None: the process's environment)."""
    raw = {
        "listen": {"host": host, "port": port},
        "redis": {"url": redis_url},
        "upstreams": {"default": {"base_url": upstream_url, "passthrough_auth": True}},
        "models": {"*": {"upstream": "default"}},
    }
    try:
        return parse_config(raw, os.environ if environ is None else environ)
    except ConfigError as err:
        # No file: the fields are the flags' (a passthrough upstream sends the caller's key).
        message = str(err)
        for field, flag in _FLAGS:
            message = message.replace(field, flag)
        raise ConfigError(message) from None


# The fields zero-config fills from its flags, as the operator wrote them.
_FLAGS = (
    (
        "upstreams.default: base_url: credentials in the URL and a key sent as a header (api_key_env, "
        "passthrough_auth) cannot go together",
        "--upstream: credentials in the URL cannot go with the caller's own key, which zero-config passes on",
    ),
    ("upstreams.default.base_url", "--upstream"),
    ("upstreams.default", "--upstream"),
    ("listen.port", "--port"),
    ("listen.host", "--host"),
    ("redis.url", "--redis-url"),
)
