"""The plan of a call: the model routed, the worst case estimated, the fields the proxy sets,
and what the request continues or names for the provider to look up, read once before reserving."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

from proxy.auth import Identity
from proxy.call import Call, Reference, context_key
from proxy.config import Config, UpstreamConfig
from proxy.config_models import ModelConfig
from proxy.dialects import DIALECTS
from proxy.errors import BadRequest, NotFound
from proxy.estimate import ANTHROPIC_TOOLS_INPUT_TOKENS, estimate
from proxy.ids import IdSource
from proxy.payload import (
    FAST_TIER,
    FAST_TIERS,
    FAST_US_TIER,
    US_TIER,
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    Endpoint,
    MessagesBody,
    RequestView,
    ResponsesBody,
    answers,
    generations,
    set_output_cap,
)
from proxy.pricing import tool_fees_exact
from proxy.service_tiers import asked_tier, dearest, long_tier_rates, rates_for, tier_rates
from proxy.tokenizer import Tokenizer, encoding_for_model
from proxy.tool_fees import counted_as, pools_tool_calls, refuse_unpriced_containers, reserved_tool_calls

# The tiers a Messages call naming a geography other than the US is never served at.
_OUTSIDE_THE_US = FAST_TIERS | {US_TIER}


def tools_input_tokens(model: ModelConfig, upstream: UpstreamConfig) -> int:
    if model.tools_input_tokens is not None:
        return model.tools_input_tokens
    return ANTHROPIC_TOOLS_INPUT_TOKENS if upstream.kind == "anthropic" else 0


# The Responses API refuses a max_output_tokens below 16 (integer_below_min_value).
RESPONSES_LEAST_CAP = 16


def least_cap_accepted(endpoint: Endpoint, body: dict[str, Any], *, anthropic_beta: str = "") -> int:
    """The smallest output cap the provider takes for this request: a cap below it (a budget's
    clamp, a model's own cap) would have the call refused upstream instead of here."""
    if endpoint == "responses":
        return RESPONSES_LEAST_CAP
    # On chat too: Anthropic's OpenAI-compatible endpoint takes it there, with the same rule.
    thinking = body.get("thinking") if endpoint in ("messages", "chat.completions") else None
    # With interleaved thinking the budget covers every thinking block of the turn and may pass
    # max_tokens (Anthropic's extended thinking docs).
    if (
        isinstance(thinking, dict)
        and thinking.get("type") == "enabled"
        and "interleaved-thinking-" not in anthropic_beta
    ):
        budget = thinking.get("budget_tokens")
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
            return budget + 1  # Anthropic: max_tokens must be above the thinking budget
    least = body.get("min_tokens") if endpoint in ("chat.completions", "completions") else None
    if isinstance(least, int) and not isinstance(least, bool) and least > 1:
        return least  # vLLM's: it refuses a max_tokens below the request's min_tokens
    return 1


def plan_call(
    *,
    request_id: str,
    identity: Identity,
    run_id: str,
    endpoint: Endpoint,
    body: dict[str, Any],
    view: RequestView,
    config: Config,
    tokenizer: Tokenizer,
    ids: IdSource,
    anthropic_beta: str = "",
) -> Call:
    """Route the model and estimate the worst case; set the fields the proxy must set."""
    # Each read once: a view's and a config's fields are slow reads (pydantic's __getattr__).
    model = view.model
    routed = config.route(model)
    if routed is None:
        raise NotFound(
            f"The model '{model}' is not served by this proxy.", param="model", code="model_not_found"
        )
    pattern, model_config = routed
    upstream_name = model_config.upstream
    upstream = config.upstreams[upstream_name]
    dialect = DIALECTS[endpoint]
    if upstream.kind != dialect.upstream_kind:
        raise BadRequest(
            f"The model '{model}' is served by an upstream of kind '{upstream.kind}', which does not "
            f"speak this endpoint ({endpoint}).",
            param="model",
            code="wrong_endpoint_for_model",
        )
    encoding = tokenizer.resolve(encoding_for_model(model, model_config.encoding))
    est = estimate(
        endpoint,
        view,
        encoding=encoding,
        tokenizer=tokenizer,
        model_max_output_tokens=model_config.max_output_tokens,
        default_max_output_tokens=config.limits.default_max_output_tokens,
        media_part_input_tokens=model_config.media_part_input_tokens,
        tools_input_tokens=tools_input_tokens(model_config, upstream),
        cache_scope=identity.tenant,
        template_call_tokens=model_config.prompt_overhead_tokens,
        template_message_tokens=model_config.message_overhead_tokens,
        default_tool_calls=config.limits.default_max_tool_calls,
    )
    lowered = True  # an enforced cap is the config's (``estimate``: set only below what was asked)
    if type(view) is ChatBody and upstream.chat_output_cap_field == "max_tokens":
        # An upstream that reads only max_tokens: the cap goes there, always (it may have none
        # of its own), and the field it ignores or refuses does not go at all (not even null).
        body.pop("max_completion_tokens", None)
        # Both of the client's caps bound what it wants: the lower one goes, and is reserved.
        caps = [c for c in (view.max_completion_tokens, view.max_tokens) if c is not None]
        cap = min([est.output_cap, *caps])
        # The config's cap (the model's, the default) only when it is below the client's own.
        lowered = not caps or cap < min(caps)
        est = replace(
            est,
            output_cap_field="max_tokens",
            enforce_cap=cap,
            output_cap=cap,
            output_tokens=cap * generations(view) * est.output_passes,
        )
    elif (
        type(view) is ChatBody
        and view.max_completion_tokens is None
        and est.output_cap_field == "max_completion_tokens"
        and _predicts(body.get("prediction"))
    ):
        # OpenAI refuses max_completion_tokens beside a Predicted Output (and takes max_tokens):
        # the cap a request without one is given goes where the provider takes it.
        est = replace(est, output_cap_field="max_tokens")
    # The client's beta reaches an Anthropic upstream only (``forward.FEATURE_HEADERS``): through
    # another (Anthropic's OpenAI-compatible endpoint), interleaved thinking is not on, and the
    # cap must pass the thinking budget, as the clamp reads it (``call.feature_headers``).
    beta = anthropic_beta if upstream.kind == "anthropic" else ""
    least = least_cap_accepted(endpoint, body, anthropic_beta=beta)
    if est.enforce_cap is not None and est.enforce_cap < least and lowered:
        # The model's cap in the config would make the request one the provider refuses.
        # Anthropic's thinking budget must stay below the cap; vLLM's min_tokens within it.
        # The rule that set the least (``least_cap_accepted``): a thinking budget, or min_tokens.
        thinking = body.get("thinking")
        budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
        param = "thinking.budget_tokens" if least > 1 and budget == least - 1 else None
        if param is None and endpoint in ("chat.completions", "completions") and least > 1:
            param = "min_tokens"
        raise BadRequest(
            f"This proxy caps the model '{model}' at {est.enforce_cap} output tokens, below the "
            f"{least} this request needs" + (f": keep {param} below that cap." if param else "."),
            param=param,
            code="output_cap_too_low",
        )
    if est.enforce_cap is not None and est.output_cap_field:
        set_output_cap(body, est.output_cap_field, est.enforce_cap)
    # The validated field: embeddings have none, and a "stream" there is passed through unread
    # (an extra of any type, "no" included, which ``getattr`` would return all the same).
    stream = type(view) is not EmbeddingBody and view.stream is True
    client_wants_usage = False
    if stream and dialect.injects_usage:
        options = body.get("stream_options")
        client_wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        if upstream.stream_usage_option:
            # Real figures first: always ask the provider for the usage chunk (an upstream that
            # refuses the field is sent the client's own, as it came).
            body["stream_options"] = {**(options or {}), "include_usage": True}
    json_mode = False
    if type(view) is ChatBody and view.response_format is not None:
        json_mode = view.response_format.get("type") in ("json_object", "json_schema")
    elif type(view) is ResponsesBody:
        text = body.get("text")
        form = text.get("format") if isinstance(text, dict) else None
        json_mode = isinstance(form, dict) and form.get("type") in ("json_object", "json_schema")
    elif type(view) is MessagesBody:
        # Anthropic structured outputs: output_config.format (the SDK's messages.parse), or the
        # beta's top-level output_format.
        config_ = body.get("output_config")
        form = config_.get("format") if isinstance(config_, dict) else None
        if form is None:  # an output_config of other settings (the effort) beside the beta's
            form = body.get("output_format")
        json_mode = isinstance(form, dict) and form.get("type") == "json_schema"
    service_tier, rates = rates_for(view, model_config)
    tiers = tier_rates(model_config)
    # The tiers that may serve the call: it is reserved at the dearest of their prices.
    reserved_tiers = [service_tier or "default"]
    if rates is not None and len(tiers) > 1 and asked_tier(view) in (None, "auto"):
        # Served by the tier the client's project defaults to (priority, say), which the proxy
        # cannot know: reserved at the dearest priced tier, billed at the one the answer names.
        # Not fast mode's: it serves only the calls that ask for it.
        # Nor US-only inference's, for a Messages call naming another geography (``global``).
        unasked = FAST_TIERS
        if type(view) is MessagesBody and view.inference_geo is not None:
            unasked = _OUTSIDE_THE_US
        reserved_tiers = [name for name in tiers if name not in unasked]
    elif (
        rates is not None
        and service_tier == FAST_TIER
        and type(view) is MessagesBody
        and view.inference_geo is None
        and FAST_US_TIER in tiers
    ):
        # Fast mode naming no geography: a workspace's default_inference_geo may run it in the
        # US, billed at fast-us (``observe_anthropic._anthropic_tier``). Reserved at the dearer.
        reserved_tiers = [FAST_TIER, FAST_US_TIER]
    long_tiers = long_tier_rates(model_config)
    long_context = model_config.long_context
    long_above = long_context.above_input_tokens if long_context else None
    # Past the threshold by its estimate, at the long-context prices (an input estimated below it
    # that passes it is billed at them all the same: overshoot, as any input past its estimate).
    # A quick estimate's byte bound chooses them until its exact count does (``refine.take_count``).
    priced = long_tiers if long_above is not None and est.input_tokens > long_above else tiers
    reserve_rates = rates
    if rates is not None and (priced is long_tiers or len(reserved_tiers) > 1):
        reserve_rates = dearest(tiers[name] for name in reserved_tiers)
    # Reserved at the long-context prices, a call whose provider tells an input within the
    # threshold is billed at the model's own: the dearest of the same tiers (``settle._rates``).
    reserve_rates_short = None
    if reserve_rates is not None and priced is long_tiers:
        reserve_rates_short = reserve_rates
    # Within it by its own input, the prices it takes should a context the provider adds to it
    # (``reserve._add_prior_context``) pass the threshold.
    reserve_rates_long = None
    if reserve_rates is not None and long_tiers:
        # Each at the dearer of the two: long-context prices the config sets below the model's
        # own (not refused) bill the call at its own should its told input be within the threshold.
        long_rates = dearest([reserve_rates, *(long_tiers[name] for name in reserved_tiers)])
        if priced is long_tiers:
            reserve_rates = long_rates
        else:
            reserve_rates_long = long_rates
    tool_rates = model_config.tool_rates if rates is not None else {}
    if tool_rates:
        refuse_unpriced_containers(view, tool_rates)
        tool_calls = reserved_tool_calls(view, tool_rates, config.limits.default_max_tool_calls)
        aliases = counted_as(view, tool_rates)
        if tool_calls or aliases:
            est = replace(
                est,
                tool_calls=tool_calls,
                tool_fees_exact=tool_fees_exact(tool_calls, tool_rates),
                tool_aliases=aliases,
                tool_calls_pooled=pools_tool_calls(view),
            )
    continues, conversation, stores_answer = _chaining(view)
    stored_prompt = _stored_prompt(view)
    if stored_prompt is not None:
        continues = (*continues, stored_prompt)
    # Read once, and only a chat call's: nearly every one sends none, and then neither test runs.
    modalities = body.get("modalities") if type(view) is ChatBody else None
    return Call(
        request_id=request_id,
        reservation_id=ids.new(),
        identity=identity,
        run_id=run_id,
        endpoint=endpoint,
        dialect=dialect,
        model=model,
        model_pattern=pattern,
        upstream_name=upstream_name,
        upstream=upstream,
        encoding=encoding,
        stream=stream,
        client_wants_usage=client_wants_usage,
        json_mode=json_mode,
        policy=config.policy_for(identity.tier),
        rates=rates,
        service_tier=service_tier,
        tier_rates=tiers,
        reserve_rates=reserve_rates,
        reserve_rates_short=reserve_rates_short,
        reserve_rates_long=reserve_rates_long,
        long_context_above=long_above if long_tiers else None,
        long_tier_rates=long_tiers,
        tool_rates=tool_rates,
        estimate=est,
        body=body,
        choices=answers(view),
        generations=generations(view),
        media_output=modalities is not None and _asks_media(modalities),
        asks_images=modalities is not None and _asks_images(modalities),
        predicted_output=type(view) is ChatBody and _predicts(body.get("prediction")),
        hidden_reasoning=model_config.hidden_reasoning or _reasons(endpoint, body),
        echo=type(view) is CompletionBody and body.get("echo") is True,
        continues=continues,
        conversation=conversation,
        stores_answer=stores_answer,
        fingerprinted=type(view) is MessagesBody and _fingerprinted(view, anthropic_beta),
        stored_prompt=stored_prompt,
        references=_references(view),
    )


def _context_id(value: Any) -> str | None:
    if isinstance(value, dict):  # a conversation may be given as {"id": ...}
        value = value.get("id")
    return context_key(value) if isinstance(value, str) and value else None


def _chaining(view: RequestView) -> tuple[tuple[str, ...], str | None, bool]:
    """What a Responses call continues, its conversation, whether its answer is stored; what a
    Messages call's thread continues, and whether it has one (its answer is then kept, under its
    id, for the next turn to continue)."""
    if type(view) is MessagesBody:
        thread = (view.model_extra or {}).get("thread")
        if not isinstance(thread, dict):
            return (), None, False
        continued = thread.get("previous_message_id") if thread.get("type") == "continue" else None
        previous = _context_id(continued)
        return (() if previous is None else (previous,)), None, True
    if type(view) is not ResponsesBody:
        return (), None, False
    previous = _context_id(view.previous_response_id)
    conversation = _context_id(view.conversation)
    continues = tuple(c for c in (previous, conversation) if c is not None)
    return continues, conversation, view.store is not False


def _references(view: RequestView) -> tuple[Reference, ...]:
    """What a request names by id for the provider to look up (``Call.references``): a Responses
    input's item references (their ``type`` may be left out: an item of an id alone), reasoning
    items sent back without their encrypted content, images of the image generation tool without
    their result and typed items of their id alone (read from the store by id); a
    chat message's earlier audio answer, sent back by its id; the container a code execution
    tool runs in (a Responses tool's ``container`` or ``environment``, a Messages call's
    ``container``); the message a Messages call's cache diagnostics compare its prompt with, and
    the response a Responses call's (``prompt_cache_options.comparison_response_id``) do; a
    file of the Files API a Messages call puts in its container or reads (``_files_named``)."""
    found: list[Reference] = []
    if type(view) is ChatBody:
        for message in view.messages:
            audio = message.get("audio")  # None in nearly every message: one lookup
            if isinstance(audio, dict) and message.get("role") == "assistant":
                _add_reference(found, "audio", audio.get("id"))
    elif type(view) is MessagesBody:
        extra = view.model_extra or {}
        container = extra.get("container")
        _add_reference(found, "container", container.get("id") if isinstance(container, dict) else container)
        diagnostics = extra.get("diagnostics")
        compared = diagnostics.get("previous_message_id") if isinstance(diagnostics, dict) else None
        _add_reference(found, "diagnostics", compared)
        for message in view.messages:
            content = message.get("content")
            if isinstance(content, list):
                _files_named(found, content)
    elif type(view) is ResponsesBody:
        for item in view.input if isinstance(view.input, list) else ():
            kind = item.get("type")
            if (
                kind == "item_reference"
                or (kind is None and "role" not in item and "content" not in item)
                or (kind == "reasoning" and not item.get("encrypted_content"))
                # An earlier image taken up again (multi-turn editing): read from the stored
                # answer by its id when it comes without the image.
                or (kind == "image_generation_call" and not item.get("result"))
                # A typed item of its id alone: nothing of its own to send, only to look up.
                or (kind is not None and item.keys() <= _ID_ALONE)
            ):
                _add_reference(found, "item", item.get("id"))
            # A code interpreter's or hosted shell's call sent back: the container it names may be
            # taken up again by the tool (the provider does not say it is not).
            environment = item.get("environment")
            container = environment.get("container_id") if isinstance(environment, dict) else None
            _add_reference(found, "input_container", item.get("container_id") or container)
        for tool in view.tools or ():
            environment = tool.get("environment")
            if isinstance(environment, dict) and environment.get("type") == "container_reference":
                _add_reference(found, "container", environment.get("container_id"))
            _add_reference(found, "container", tool.get("container"))  # an id, or {"type": "auto"}
        options = (view.model_extra or {}).get("prompt_cache_options")
        compared = options.get("comparison_response_id") if isinstance(options, dict) else None
        _add_reference(found, "comparison", compared)
    return tuple(dict.fromkeys(found))


def _files_named(found: list[Reference], blocks: list[Any]) -> None:
    """The Files API ids a Messages call's content names: a ``container_upload`` (the file put in
    the code execution container), a document or an image whose source is ``{"type": "file"}``,
    also in a tool result's content. A file another tenant's code wrote is kept in the same
    workspace (the key's), for any call to name."""
    for block in blocks:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "container_upload":
            _add_reference(found, "file", block.get("file_id"))
        elif kind == "tool_result" and isinstance(block.get("content"), list):
            _files_named(found, block["content"])
        else:
            source = block.get("source")  # a document's or an image's
            if isinstance(source, dict) and source.get("type") == "file":
                _add_reference(found, "file", source.get("file_id"))


def _fingerprinted(view: MessagesBody, anthropic_beta: str) -> bool:
    """Whether the provider keeps a fingerprint of the call's prompt under its answer's id, for a
    later call's cache diagnostics: a call asking for them (``diagnostics``, its
    ``previous_message_id`` null on a first turn), and any call with the beta's header (its
    docs: a fingerprint of each request then)."""
    return (
        isinstance((view.model_extra or {}).get("diagnostics"), dict) or "cache-diagnosis-" in anthropic_beta
    )


# The fields of an input item that names a stored one and holds nothing of it.
_ID_ALONE = frozenset({"type", "id", "status"})


def _add_reference(found: list[Reference], what: str, ref: Any) -> None:
    if isinstance(ref, str) and ref:
        found.append((what, ref))


def _stored_prompt(view: RequestView) -> str | None:
    """Where the size of a Responses call's stored prompt is kept: its id and version (none
    named: the current one, under a key of its own), apart from any response id."""
    prompt = view.prompt if type(view) is ResponsesBody else None
    found = prompt.get("id") if isinstance(prompt, dict) else None
    if not isinstance(found, str) or not found:
        return None
    version = prompt.get("version") if isinstance(prompt, dict) else None
    versioned = isinstance(version, str | int) and not isinstance(version, bool)
    named = f"{found}@{version}" if versioned else found
    # Always a digest: a prompt id is never taken for a response's or a conversation's.
    return "#" + hashlib.sha256(("prompt:" + named).encode("utf-8", "surrogatepass")).hexdigest()


def _asks_media(modalities: Any) -> bool:
    """Audio (OpenAI's audio models) or images (OpenRouter's image models): output tokens
    billed that no text shows (a transcript, if any, is a fraction of them)."""
    return isinstance(modalities, list) and ("audio" in modalities or "image" in modalities)


def _asks_images(modalities: Any) -> bool:
    return isinstance(modalities, list) and "image" in modalities


def _predicts(prediction: Any) -> bool:
    """A Predicted Output with content (a string or text parts): what of it the answer does not
    take is billed as output (``rejected_prediction_tokens``) and never streamed."""
    content = prediction.get("content") if isinstance(prediction, dict) else None
    return bool(content) and isinstance(content, str | list)


def _reasons(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Whether the request asks the model to reason: OpenAI's reasoning tokens are never
    streamed, and Claude 4's thinking is streamed as a summary while it bills the whole (every
    type but disabled thinks: enabled, adaptive, between_tools), on chat too through Anthropic's
    OpenAI-compatible endpoint, which never returns it."""
    thinking = body.get("thinking") if endpoint in ("messages", "chat.completions") else None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if isinstance(kind, str) and kind != "disabled":
        return True
    if endpoint == "messages":
        return False
    if _gemini_thinks(body):
        return True
    effort = body.get("reasoning_effort")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and endpoint == "responses":
        effort = reasoning.get("effort")
    elif isinstance(reasoning, dict) and reasoning.get("enabled") is not False:
        # OpenRouter's unified parameter on chat: an effort, a token budget, or on (its exclude
        # hides the reasoning from the answer, which is billed all the same).
        budget = reasoning.get("max_tokens")
        if reasoning.get("enabled") is True or (isinstance(budget, int) and budget > 0):
            return True
        effort = reasoning.get("effort", effort)
    return isinstance(effort, str) and effort != "none"


def _gemini_thinks(body: dict[str, Any]) -> bool:
    """Gemini's OpenAI-compatible thinking switch (the SDK's ``extra_body={"extra_body": {"google":
    {"thinking_config": ...}}}``): its thoughts are billed and never streamed (``include_thoughts``:
    a summary of them). A budget of 0 turns thinking off."""
    extra = body.get("extra_body")
    google = extra.get("google") if isinstance(extra, dict) else None
    config = google.get("thinking_config") if isinstance(google, dict) else None
    if not isinstance(config, dict):
        return False
    return config.get("thinking_budget") != 0
