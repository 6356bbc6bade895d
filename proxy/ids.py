"""The proxy's ids: a call's request id, its run's, the reservation's, and which ids a client
may send."""

from __future__ import annotations

import hashlib
import itertools
import os
import re

from aiohttp import web

from proxy.auth import one_header
from proxy.errors import BadRequest

SANE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class IdSource:
    """Unique ids without a system call each: a counter under a keyed hash (a random per-process
    key). The ids are shown to callers (x-request-id, a call's own run, the ledger's
    reservation_id): a plain counter would tell a tenant how many calls the others made."""

    def __init__(self) -> None:
        self._key = os.urandom(16)
        self._next = itertools.count(1).__next__

    def new(self) -> str:
        # 128 bits: distinct counters never meet in practice, across processes too.
        return hashlib.blake2b(self._next().to_bytes(8, "little"), key=self._key, digest_size=16).hexdigest()


# The call's id, set once by ``error_answers.error_middleware`` for every request (and every
# answer's headers).
REQUEST_ID = web.RequestKey("request_id", str)


def request_id_for(request: web.Request, ids: IdSource) -> str:
    """Echo the client's request id when it is sane, else make one."""
    sent = request.headers.get("x-request-id", "")
    return sent if SANE_ID.fullmatch(sent) else f"req_{ids.new()}"


# The run id of a call that named none: a run of one call.
MADE_RUN_PREFIX = "run_"


def run_id_for(request: web.Request, ids: IdSource) -> str:
    """The run a call belongs to; a call without ``X-Run-Id`` is a run of its own (a new id,
    never the client's ``X-Request-Id``, which a gateway may repeat)."""
    sent = one_header(request, "X-Run-Id")
    if sent is None:
        return f"{MADE_RUN_PREFIX}{ids.new()}"
    if not SANE_ID.fullmatch(sent):
        raise BadRequest(
            "Invalid X-Run-Id: use 1 to 128 letters, digits, '.', '_', ':' or '-'.", param="X-Run-Id"
        )
    return sent
