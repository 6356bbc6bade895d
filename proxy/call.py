"""One billed call: what is known before forwarding (the plan, ``proxy.plan``) and what happens
to it after."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.auth import Identity
from proxy.config import PolicyConfig, UpstreamConfig
from proxy.dialects import Dialect
from proxy.estimate import Estimate
from proxy.payload import Endpoint
from proxy.store import Reservation

# A provider's id for a context it keeps (resp_..., conv_...) as OpenAI writes it: its own key.
CONTEXT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


# What a request names for the provider to look up: (what, its id), ``Call.references``.
Reference = tuple[str, str]


def context_key(context_id: str) -> str:
    """Where a context's size is kept: its id when plain, else a digest of it (a gateway's ids
    are long, base64), which no plain id can be: an id of any form is looked up, none escapes."""
    if CONTEXT_ID.fullmatch(context_id):
        return context_id
    return "#" + hashlib.sha256(context_id.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(slots=True, kw_only=True)
class Call:
    request_id: str
    reservation_id: str
    identity: Identity
    run_id: str
    endpoint: Endpoint
    dialect: Dialect
    model: str
    model_pattern: str
    upstream_name: str
    upstream: UpstreamConfig
    encoding: str
    stream: bool
    client_wants_usage: bool
    json_mode: bool
    policy: PolicyConfig
    rates: dict[str, int] | None
    estimate: Estimate
    body: dict[str, Any]
    choices: int = 1  # answers the client gets back (n, for every prompt)
    # A chat call asking for audio or images: their tokens cannot be counted from the answer.
    media_output: bool = False
    # Of those, a chat call asking for images (``modalities``): reserved at the image rates too.
    asks_images: bool = False
    # It reasons in tokens billed and not shown (``ModelConfig.hidden_reasoning``, ``plan._reasons``).
    hidden_reasoning: bool = False
    # A chat call with a Predicted Output (``prediction``): the prediction's tokens the answer
    # did not take (rejected_prediction_tokens) are billed as output and never shown.
    predicted_output: bool = False
    # A legacy completion with echo: each answer starts with its prompt (counted as input).
    echo: bool = False
    generations: int = 1  # answers the provider writes and bills (best_of when larger, per prompt)
    started_at: float = field(default_factory=time.monotonic)
    started_wall_ms: int = field(default_factory=lambda: int(time.time() * 1000))
    reservation: Reservation | None = None
    # When Redis last confirmed the reservation's lease (the reserve, then each renewal): while
    # the lease cannot have run out since, no reaper can have settled the call.
    lease_confirmed_at: float = 0.0
    upstream_status: int = 0
    # Its connection to the upstream is being made: nothing of the call has gone out yet
    # (``forward.UpstreamConnector``).
    connecting: bool = False
    first_token_at: float | None = None
    # A whole answer sent with its settle on its way (``Exchange.settle_early``): when the settle
    # was written, the answer written in the same turn of the loop (or none, its client gone):
    # the end of the call's recorded duration, not the store's reply a round trip later.
    answered_at: float | None = None
    clamped: bool = False
    # A quick reserve being lowered to the exact count (``refine.refine``); the settle cancels
    # what it has not done yet.
    refining: asyncio.Future[None] | None = None
    # The processing tier the client asked for, when not the default (priced apart).
    service_tier: str | None = None
    # The prices of every tier the operator priced for the model ("default": its own), the
    # prices the call is reserved at (None: ``rates``), and the tier the answer says served it.
    tier_rates: Mapping[str, dict[str, int]] = field(default_factory=dict)
    reserve_rates: dict[str, int] | None = None
    served_tier: str | None = None
    # The model's long-context prices by tier (``ModelConfig.long_context``), for a call whose
    # input passes ``long_context_above`` tokens (None: the model has none).
    long_context_above: int | None = None
    long_tier_rates: Mapping[str, dict[str, int]] = field(default_factory=dict)
    # Reserved at the long-context prices (its input estimate past the threshold): the prices it
    # is reserved at within it, the dearest of the same tiers (None: not reserved at them). A
    # quick bound's exact count within it puts them in ``reserve_rates`` (``refine.take_count``).
    reserve_rates_short: dict[str, int] | None = None
    # Not reserved at them, the long-context prices of the same tiers (None: the model has none,
    # or reserved at them): a context it continues, added to its input, may pass the threshold.
    reserve_rates_long: dict[str, int] | None = None
    # The model's prices of hosted tools per 1,000 calls, in micro-units (``ModelConfig.tool_rates``;
    # empty: none priced, nearly every model). The calls reserved are the estimate's.
    tool_rates: Mapping[str, int] = field(default_factory=dict)
    # The client's feature switches for the provider (``forward.feature_headers``).
    feature_headers: Mapping[str, str] = field(default_factory=dict)
    # Contexts the provider keeps that this call's input continues (a Responses call's previous
    # response, its conversation; the message a Messages call's thread continues): their size
    # is reserved on top of the request's own input.
    continues: tuple[str, ...] = ()
    # Where this call's own context is kept for a later call: its conversation, and its answer
    # unless the client asked the provider not to store it (a Messages answer: within a thread).
    conversation: str | None = None
    stores_answer: bool = False
    # The provider keeps a fingerprint of this Messages call's prompt under its answer's id (cache
    # diagnostics): a later call naming it (``diagnostics.previous_message_id``) is told how its
    # own prompt differs. Its answer is marked as its tenant's, as a kept one is.
    fingerprinted: bool = False
    # A stored prompt's template (its id and version), input the provider adds to every call
    # that names it: kept, and reserved, as a context this call continues.
    stored_prompt: str | None = None
    prior_context_tokens: int = 0  # the size of what it continues, when known (reserved)
    # What the request names by id for the provider to look up, as (what, id): stored items it
    # reads as input ("item": a Responses ``item_reference``, a reasoning item without its
    # content; "audio": a chat message's earlier audio answer), a code execution container
    # ("container": with the files earlier calls left in it; "input_container": one a call item
    # sent back names), a message whose prompt a Messages call's is compared with (cache
    # diagnostics' "diagnostics"), a response a Responses call's is ("comparison") and a Files
    # API file a Messages call puts in its container or reads ("file": one a tenant's code
    # execution wrote is its). Ids as given.
    references: tuple[Reference, ...] = ()
    # Of ``continues`` and ``references`` (keyed), those the reserve found marked as this call's
    # tenant's already: not marked again (``contexts.contexts_owned``).
    continues_owned: tuple[str, ...] = ()

    @property
    def rates_reserved(self) -> dict[str, int] | None:
        return self.reserve_rates if self.reserve_rates is not None else self.rates

    @property
    def rates_served(self) -> dict[str, int] | None:
        """The prices of the tier that served the call, as its answer says when the operator
        priced that tier; else those of the tier asked for."""
        served = self.tier_rates.get(self.served_tier) if self.served_tier else None
        return served if served is not None else self.rates

    def rates_billed(self, input_tokens: int) -> dict[str, int] | None:
        """``rates_served``, or their long-context counterpart for a call of ``input_tokens``
        past the model's threshold."""
        rates = self.rates_served
        if rates is None or self.long_context_above is None or input_tokens <= self.long_context_above:
            return rates
        served = self.served_tier if self.served_tier in self.long_tier_rates else None
        return self.long_tier_rates.get(served or self.service_tier or "default", rates)

    @property
    def writes_nothing(self) -> bool:
        """A legacy completion with ``max_tokens: 0``: the prompt scored (echo, logprobs), no
        output asked for; its answers end with "length" by construction, not cut short."""
        return self.endpoint == "completions" and self.body.get("max_tokens") == 0

    @property
    def prewarms(self) -> bool:
        """A Responses call with ``prompt_cache_options.prewarm``: the prompt cached, no output
        asked for (an upstream or model that does not know the option writes one all the same)."""
        if self.endpoint != "responses":
            return False
        options = self.body.get("prompt_cache_options")
        return isinstance(options, dict) and options.get("prewarm") is True

    @property
    def reserved_input_tokens(self) -> int:
        return self.estimate.input_tokens

    @property
    def reserved_output_tokens(self) -> int:
        return self.estimate.output_tokens
