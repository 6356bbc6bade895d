"""The Lua scripts of the Redis store: read from ``proxy/lua``, and run by SHA on the pipelined
connection when there is one, else through redis-py, their failures told apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, ResponseError

from proxy.errors import StoreError, StoreRejected
from proxy.redis_failures import NOT_RUN_ERRORS, STORE_FAILURES, never_sent, sent_before, transient
from proxy.resp import ConnectionLost, Packed, PipelinedConnection, RespError

SCRIPT_NAMES = (
    "reserve",
    "settle",
    "renew",
    "expired",
    "lease",
    "shrink",
    "context",
    "owner",
    "register",
    "forget",
)


def read_scripts() -> dict[str, tuple[str, str]]:
    scripts = {}
    for name in SCRIPT_NAMES:
        source = resources.files("proxy").joinpath(f"lua/{name}.lua").read_text(encoding="utf-8")
        scripts[name] = (source, hashlib.sha1(source.encode()).hexdigest())
    return scripts


class ScriptRunner:
    """How ``RedisStore`` runs a script: on its pipelined connection, else its redis-py client
    (both set, and the scripts read, by ``RedisStore``)."""

    _client: aioredis.Redis | RedisCluster
    _pipe: PipelinedConnection | None
    _scripts: dict[str, tuple[str, str]]

    async def _script(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        *,
        on_sent: Callable[[], None] | None = None,
    ) -> Any:
        if self._pipe is not None:
            return await self._piped_script(name, len(keys), (*keys, *args), (), on_sent)
        return await self._client_script(name, len(keys), [*keys, *args])

    async def _script_parts(
        self, name: str, key_count: int, parts: Sequence[tuple[Any, ...] | Packed]
    ) -> Any:
        """``_script`` with its keys and arguments in parts, some packed once for many calls
        (``Packed``): the first ``key_count`` of them are its keys."""
        if self._pipe is not None:
            return await self._piped_script(name, key_count, (), parts, None)
        flat = [a for part in parts for a in (part.args if isinstance(part, Packed) else part)]
        return await self._client_script(name, key_count, flat)

    async def _client_script(self, name: str, key_count: int, keys_and_args: list[Any]) -> Any:
        # redis-py (a Cluster, or TLS: rediss://) does not say when a command is written: ``on_sent``
        # is not called.
        source, sha = self._scripts[name]
        # A Cluster client's command whose earlier try may have gone out (``redis_cluster``):
        # whatever its last try, or the EVAL sent after its NOSCRIPT, says, it may have run.
        ran_before = False
        try:
            try:
                return await self._client.evalsha(sha, key_count, *keys_and_args)
            except NoScriptError as err:
                ran_before = sent_before(err)
                return await self._client.eval(source, key_count, *keys_and_args)
        except STORE_FAILURES as err:
            if ran_before or sent_before(err):
                raise StoreError(f"{name}: {err}", maybe_applied=True) from err
            if isinstance(err, ResponseError):
                if transient(err):
                    raise StoreError(f"{name}: {err}") from err
                raise StoreRejected(f"{name}: {err}") from err
            if isinstance(err, NOT_RUN_ERRORS):
                raise StoreError(f"{name}: {err}") from err
            raise StoreError(f"{name}: {err}", maybe_applied=not never_sent(err)) from err

    async def _piped_script(
        self,
        name: str,
        key_count: int,
        keys_and_args: tuple[Any, ...],
        parts: Sequence[tuple[Any, ...] | Packed],
        on_sent: Callable[[], None] | None,
    ) -> Any:
        assert self._pipe is not None
        source, sha = self._scripts[name]
        try:
            try:
                return await self._pipe.call(
                    "EVALSHA", sha, key_count, *keys_and_args, on_sent=on_sent, parts=parts
                )
            except RespError as err:
                if not str(err).startswith("NOSCRIPT"):
                    raise
                return await self._pipe.call("EVAL", source, key_count, *keys_and_args, parts=parts)
        except RespError as err:
            if transient(err):
                raise StoreError(f"{name}: {err}") from err
            raise StoreRejected(f"{name}: {err}") from err
        except ConnectionLost as err:
            raise StoreError(f"{name}: {err}", maybe_applied=err.sent) from err
