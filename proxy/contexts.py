"""What a call leaves for a later call to continue: the contexts the provider keeps for it, their
size kept (what a call continuing one reserves) and each marked as its tenant's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from proxy.call import context_key
from proxy.errors import StoreError
from proxy.outcome import BilledUsage
from proxy.store import KEPT_FOR_GOOD

if TYPE_CHECKING:
    from proxy.relay import Exchange

log = logging.getLogger("proxy.relay")
# The endpoints whose answers the provider keeps for a later call to name (a response, its
# items; a chat answer's audio; a code execution container; a message in a thread).
_KEEPING = frozenset({"responses", "chat.completions", "messages"})
# How long a stream's last event waits for its context's size to be kept (``keep_context``): a
# hint for a later reserve, written in a fraction of a millisecond by a store that answers; one
# that does not (a long script, a lost connection) must not hold the answer for its timeout.
KEEP_CONTEXT_WAIT_S = 0.25


async def _all(writes: list[Awaitable[None]]) -> None:
    await asyncio.gather(*writes)


async def keep_context(ex: Exchange) -> None:
    """Before a stream's last event goes out: it carries the answer (and its id), and a
    client may continue it as soon as it has it, before the stream ends and the call is
    settled. The settle writes the size again, at what it bills.

    The event waits for the write at most ``KEEP_CONTEXT_WAIT_S``: past that the write goes
    on (the settle waits for it, and shutdown for the settle) and the answer goes out."""
    if ex.context_kept:
        return
    ex.context_kept = True
    made = contexts_made(ex)
    owned = contexts_owned(ex, made)
    kept = made if made and ex.services.config.limits.prior_context_ttl_s else []
    writes: list[Awaitable[None]] = []
    if kept:  # the usage only then: every stream's last event comes here
        usage = await ex.billed(ex.usage(complete=True))
        if usage.source == "reserve" and not usage.input_known:
            # Kept at what the settle bills, the exact count: a quick bound kept now would
            # stay (a bound never lowers a bound), reserved and, without usage, billed by
            # every call continuing it.
            await ex.count_input()
            usage = await ex.billed(ex.usage(complete=True))
        writes.append(remember(ex, kept, usage))
    if owned:
        writes.append(claim(ex, owned))  # its owner's before the id reaches the client
    if not writes:
        return
    ex.keeping = asyncio.ensure_future(_all(writes))
    # Not cancelled by the timeout, nor by a cancel of this handler (shutdown): the settle
    # (in a task of its own) waits for it.
    await asyncio.wait((ex.keeping,), timeout=KEEP_CONTEXT_WAIT_S)


def contexts_owned(ex: Exchange, made: list[str]) -> list[str]:
    """What becomes this call's tenant's: the contexts it made, the items of its stored answer
    and a Messages answer whose prompt's fingerprint the provider keeps (cache diagnostics),
    and those it continued or named (a previous response or an item no tenant had
    marked: made before, or with the provider directly). Not when a pass-through caller's own
    key went upstream (its own account's: the operator's key, or none, serves every tenant as
    one), and never a stored prompt nor a file it named that no call here wrote: the
    operator's (uploaded to the Files API), for any tenant to name."""
    call = ex.call
    if call.endpoint not in _KEEPING or ex.caller_key:
        return []
    if call.upstream_status >= 300:
        return []
    obs = ex.obs
    # The answer the provider keeps under its id (a stored response; a message in a thread, or
    # its prompt's fingerprint for cache diagnostics).
    answer = obs.response_id if call.stores_answer or call.fingerprinted else None
    told = obs.item_ids or obs.container_ids or obs.file_ids
    if not (made or call.continues or call.references or told or answer):
        return []  # nearly every chat and Messages call: nothing to mark, nothing built
    # Not one the reserve found this tenant's already: owner.lua again, a round trip (before
    # a stream's last event) for nothing.
    skip = {call.stored_prompt, *call.continues_owned, *made}
    own = [context_key(answer)] if answer else []  # in ``made`` when kept: a fingerprint's is not
    if ex.obs.error and not ex.obs.pending:
        # It failed (``status: failed``, an error event) once ids had reached the client: the
        # provider keeps that response under its id, the containers its code ran in keep their
        # files, and its items may be kept. Still this tenant's; what it continued or named
        # becomes no one's by a failed call.
        return _kept_for_good(ex, [c for c in dict.fromkeys([*own, *answer_items(ex)]) if c not in skip])
    refs = (context_key(ref) for what, ref in call.references if what != "file")
    named = [*own, *call.continues, *answer_items(ex), *refs]
    owned = [c for c in made if c != call.stored_prompt] + [c for c in dict.fromkeys(named) if c not in skip]
    return _kept_for_good(ex, owned)


