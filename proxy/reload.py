"""Hot reload of the config file: on SIGHUP and when the file changes on disk.

A new file that does not validate is refused with a log line and the old config stays in force.
Ceilings and prices apply to new reservations; usage is never reset (window counters are keyed
by window start, not by config). Listen address and Redis settings need a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path

from proxy.config import Config, load_config
from proxy.errors import ConfigError

log = logging.getLogger("proxy.reload")


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class ConfigReloader:
    def __init__(self, path: Path, current: Callable[[], Config], apply: Callable[[Config], None]) -> None:
        self.path = path
        self._current = current
        self._apply = apply
        self._stamp = _stamp(path)

    def reload(self, reason: str) -> bool:
        self._stamp = _stamp(self.path)
        old = self._current()
        try:
            new = load_config(self.path, os.environ)
        except ConfigError as err:
            log.error(
                "config reload refused; the old config stays in force",
                extra={"reason": reason, "error": str(err)},
            )
            return False
        # The store and the listening socket are bound at start: keep them as they are.
        if new.listen != old.listen or new.redis.model_dump(exclude={"url"}) != old.redis.model_dump(
            exclude={"url"}
        ):
            log.warning("listen and redis settings change only on restart", extra={"reason": reason})
        marker_ttl_s = old.limits.settled_marker_ttl_s
        if new.limits.settled_marker_ttl_s != marker_ttl_s:
            # The store writes every settled marker with the TTL it started with, and the window
            # in which a settle bills a lost reservation must stay inside it (else a late settle
            # finds a reaper's marker gone and bills the call twice).
            log.warning("limits.settled_marker_ttl_s changes only on restart", extra={"reason": reason})
        limits = new.limits.model_copy(update={"settled_marker_ttl_s": marker_ttl_s})
        new = new.model_copy(update={"listen": old.listen, "redis": old.redis, "limits": limits})
        self._apply(new)
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

    async def watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self.changed():
                self.reload("file changed")
