"""Hot reload of the config file: on SIGHUP and when the file changes on disk.

A new file that does not validate is refused with a log line and the old config stays in force.
Ceilings and prices apply to new reservations; usage is never reset (window counters are keyed
by window start, not by config). What is set up at start (listen address, Redis, journal, log,
metrics listener, background loops, the settled marker's TTL) needs a restart: a reload keeps
the running values and says which changed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from proxy.config import Config
from proxy.config_load import load_config, log_egress, log_warnings
from proxy.errors import ConfigError

log = logging.getLogger("proxy.reload")


def _stamp(path: Path) -> bytes | None:
    """What the file holds, not its size and modification time: a config deployed as a symlink
    into a content-addressed store (every file's mtime 1), copied with its times kept and renamed
    into place, or saved twice within one tick of the file system's clock changes neither. A
    config file is small; read every few seconds, it costs nothing to speak of."""
    try:
        return hashlib.blake2b(path.read_bytes(), digest_size=16).digest()
    except OSError:
        return None


class ConfigReloader:
    def __init__(
        self,
        path: Path,
        current: Callable[[], Config],
        apply: Callable[[Config], None],
        *,
        counted: Callable[[str], None] = lambda result: None,
        started_from: Config | None = None,
    ) -> None:
        self.path = path
        self._current = current
        self._apply = apply
        # Each reload's result (``applied``, ``refused``), for the metrics: a refusal in the log
        # alone goes unseen by whatever alerts on metrics, while the old config stays in force.
        self._counted = counted
        self._stamp = _stamp(path)
        # Start-only settings are compared with the file as it was at start, not with the config
        # in force: that one carries what the command line and the worker set (--port,
        # --redis-url, a worker's metrics port), which no file ever says.
        # ``started_from``: the file as ``serve`` read it (before its flags); else the file as it
        # is now, which a save while the proxy started (seconds) may already have changed.
        try:
            # Its warnings unsaid: whoever read the config in force (``serve``, once for all its
            # workers) said them.
            now: Config | None = load_config(path, os.environ, warnings=[])
        except ConfigError:
            now = None
        self._started_from = started_from if started_from is not None else now
        in_force = current()
        if (
            now is None
            or (started_from is not None and now != started_from)
            or _keep_start_only(now, in_force) != in_force
        ):
            # The file changed after the config in force was read from it: saved while the
            # proxy started (its SIGHUP ignored until now). ``changed`` says so at once.
            self._stamp = None
        self._turn = asyncio.Lock()
        # Reloads asked of ``reload_off_loop`` so far: one still waiting its turn when a later
        # one is asked is merged into it (``reload_off_loop``).
        self._asked = 0
        self._closed = False

    def reload(self, reason: str) -> bool:
        """Load the file and apply it, here and now (on the event loop, it stands still for the
        load: ``reload_off_loop`` is the serving proxy's)."""
        self._stamp = _stamp(self.path)
        return self._applied(_loaded(self.path), reason)

    async def reload_off_loop(self, reason: str) -> bool:
        """``reload``, the file read and validated on a thread: a file of thousands of keys
        takes seconds to load, for which every call in flight would stand still. Applied on the
        loop, as the config in force is only ever swapped there.

        False when not applied: refused, closed, or merged into a reload asked after it while it
        waited for the one loading (neither applied nor refused, and not counted: that later one
        reads the file as it is then, which is this one's file or newer, and is counted)."""
        self._stamp = _stamp(self.path)
        self._asked += 1
        ticket = self._asked
        # One at a time, in the order asked: two loads side by side could end in either order,
        # and the older file applied after the newer one would stay in force.
        async with self._turn:
            if self._closed:
                return False
            if ticket != self._asked:
                # A burst of SIGHUPs or saves loaded the file once each, seconds apiece at
                # thousands of keys, each load taking the GIL from the loop, for configs in force
                # only until the next was applied. The one loading when asked is not merged: the
                # file may have changed during its load, and the next reload reads it again.
                log.info("config reload merged into a later one", extra={"reason": reason})
                return False
            loaded = await asyncio.to_thread(_loaded, self.path)
            if self._closed:  # shutdown began while it loaded: the config in force is done with
                return False
            return self._applied(loaded, reason)

    def close(self) -> None:
        """No reload applies from now on (shutdown): one loading still is dropped."""
        self._closed = True

    def _applied(self, loaded: tuple[Config, list[str]] | ConfigError, reason: str) -> bool:
        if isinstance(loaded, ConfigError):
            log.error(
                "config reload refused; the old config stays in force",
                extra={"reason": reason, "error": str(loaded)},
            )
            self._counted("refused")
            return False
        new, warnings = loaded
        log_warnings(warnings)
        old = self._current()
        # Timeouts reload, the marker's TTL and the store's socket timeout do not: the running
        # ones must fit the new leases (the new file was checked against its own).
        running_ttl_s = old.limits.settled_marker_ttl_s
        running_timeout_s = old.redis.effective_socket_timeout_s
        for why, kept in (
            (new.settled_marker_too_short(running_ttl_s), f"{running_ttl_s}"),
            (
                new.socket_timeout_too_long(running_timeout_s, named=old.redis.socket_timeout_named),
                f"{running_timeout_s:g}",
            ),
        ):
            if why is not None:
                log.error(
                    "config reload refused; the old config stays in force",
                    extra={
                        "reason": reason,
                        "error": f"{why} (the running {kept} s changes only on restart)",
                    },
                )
                self._counted("refused")
                return False
        baseline = self._started_from or old
        running = _start_only(baseline)
        changed = sorted(name for name, value in _start_only(new).items() if value != running[name])
        if self._started_from is not None:
            # Left out (the embedded Redis) where the file named one, too.
            url_changed = new.redis.url != self._started_from.redis.url
        else:  # the config in force carries the embedded Redis's URL, which serve filled in
            url_changed = new.redis.url is not None and new.redis.url != old.redis.url
        if url_changed:
            changed.append("redis.url")
        if changed:
            # The store, the sockets, the journal, the logging, the metrics and the background
            # loops are set up at start. In particular the settled marker's TTL: the store
            # writes every marker with the one it started with, and the window in which a
            # settle bills a lost reservation must stay inside it (else a late settle finds a
            # reaper's marker gone and bills the call twice).
            log.warning(
                "these settings change only on restart; the running values stay in force",
                extra={"reason": reason, "settings": changed},
            )
        new = _keep_start_only(new, old)
        self._apply(new)
        self._counted("applied")
        log_egress(new, old)
        log.info(
            "config reloaded",
            extra={
                "reason": reason,
                "tiers": sorted(new.tiers),
                "keys": len(new.keys),
                "models": len(new.models),
            },
        )
        return True

    def changed(self) -> bool:
        return _stamp(self.path) != self._stamp

    async def asked(self, reason: str) -> None:
        """``reload_off_loop`` for the watch and the signal, which nobody awaits to hear how it
        went: the log says."""
        try:
            await self.reload_off_loop(reason)
        except Exception:
            # Whatever a file did to one reload, the next saves are still watched, the next
            # signals still heard.
            log.exception("config reload failed; the old config stays in force")

    async def watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self.changed():
                await self.asked("file changed")


def _loaded(path: Path) -> tuple[Config, list[str]] | ConfigError:
    """The file's config and the warnings its load said (logged by whoever applies it, on the
    loop), or why it was refused."""
    warnings: list[str] = []
    try:
        config = load_config(path, os.environ, warnings=warnings)
    except ConfigError as err:
        return err
    # Here, on the load's thread: on the loop, the first call to each upstream with a ca_file
    # would stop it while its context is built. ``_keep_start_only`` copies the Config alone:
    # its upstreams, and the contexts cached on them, are the ones applied.
    config.build_ca_contexts()
    return config, warnings


def _start_only(config: Config) -> dict[str, object]:
    """The settings used only at start, by name (``redis.url`` aside: unset in a file that
    relies on the embedded Redis, which ``serve`` fills in)."""
    limits = config.limits
    return {
        "listen": config.listen,
        "redis": config.redis.model_dump(exclude={"url"}),
        "log": config.log,
        "metrics.listen": config.metrics.listen,
        "journal_dir": config.journal_dir,
        "shutdown_grace_s": config.shutdown_grace_s,
        "event_loop": config.event_loop,
        "currency": config.currency,
        "limits.settled_marker_ttl_s": limits.settled_marker_ttl_s,
        "limits.ledger_retention_s": limits.ledger_retention_s,
        "limits.token_count_cache_chars": limits.token_count_cache_chars,
        "limits.reaper_interval_s": limits.reaper_interval_s,
        "limits.journal_replay_s": limits.journal_replay_s,
        "limits.reap_grace_s": limits.reap_grace_s,
    }


def _keep_start_only(new: Config, old: Config) -> Config:
    """``new`` with the running values of the start-only settings: the config in force says
    what is in force."""
    limits = new.limits.model_copy(
        update={
            name: getattr(old.limits, name)
            for name in (
                "settled_marker_ttl_s",
                "ledger_retention_s",
                "token_count_cache_chars",
                "reaper_interval_s",
                "journal_replay_s",
                "reap_grace_s",
            )
        }
    )
    return new.model_copy(
        update={
            "listen": old.listen,
            "redis": old.redis,
            "log": old.log,
            "metrics": new.metrics.model_copy(update={"listen": old.metrics.listen}),
            "journal_dir": old.journal_dir,
            "shutdown_grace_s": old.shutdown_grace_s,
            "event_loop": old.event_loop,
            "currency": old.currency,
            "limits": limits,
        }
    )