def _kept_for_good(ex: Exchange, owned: list[str]) -> list[str]:
    """Within a conversation, the conversation and what its call made (its answer, its items):
    the provider keeps them with no expiry, so their marks are kept for good (a mark gone after
    30 days left an idle conversation, or its first answer's items, anyone's to continue). Not
    its container (the provider drops it once idle) nor an item it named (kept as long as the
    answer that made it; for good when that was within a conversation). The files its code
    wrote, in any call: the Files API keeps them until they are deleted."""
    call = ex.call
    lasting = {context_key(f) for f in ex.obs.file_ids}
    if call.conversation is not None:
        lasting.update((call.conversation, *contexts_made(ex), *(context_key(i) for i in ex.obs.item_ids)))
    if not lasting:
        return owned
    return [KEPT_FOR_GOOD + c if c in lasting else c for c in owned]


def answer_items(ex: Exchange) -> list[str]:
    """Where the provider keeps what this answer made for a later call to name: a stored
    Responses answer's output items, a chat answer's audio (kept for later turns whatever
    ``store`` says), the container its code ran in (with the files it left there) and the files
    its code wrote that the Files API keeps (Anthropic's code execution)."""
    call = ex.call
    items = ex.obs.item_ids if call.stores_answer or call.endpoint == "chat.completions" else []
    return [context_key(i) for i in (*items, *ex.obs.container_ids, *ex.obs.file_ids)]


def contexts_made(ex: Exchange) -> list[str]:
    """Where the provider keeps this call's context for a later call to continue."""
    call = ex.call
    if call.endpoint == "messages" and call.stores_answer:
        return _thread_made(ex)
    if call.endpoint != "responses":
        return []
    if (ex.obs.error and not ex.obs.pending) or call.upstream_status >= 300:
        # It failed (``status: failed``, an error event), or the upstream answered an error:
        # its conversation is as it was, whatever the failed call billed (its usage may be
        # 0), and a failed answer is not continued. Not one queued: the provider writes it
        # later and adds it to its conversation, kept at what the call billed (its reserve, a
        # bound) as a cut call's is.
        return []
    kept = [call.conversation] if call.conversation else []
    if call.stored_prompt and call.continues == (call.stored_prompt,):
        # At what the call billed: an upper bound of the template it read. Not a call that
        # continues a response or a conversation: it billed that too, and its size, never
        # lowered, would be reserved for every fresh call naming the prompt.
        kept.append(call.stored_prompt)
    answer = ex.obs.response_id
    if answer is None:
        # Never seen whole (a body cut mid-JSON, a timeout, a transport that broke once the
        # call went out): the provider may have made it and added it to its conversation,
        # kept at what this call bills (its reserve, an upper bound; nothing, not 0, when
        # nothing went out). Its own id is unknown.
        return kept
    if call.stores_answer:
        kept.append(context_key(answer))
    return kept


def _thread_made(ex: Exchange) -> list[str]:
    """A Messages call in a thread (``thread``: created or continued): the provider holds the
    conversation, this answer with it, under the answer's id, for the next turn to continue.
    Not when it failed (an error event) or the upstream answered an error. A stream cut once
    its id was told is kept at what the call billed (its reserve, a bound), as a Responses
    answer's; one cut before has no id to keep it under."""
    call, answer = ex.call, ex.obs.response_id
    if answer is None or (ex.obs.error and not ex.obs.pending) or call.upstream_status >= 300:
        return []
    return [context_key(answer)]


async def claim(ex: Exchange, ids: list[str]) -> None:
    """The contexts this call made or continued are its tenant's: another tenant's call
    continuing them is refused (``reserve``)."""
    try:
        await ex.services.store.claim_contexts(tenant=ex.call.identity.tenant, ids=ids)
        ex.claimed.update(ids)
    except StoreError as err:
        ex.services.metrics.store_errors.labels("claim_context").inc()
        extra = {"request_id": ex.call.request_id, "error": repr(err)}
        log.warning("could not mark a context as its tenant's", extra=extra)


async def remember(ex: Exchange, ids: list[str], usage: BilledUsage) -> None:
    """The context a later call continues is what this one read and wrote; an item of its
    answer a later call names is at most what it wrote."""
    store, limits, call = ex.services.store, ex.services.config.limits, ex.call
    bound = usage.source == "reserve"
    writes = [
        store.remember_context(
            tenant=call.identity.tenant,
            ids=ids,
            tokens=usage.input_tokens + usage.output_tokens,
            ttl_s=limits.prior_context_ttl_s,
            bound=bound,
            base_tokens=call.prior_context_tokens,
        )
    ]
    # (Not its container: a later call naming it reads the files in it, not this answer.)
    items = [context_key(i) for i in ex.obs.item_ids] if call.stores_answer else []
    if items:
        writes.append(
            store.remember_context(
                tenant=call.identity.tenant,
                ids=items,
                tokens=usage.output_tokens,
                ttl_s=limits.prior_context_ttl_s,
                bound=bound,
            )
        )
    for result in await asyncio.gather(*writes, return_exceptions=True):
        if isinstance(result, StoreError):
            # Only a later call's reserve is the poorer for it (its request alone).
            ex.services.metrics.store_errors.labels("remember_context").inc()
            extra = {"request_id": call.request_id, "error": repr(result)}
            log.warning("could not keep a context's size", extra=extra)
        elif isinstance(result, BaseException):
            raise result
