"""Observe the OpenAI Responses API's answers: its stream's typed events and its whole bodies,
read into an ``Observation`` (status, refusals, calls, usage and the text written).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proxy.observe import (
    Observation,
    ProviderUsage,
    add_id,
    json_text,
    parse_usage,
    pieces_of,
    token_count,
)


def _responses_output(obs: Observation, response: dict[str, Any], *, texts: bool) -> None:
    """Status, refusals, usage and (for a whole body) the text of a response object."""
    _response_id(obs, response)
    status = response.get("status")
    details = response.get("incomplete_details")
    reason = details.get("reason") if isinstance(details, dict) else None
    if status == "incomplete":
        obs.finish_reasons[0] = str(reason or "incomplete")
    elif isinstance(status, str):
        obs.finish_reasons[0] = status
    if status == "failed":
        obs.error = True
    tier = response.get("service_tier")
    if isinstance(tier, str) and tier:
        obs.service_tier = tier
    usage = parse_usage(response.get("usage"))
    if usage is not None:
        usage = _with_image_tokens(usage, response.get("tool_usage"))
        obs.take_usage(_with_svg_authoring(usage, response.get("output")))
    else:
        obs.take_output_alone(response.get("usage"))
    tool_calls: dict[str, int] = {}
    for item in response.get("output") or ():
        if not isinstance(item, dict):
            continue
        _item_id(obs, item)
        kind = item.get("type")
        final = not _side_message(item)
        if _is_call(kind):
            obs.calls.add(0)  # function_call, custom_tool_call, computer_call, ...: not text
            if (
                isinstance(kind, str)
                and kind.endswith(_CALL)
                and len(kind) > len(_CALL)
                and _billed_call(item)
            ):
                # A hosted tool's call (web_search_call: web_search), priced per call.
                tool = kind[: -len(_CALL)]
                tool_calls[tool] = tool_calls.get(tool, 0) + 1
            if texts:
                for text in _call_texts(item):
                    obs.add_text(0, text, content=False)
        if kind in _UNCOUNTED_ITEMS:
            obs.hidden_output = True
        if texts and kind == "reasoning":
            # A reasoning item's summary (and its text, where sent): output the provider bills,
            # counted as a stream's reasoning deltas are when no usage comes.
            for part in item.get("summary") or ():
                if isinstance(part, dict):
                    obs.add_text(0, part.get("text"), content=False)
        for part in item.get("content") or ():
            if not isinstance(part, dict):
                continue
            if part.get("type") == "reasoning_text" and texts:
                obs.add_text(0, part.get("text"), content=False)
            elif part.get("type") == "refusal":
                obs.refused = True
                if texts:
                    obs.add_text(0, part.get("refusal"), content=False)
            elif part.get("type") == "output_text" and texts:
                obs.add_text(0, part.get("text"), content=final)
    searches = _billable_searches(response.get("tool_usage"))
    if searches is not None and searches > tool_calls.get(_WEB_SEARCH, 0):
        # More searches told than items (a search of several queries): the provider's count.
        # Fewer is no proof that a search the answer shows went unbilled (a discounted one, or
        # one whose usage was not recorded: "tool families with no recorded usage have zero
        # counts"): the items stand there, as an unsure reading bills the more.
        tool_calls[_WEB_SEARCH] = searches
    # The final response object holds every item: counted once (a stream's events are not). A
    # failed one may list none of those the stream showed (``with_tool_calls`` bills the more).
    obs.tool_calls = tool_calls


def _billable_searches(tool_usage: Any) -> int | None:
    """The web searches OpenAI bills, as the answer counts them (``tool_usage.web_search``'s
    ``num_requests``: discounted searches and page actions left out); None where not told."""
    search = tool_usage.get("web_search") if isinstance(tool_usage, dict) else None
    return token_count(search.get("num_requests")) if isinstance(search, dict) else None


_CALL = "_call"
_SEARCH_CALL = "web_search_call"
_WEB_SEARCH = "web_search"  # its tool, as priced
# A web search call's actions that are no search (OpenAI's web search guide: "Search actions
# incur a tool call cost"): opening a page of its results, finding a pattern in one. Any other
# action, or none told, is billed as a search: an action not known here is never left unbilled.
_PAGE_ACTIONS = frozenset({"open_page", "find_in_page", "find"})  # "find": the API's older name


def _billed_call(item: dict[str, Any]) -> bool:
    """Whether a hosted tool's call item is a call billed: every one but a web search call
    whose action opens or reads a page."""
    if item.get("type") != _SEARCH_CALL:
        return True
    action = item.get("action")
    return not (isinstance(action, dict) and action.get("type") in _PAGE_ACTIONS)


def _search_begun(obs: Observation, index: int) -> None:
    """A streamed web search call begun: a search until its item is done and tells its action
    (``_search_done``); a stream cut before that bills it as one, the bound."""
    searches = _web_searches(obs)
    if not searches.get(index, False):
        obs.saw_tool_use("web_search")
    searches[index] = True


def _search_done(obs: Observation, index: int, item: dict[str, Any]) -> None:
    """A streamed web search call done, its action told: counted in ``tool_uses`` when it is a
    search, taken back out when it began as one (its action not told yet) and is not."""
    searches = _web_searches(obs)
    billed = _billed_call(item)
    counted = searches.get(index, False)
    if counted and not billed and obs.tool_uses:
        obs.tool_uses["web_search"] -= 1
        if not obs.tool_uses["web_search"]:  # none left: no tool ran (``settle._rates`` reads so)
            del obs.tool_uses["web_search"]
            obs.tool_uses = obs.tool_uses or None
    elif billed and not counted:
        obs.saw_tool_use("web_search")
    searches[index] = billed


def _web_searches(obs: Observation) -> dict[int, bool]:
    if obs.web_searches is None:
        obs.web_searches = {}
    return obs.web_searches


def _output_index(obj: dict[str, Any]) -> int | None:
    index = obj.get("output_index")
    return index if isinstance(index, int) and not isinstance(index, bool) else None


# What the model writes for a call, output it bills: the tool's name, its arguments or input, the
# code interpreter's code, and (see _call_texts) what it writes as a structure. A stream's deltas
# carry all but the name, told whole as the item starts, and the calls that stream none (below).
_CALL_INPUTS = ("arguments", "input", "code")
_CALL_TEXTS = ("name", *_CALL_INPUTS)
# Written as structures, counted as JSON: an action (a command, a search, a click), a computer
# call's batch of actions, a file search's queries, an apply_patch operation (its path and diff).
_CALL_STRUCTURES = ("action", "actions", "queries", "operation")
# Calls told whole in their items (response.output_item.added, then .done), with no deltas; an
# apply_patch operation's diff streams, so it is not among them.
_UNSTREAMED_CALLS = frozenset(
    {"mcp_approval_request", "local_shell_call", "computer_call", "web_search_call", "file_search_call"}
)
# Items whose output tokens no text shows: reasoning (hidden, or summarized), a generated
# image (its image tokens, and each partial image's, billed; its base64 is not their count) and
# a server-side compaction's summary (``context_management``: written by a pass of the model,
# sent only encrypted).
_UNCOUNTED_ITEMS = frozenset({"reasoning", "image_generation_call", "compaction"})


def _call_texts(item: dict[str, Any], fields: tuple[str, ...] = _CALL_TEXTS) -> list[Any]:
    """The ``fields`` of a call item, and its structures (``_CALL_STRUCTURES``) as JSON."""
    texts = [item.get(name) for name in fields]
    for name in _CALL_STRUCTURES:
        value = item.get(name)
        if name == "action" and item.get("actions"):
            continue  # a computer call's batch holds every action, a lone one told beside it too
        if isinstance(value, dict) and name == "action":
            # Not what the model wrote: a web search's sources (the tool's results, there when
            # asked for), and its deprecated ``query``, the first of its ``queries`` told again.
            drop = ("sources", "query") if "queries" in value else ("sources",)
            value = {k: v for k, v in value.items() if k not in drop}
        if isinstance(value, dict | list) and value:
            texts.append(json_text(value))
    return texts


def _is_call(kind: Any) -> bool:
    return isinstance(kind, str) and (kind.endswith("_call") or kind == "mcp_approval_request")


def _with_image_tokens(usage: ProviderUsage, tool_usage: Any) -> ProviderUsage:
    """``usage`` with the image generation tool's tokens, which OpenAI reports apart from it
    (``tool_usage.image_gen``) and bills all the same, at the image model's prices: its image
    tokens at the model's image rates (``image_input``, ``image_output``: as text unless the
    operator priced them), its text at the model's text rates. Output not split into image and
    text (``output_tokens_details`` "can be omitted") is all image tokens, as an unsure reading
    bills the more; so is an input split that does not add up."""
    image = tool_usage.get("image_gen") if isinstance(tool_usage, dict) else None
    if not isinstance(image, dict):
        return usage
    read = token_count(image.get("input_tokens")) or 0
    wrote = token_count(image.get("output_tokens")) or 0
    if not (read or wrote):
        return usage
    images_read = _image_part(image.get("input_tokens_details"), read)
    images_wrote = _image_part(image.get("output_tokens_details"), wrote)
    return replace(
        usage,
        input_tokens=usage.input_tokens + read,
        output_tokens=usage.output_tokens + wrote,
        image_input_tokens=usage.image_input_tokens + images_read,
        image_output_tokens=usage.image_output_tokens + images_wrote,
    )


def _image_part(details: Any, whole: int) -> int:
    """Of ``whole`` image generation tokens, the image tokens ``details`` tells: those of a split
    whose text tokens are told and leave that many (else all of them)."""
    if not isinstance(details, dict):
        return whole
    text = token_count(details.get("text_tokens"))
    told = token_count(details.get("image_tokens"))
    if text is None or told is None or text + told < whole:
        return whole
    return min(told, whole)


def _with_svg_authoring(usage: ProviderUsage, output: Any) -> ProviderUsage:
    """``usage`` with the tokens the image generation tool's SVG author (``output_format:
    "svg"``) read and wrote, which each call item tells in its ``svg_usage``, apart from both
    ``usage`` and ``tool_usage.image_gen``, and OpenAI bills all the same; priced at the model's
    text rates, as the image tool's text is (an author of another model named is refused up front:
    ``payload``)."""
    read = wrote = reasoned = 0
    for item in output if isinstance(output, list) else ():
        svg = item.get("svg_usage") if isinstance(item, dict) else None
        if isinstance(svg, dict):
            read += token_count(svg.get("input_tokens")) or 0
            wrote += token_count(svg.get("output_tokens")) or 0
            reasoned += token_count(svg.get("reasoning_tokens")) or 0
    if not (read or wrote):
        return usage
    return replace(
        usage,
        input_tokens=usage.input_tokens + read,
        output_tokens=usage.output_tokens + wrote,
        reasoning_tokens=usage.reasoning_tokens + min(reasoned, wrote),
    )


def _side_message(item: dict[str, Any]) -> bool:
    """A message that is not the answer: commentary before it (``phase``, gpt-5.3-codex on).
    With a structured output only the final answer is JSON (the SDK parses only it)."""
    phase = item.get("phase")
    return item.get("type") == "message" and phase is not None and phase != "final_answer"


def _item_id(obs: Observation, item: dict[str, Any]) -> None:
    add_id(obs.item_ids, item.get("id"))
    container = item.get("container_id")  # a code interpreter's: kept, with its files
    environment = item.get("environment")
    if container is None and isinstance(environment, dict):
        # A hosted shell's call tells its container (one it made, too) as a container_reference.
        container = environment.get("container_id")
    add_id(obs.container_ids, container)


def _response_id(obs: Observation, response: dict[str, Any]) -> None:
    found = response.get("id")
    if isinstance(found, str) and found:
        obs.response_id = found


# Deltas that are not text: base64 audio (its tokens are not its characters').
_UNCOUNTED_DELTAS = frozenset({"response.audio.delta", "response.image_generation_call.partial_image"})


def responses_event(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    kind = obj.get("type")
    if kind == "response.output_text.delta":
        side = obs.side_messages and (
            obj.get("output_index") in obs.side_messages or obj.get("item_id") in obs.side_messages
        )
        obs.add_text(0, obj.get("delta"), content=not side)
    elif kind == "response.output_item.added":
        item = obj.get("item")
        if isinstance(item, dict):
            _item_id(obs, item)  # a stream cut before its end leaves the items made so far
        if isinstance(item, dict) and item.get("type") in _UNCOUNTED_ITEMS:
            obs.hidden_output = True  # it thinks, or draws: tokens billed, never streamed as text
        if isinstance(item, dict) and _is_call(item.get("type")):
            obs.add_text(0, item.get("name"), content=False)  # never streamed as a delta
            kind = item["type"]
            index = _output_index(obj) if kind == _SEARCH_CALL else None
            if index is not None:
                _search_begun(obs, index)  # counted as a search until its action is told
            elif kind.endswith(_CALL) and len(kind) > len(_CALL):
                # A hosted tool's call begun (web_search_call): billed if the stream is cut before
                # the final response counts it.
                obs.saw_tool_use(kind[: -len(_CALL)])
        if isinstance(item, dict) and _side_message(item):
            for key in (obj.get("output_index"), item.get("id")):
                if isinstance(key, int | str) and not isinstance(key, bool):
                    obs.side_messages.add(key)
        elif isinstance(item, dict) and item.get("type") == "message" and item.get("phase") is None:
            # Its phase may be told only once it is done: where its text starts, to take it
            # back out of the answer then (items stream one after another).
            obs.message_starts[obj.get("output_index")] = obs.content_mark(0)
    elif kind == "response.output_item.done":
        start = obs.message_starts.pop(obj.get("output_index"), None) if obs.message_starts else None
        item = obj.get("item")
        if isinstance(item, dict):
            _item_id(obs, item)
        index = _output_index(obj) if isinstance(item, dict) and item.get("type") == _SEARCH_CALL else None
        if index is not None and isinstance(item, dict):
            _search_done(obs, index, item)  # without an index: counted as it began, a search
        if isinstance(item, dict) and item.get("type") in _UNSTREAMED_CALLS:
            for text in _call_texts(item, _CALL_INPUTS):  # whole now; its name was counted
                obs.add_text(0, text, content=False)
        if start is not None and isinstance(item, dict) and _side_message(item):
            moved = [p.decode() if isinstance(p, bytes) else p for p in obs.content_since(0, start)]
            extras = pieces_of(obs.extras, 0)
            extras.extend(moved)
            extras.compact()
    elif isinstance(kind, str) and kind.endswith(".delta") and kind not in _UNCOUNTED_DELTAS:
        # Refusals, call arguments and inputs, reasoning text and summaries: output tokens too,
        # counted when no usage comes (a cancelled stream, say).
        if kind == "response.refusal.delta":
            obs.refused = True
        elif kind.startswith("response.reasoning_summary"):
            obs.hidden_output = True  # a summary of reasoning that is itself not streamed
        elif "call" in kind:
            obs.calls.add(0)
        obs.add_text(0, obj.get("delta"), content=False)
    elif kind == "response.created":
        response = obj.get("response")
        if isinstance(response, dict):
            _response_id(obs, response)  # a stream cut after it leaves a response a call can continue
    elif kind in ("response.completed", "response.incomplete", "response.failed"):
        response = obj.get("response")
        if isinstance(response, dict):
            _responses_output(obs, response, texts=False)
        if kind == "response.failed":
            obs.error = True
        obs.done = True
    elif kind == "error":
        obs.error = True


# A whole response body in these states is not the answer yet (OpenAI's background mode).
_NOT_DONE = frozenset({"queued", "in_progress"})


def responses_body(obs: Observation, obj: dict[str, Any]) -> None:
    obs.chunks += 1
    _responses_output(obs, obj, texts=True)
    if isinstance(obj.get("error"), dict):  # a 200 that says it failed (a response has "error": null)
        obs.error = True
    if obj.get("status") in _NOT_DONE:
        # Queued (background mode: refused up front, but an upstream may queue on its own): the
        # answer is written, and billed, later, outside this call. Nothing to count: its reserve.
        obs.error = True
        obs.pending = True
