"""Observe Anthropic Messages answers: its stream's events and its whole bodies, read into an
``Observation``, and its usage (``anthropic_usage``) read into ours.
"""

from __future__ import annotations

from typing import Any

from proxy.observe import Observation, ProviderUsage, add_id, json_text, token_count
from proxy.payload import FAST_TIER, US_GEO, messages_tier

# The iterations ``usage.iterations`` tells apart from its top-level counts.
_BESIDE_TOP_LEVEL = frozenset({"compaction", "advisor_message"})


def anthropic_usage(raw: Any) -> ProviderUsage | None:
    """Anthropic's ``input_tokens`` leaves out cache reads and writes; ours includes them. Any
    count that is not one makes the whole unusable (None), as OpenAI usage is: the text is then
    counted, never billed as 0."""
    if not isinstance(raw, dict):
        return None
    counts = _anthropic_counts(raw)
    iterations = raw.get("iterations")
    # The thinking part of output_tokens, as OpenAI's reasoning_tokens are of completion_tokens:
    # recorded, priced at the reasoning rate (the output's unless the operator prices it), never
    # billed beside the output.
    details = raw.get("output_tokens_details")
    thinking = token_count((details.get("thinking_tokens") if isinstance(details, dict) else None) or 0)
    if counts is None or thinking is None or (iterations is not None and not isinstance(iterations, list)):
        return None
    input_tokens, output_tokens, cache_read, cache_creation, hour, split = counts
    # Context compaction (a beta the client turns on): the summarizing step is billed too, and
    # is left out of the top-level figures, as the advisor tool's consultations are (refused up
    # front: another model's, at its prices; counted at the call's should one come all the same);
    # every other iteration is in them. Those tell their own writes' TTL split, which the
    # top-level one may not: a stream's message_delta tells no split, and the writes of the
    # turns after message_start's (a server tool's results) come in its cumulative count alone.
    beside: list[tuple[int, int | None, int, int, int, int]] = []
    within_hour = within_split = 0
    for iteration in iterations or ():
        if not isinstance(iteration, dict):
            continue
        more = _anthropic_counts(iteration)
        if iteration.get("type") in _BESIDE_TOP_LEVEL:
            if more is None or more[1] is None:
                return None
            beside.append(more)
        elif more is not None:
            within_hour += more[4]
            within_split += more[5]
    hour, split = max(hour, within_hour), max(split, within_split)
    for more in beside:
        input_tokens += more[0]
        if output_tokens is not None:  # else the final figures are still to come
            output_tokens += more[1] or 0
        cache_read += more[2]
        cache_creation += more[3]
        hour += more[4]
        split += more[5]
    return ProviderUsage(
        input_tokens=input_tokens + cache_read + cache_creation,
        output_tokens=output_tokens or 0,
        cached_input_tokens=cache_read,
        reasoning_tokens=min(thinking, output_tokens or 0),
        cache_creation_input_tokens=cache_creation,
        cache_creation_1h_input_tokens=min(hour, cache_creation),
        cache_creation_untold_input_tokens=max(0, cache_creation - split),
        output_known=output_tokens is not None,
    )


def _anthropic_counts(raw: dict[str, Any]) -> tuple[int, int | None, int, int, int, int] | None:
    """Input, output (None: not given yet), cache reads, cache writes, the writes kept an hour
    and the writes its TTL split tells (kept five minutes or an hour); None when a count is not
    one."""
    input_tokens = token_count(raw.get("input_tokens"))
    given = raw.get("output_tokens")
    output_tokens = None if given is None else token_count(given)
    # Cache fields may be absent or null: none of that kind.
    cache_read = token_count(raw.get("cache_read_input_tokens") or 0)
    cache_creation = token_count(raw.get("cache_creation_input_tokens") or 0)
    # Writes kept an hour cost more than those kept five minutes: their share of the writes.
    split = raw.get("cache_creation")
    split = split if isinstance(split, dict) else {}
    hour = token_count(split.get("ephemeral_1h_input_tokens") or 0)
    minutes = token_count(split.get("ephemeral_5m_input_tokens") or 0)
    if input_tokens is None or cache_read is None or cache_creation is None or hour is None:
        return None
    if minutes is None or (given is not None and output_tokens is None):
        return None
    return input_tokens, output_tokens, cache_read, cache_creation, hour, hour + minutes


# Blocks that are calls of a tool (the client's, or one Anthropic runs), not text.
_ANTHROPIC_CALLS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})


