"""Where a call is planned and its prompt counted: on the event loop, or, for work too long for
it (a large body's parse and walks, a count of much text), on the threads each tenant takes its
turn on (``thread_pools.TenantPool``), so that no request stalls every other and no tenant's many
long jobs queue ahead of another's."""

from __future__ import annotations

import functools

from aiohttp import web

from proxy.auth import Identity
from proxy.call import Call
from proxy.config import Config
from proxy.errors import UpstreamKeyUnset
from proxy.estimate import Estimate, counted
from proxy.forward import feature_headers, header_list, operator_key_unset
from proxy.ids import REQUEST_ID, IdSource
from proxy.payload import Endpoint, parse_body
from proxy.plan import plan_call
from proxy.state import State
from proxy.tokenizer import Tokenizer

# A body past either is parsed and planned off the event loop (``plans_on_loop``): at most a few
# milliseconds of walking on it, whatever the body's shape.
PLAN_ON_LOOP_BYTES = 64 * 1024
PLAN_ON_LOOP_VALUES = 4096


async def planned(
    request: web.Request,
    endpoint: Endpoint,
    raw: bytes,
    identity: Identity,
    run_id: str,
    config: Config,
    state: State,
) -> Call:
    """Route and estimate the call under ``config``. Parsed here, not before: planning sets
    fields of the body (its output cap), and a call planned again starts from the body as sent.
    A body whose walks are long (``plans_on_loop``) is parsed and planned on the plan thread,
    where it touches the config (frozen: what it caches, either thread works out alike), the
    tokenizer (its count cache is locked) and the id source (a counter in C); the request, the
    metrics and the store stay with the loop."""
    # Positional: the inline call is on every call's path (keywords cost a dict each).
    args = (
        raw,
        endpoint,
        request[REQUEST_ID],
        identity,
        run_id,
        config,
        state.tokenizer,
        state.ids,
        header_list(request.headers, "anthropic-beta"),
    )
    if plans_on_loop(raw):
        call = _parsed_and_planned(*args)
    else:
        assert state.planner is not None
        call = await state.planner.run(identity.tenant, functools.partial(_parsed_and_planned, *args))
    if operator_key_unset(call.upstream, identity):
        # Sent without a key, the provider's 401 would reach the caller as its own key refused;
        # refused here, nothing is reserved, and the 502 says whose the key is.
        raise UpstreamKeyUnset()
    call.feature_headers = feature_headers(request.headers, call.upstream)
    return call


def plans_on_loop(raw: bytes) -> bool:
    """Whether a body is parsed and planned on the event loop: a small one of few JSON values,
    as nearly every call's (no thread's hop to pay). The parse and the estimate's walks take
    about a microsecond a value, which bytes bound loosely (4 MiB of ``{}`` is 1.3 million
    values: 2 s of a loop every other call waits on); each value but the first follows a
    ``[``, a ``{`` or a ``,`` (counted in C: a few microseconds for 64 KiB)."""
    return (
        len(raw) <= PLAN_ON_LOOP_BYTES
        and raw.count(b"{") + raw.count(b"[") + raw.count(b",") <= PLAN_ON_LOOP_VALUES
    )


def _parsed_and_planned(
    raw: bytes,
    endpoint: Endpoint,
    request_id: str,
    identity: Identity,
    run_id: str,
    config: Config,
    tokenizer: Tokenizer,
    ids: IdSource,
    anthropic_beta: str,
) -> Call:
    body, view = parse_body(raw, endpoint)
    # Much new text is estimated at its byte length here and counted later: before the call
    # only if the reserve needs it, else while the call runs (``reserve.reserve``).
    return plan_call(
        request_id=request_id,
        identity=identity,
        run_id=run_id,
        endpoint=endpoint,
        body=body,
        view=view,
        config=config,
        tokenizer=tokenizer,
        ids=ids,
        anthropic_beta=anthropic_beta,
    )


async def count_later(state: State, call: Call) -> Estimate:
    """Tiktoken's count of a quick estimate while its call runs, on the one estimate thread (one
    count at a time: several at once only fight over 2 cores and the GIL); one of a tenant's at a
    time, so that a tenant's many long prompts keep another's bound up behind one of theirs at
    most."""
    assert state.estimator is not None
    count = functools.partial(counted, call.estimate, state.tokenizer, call.encoding)
    return await state.estimator.run(call.identity.tenant, count)


async def count_now(call: Call, *, state: State) -> Estimate:
    """The same count for a reserve that waits on it (a budget near its ceiling; every new long
    prompt with quick estimates off): on the reserve count threads, not queued behind the
    estimate thread's counts; one of a tenant's at a time, so that a tenant's many long prompts
    hold another's count behind one of theirs at most (each refused after its count would cost
    that tenant nothing)."""
    assert state.reserve_counts is not None
    count = functools.partial(counted, call.estimate, state.tokenizer, call.encoding)
    return await state.reserve_counts.run(call.identity.tenant, count)