def anthropic_event(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    kind = obj.get("type")
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict):
            if delta.get("type") == "text_delta":
                obs.add_text(0, delta.get("text"), content=True)
            elif delta.get("type") == "compaction_delta":  # the context's summary: output too
                obs.add_text(0, delta.get("content"), content=False)
            else:  # tool input, thinking: output tokens too (a citation's cited text is not)
                for key in ("partial_json", "thinking"):
                    obs.add_text(0, delta.get(key), content=False)
    elif kind == "content_block_start":
        block = obj.get("content_block")
        if isinstance(block, dict) and block.get("type") in _ANTHROPIC_CALLS:
            obs.calls.add(0)  # an answer that is a call: not text held to JSON
            obs.add_text(0, block.get("name"), content=False)  # written, not streamed as a delta
            if block.get("type") == "server_tool_use":  # a search run: billed if no usage tells it
                obs.saw_tool_use(block.get("name"))
        elif isinstance(block, dict) and block.get("type") == "compaction":
            obs.add_text(0, block.get("content"), content=False)  # a summary may come whole here
        elif isinstance(block, dict):
            _files_written(obs, block)  # a server tool's result comes whole in its start
            _tool_failed(obs, block)
    elif kind == "message_start":
        message = obj.get("message")
        if isinstance(message, dict):
            _answer_id(obs, message)
        if isinstance(message, dict) and message.get("container") is not None:
            _container(obs, message["container"])
        if isinstance(message, dict) and isinstance(message.get("usage"), dict):
            obs.partial_usage.update(message["usage"])
            _anthropic_tier(obs, message["usage"])
            _server_tool_use(obs, message["usage"])
            obs.usage = anthropic_usage(obs.partial_usage)
            obs.usage_final = False  # output_tokens arrives with message_delta
    elif kind == "message_delta":
        delta = obj.get("delta")
        if isinstance(delta, dict) and delta.get("container") is not None:
            _container(obs, delta["container"])
        if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
            obs.finish_reasons[0] = delta["stop_reason"]
            if delta["stop_reason"] == "refusal":
                obs.refused = True
        if isinstance(obj.get("usage"), dict):
            _take_delta_usage(obs.partial_usage, obj["usage"])
            _anthropic_tier(obs, obs.partial_usage)  # a part may leave out what an earlier one told
            # The last part's: one without the count (a gateway's) leaves the searches shown since
            # an earlier count to be billed (message_start's is the placeholder before them).
            obs.tool_calls_told = _server_tool_use(obs, obj["usage"])
            obs.usage = anthropic_usage(obs.partial_usage)
            if obs.usage is None:
                obs.take_output_alone(obs.partial_usage)
            # Final only with an output count of its own (message_start's is a placeholder), and
            # once the answer has stopped: a message_delta before the one with the stop reason
            # (a turn with server tools may send several) tells the output so far.
            told = token_count(obj["usage"].get("output_tokens")) is not None
            obs.output_told = obs.output_told or told
            obs.usage_final = told and 0 in obs.finish_reasons
    elif kind == "message_stop":
        obs.done = True
        # The answer is whole: the last output count told is final, its stop reason sent with
        # it, in a later message_delta, or never (gateways that translate another API's stream).
        obs.usage_final = obs.usage_final or obs.output_told
    elif kind == "error":
        obs.error = True


# Input counts message_delta repeats from message_start (or grows: a server tool's results read).
_CUMULATIVE_INPUT = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def _take_delta_usage(held: dict[str, Any], usage: dict[str, Any]) -> None:
    """message_delta's usage over what message_start told. Its counts are cumulative: a 0 below
    the count held is a placeholder (upstreams that tell the input in message_start alone:
    SGLang's Anthropic API, gateways), not the input shrinking; the held one stands. Any other
    count is the final one, lower too (message_start's may be an estimate: NVIDIA Dynamo's, the
    whole prompt, its cache reads among it). Not beside compaction's ``iterations``, where the
    top-level counts are a part of the whole."""
    given = {k: v for k, v in usage.items() if v is not None}
    if "iterations" not in given:
        for key in _CUMULATIVE_INPUT:
            if key in given:
                given[key] = _cumulative(held.get(key), given[key])
        split, held_split = given.get("cache_creation"), held.get("cache_creation")
        if isinstance(split, dict) and isinstance(held_split, dict):
            given["cache_creation"] = {
                **held_split,
                **{k: _cumulative(held_split.get(k), v) for k, v in split.items()},
            }
    held.update(given)


def _cumulative(held: Any, given: Any) -> Any:
    return held if token_count(given) == 0 and token_count(held) else given


_REQUESTS = "_requests"


def _server_tool_use(obs: Observation, usage: Any) -> bool:
    """The calls of Anthropic's server tools (``usage.server_tool_use``: ``web_search_requests``,
    ``web_fetch_requests``), by tool (``web_search``). A stream's counts are cumulative
    (message_delta's repeat or grow message_start's): the largest told stands. False when the
    usage counts none (no ``server_tool_use``)."""
    told = usage.get("server_tool_use") if isinstance(usage, dict) else None
    if not isinstance(told, dict):
        return False
    for key, value in told.items():
        count = token_count(value)
        if count and isinstance(key, str) and key.endswith(_REQUESTS) and len(key) > len(_REQUESTS):
            tool = key[: -len(_REQUESTS)]
            obs.tool_calls[tool] = max(count, obs.tool_calls.get(tool, 0))
    return True


def _anthropic_tier(obs: Observation, usage: Any) -> None:
    """The tier Anthropic says served the call: fast mode (``usage.speed``) and US-only inference
    (``usage.inference_geo``, which a workspace may default to) are priced as tiers of their own
    (``payload.messages_tier``). ``usage.service_tier`` tells the capacity (priority, standard),
    not those. An answer telling both is its tier; one telling one of them (a gateway's, passing
    some on) is the call's asked tier with it (``served_tier``: a fast call told its standard
    speed is the default, or ``us`` where it asked the US); one telling neither keeps the asked
    tier, or the capacity's where that is not "standard"."""
    if not isinstance(usage, dict):
        return
    tier, speed, geo = usage.get("service_tier"), usage.get("speed"), usage.get("inference_geo")
    told_fast = speed == FAST_TIER if isinstance(speed, str) else None
    told_us = geo == US_GEO if isinstance(geo, str) else None
    capacity = tier if isinstance(tier, str) and tier and tier != "standard" else None
    if told_fast is not None and told_us is not None:
        obs.service_tier = messages_tier(fast=told_fast, us=told_us) or capacity or "default"
    elif told_fast or told_us or (capacity is None and (told_fast is not None or told_us is not None)):
        obs.tier_told = (told_fast, told_us)
    elif capacity is not None:
        obs.service_tier = capacity


def _container(obs: Observation, container: Any) -> None:
    """The code execution container the answer ran in (kept, with its files, for a later call)."""
    add_id(obs.container_ids, container.get("id") if isinstance(container, dict) else None)


def _tool_failed(obs: Observation, block: dict[str, Any]) -> None:
    """A server tool's call the answer showed whose result is an error (``<tool>_tool_result``
    holding a ``<tool>_tool_result_error``: past the request's ``max_uses``, a search that
    failed): not billed by the provider, so not counted as a call its usage did not count."""
    kind = block.get("type")
    content = block.get("content")
    if not (isinstance(kind, str) and kind.endswith(_TOOL_RESULT) and isinstance(content, dict)):
        return
    if content.get("type") != kind + "_error" or not obs.tool_uses:
        return
    tool = kind[: -len(_TOOL_RESULT)]
    if obs.tool_uses.get(tool, 0) > 0:
        obs.tool_uses[tool] -= 1
        if not obs.tool_uses[tool]:  # none left: no tool ran (``settle._rates`` reads so)
            del obs.tool_uses[tool]
            obs.tool_uses = obs.tool_uses or None


_TOOL_RESULT = "_tool_result"


def _files_written(obs: Observation, block: dict[str, Any]) -> None:
    """The files a code execution wrote, told by their Files API ids in its result
    (``code_execution_tool_result`` / ``bash_code_execution_tool_result``: a
    ``*code_execution_result`` whose ``content`` lists ``*code_execution_output`` blocks, each a
    ``file_id``). The provider keeps them in the key's workspace, apart from the container,
    until deleted: a later call names them (``container_upload``, a document's source)."""
    kind = block.get("type")
    ran = isinstance(kind, str) and kind.endswith("code_execution_tool_result")
    result = block.get("content") if ran else None
    outputs = result.get("content") if isinstance(result, dict) else None
    for output in outputs if isinstance(outputs, list) else ():
        if isinstance(output, dict) and str(output.get("type")).endswith("code_execution_output"):
            add_id(obs.file_ids, output.get("file_id"))


def _answer_id(obs: Observation, message: dict[str, Any]) -> None:
    """The answer's id: a thread's state (or a cache diagnostics fingerprint) is kept under it."""
    found = message.get("id")
    if isinstance(found, str) and found:
        obs.response_id = found


def anthropic_body(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    if obj.get("type") == "error" or isinstance(obj.get("error"), dict):  # a gateway's OpenAI shape
        obs.error = True
        return
    _answer_id(obs, obj)
    if obj.get("container") is not None:
        _container(obs, obj["container"])
    reason = obj.get("stop_reason")
    if isinstance(reason, str):
        obs.finish_reasons[0] = reason
        if reason == "refusal":
            obs.refused = True
    for block in obj.get("content") or ():
        if isinstance(block, dict):
            if block.get("type") == "text":
                obs.add_text(0, block.get("text"), content=True)
            elif block.get("type") in _ANTHROPIC_CALLS:
                obs.calls.add(0)
                obs.add_text(0, block.get("name"), content=False)
                obs.add_text(0, json_text(block.get("input")), content=False)
                if block.get("type") == "server_tool_use":
                    obs.saw_tool_use(block.get("name"))
            elif block.get("type") == "thinking":
                obs.add_text(0, block.get("thinking"), content=False)
            elif block.get("type") == "compaction":  # the summary compaction wrote: billed output
                obs.add_text(0, block.get("content"), content=False)
            else:
                _files_written(obs, block)
                _tool_failed(obs, block)
    _anthropic_tier(obs, obj.get("usage"))
    obs.tool_calls_told = _server_tool_use(obs, obj.get("usage"))
    obs.usage = anthropic_usage(obj.get("usage"))
    if obs.usage is None:
        obs.take_output_alone(obj.get("usage"))
    obs.usage_final = obs.usage is None or obs.usage.output_known
