"""Hosted tools priced per call (``models.PATTERN.price_per_thousand_calls``), beside the tokens:
the calls a request may make at most (reserved), and the calls a settle bills.

Counted by tool name: Anthropic's ``usage.server_tool_use`` counts each ``<tool>_requests``
(``web_search_requests``: ``web_search``), a Responses answer each output item of type
``<tool>_call`` (``web_search_call``: ``web_search``, its search actions only;
``observe_responses``). A chat call has one hosted tool, OpenAI's search (its search models
search the web before every answer; others search when asked with ``web_search_options``): one
``web_search`` call, which no answer counts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from proxy.config_models import RESPONSES_COUNTED_AS
from proxy.errors import BadRequest
from proxy.payload import ChatBody, MessagesBody, RequestView, ResponsesBody

# Every Responses tool type's calls are ``<type>_call`` items (``code_interpreter_call``,
# ``image_generation_call``, ``mcp_call``, ``file_search_call``), but those of RESPONSES_COUNTED_AS.
# Priced under this name, web_search_preview's calls (web_search_call items too) are billed at
# its own price (OpenAI: $25 per 1,000 on a model that does not reason, web_search's $10).
WEB_SEARCH_PREVIEW = "web_search_preview"

# A search model's name: "search" as a part of it (``gpt-4o-search-preview``), not inside a word
# (``o3-deep-research``).
_SEARCH_MODEL = re.compile(r"(?:^|[-_./:])search(?:$|[-_./:])")

# A dated version of a Responses tool type (``web_search_preview_2025_03_11``).
_DATED = re.compile(r"(.+?)_\d{4}_\d{2}_\d{2}")

ToolCalls = tuple[tuple[str, int], ...]

# The Responses tools that run in a container the request may size (``memory_limit``: 1g, 4g,
# 16g, 64g), which OpenAI prices by its memory (64g at 64 times 1g's): a size above 1g is priced
# as ``<tool>_<size>`` (``code_interpreter_4g``, ``shell_64g``), and refused where it is not.
_SIZED_CONTAINERS = frozenset({"code_interpreter", "shell"})
_LEAST_MEMORY = "1g"


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def reserved_tool_calls(view: RequestView, prices: Mapping[str, int], default_calls: int) -> ToolCalls:
    """The calls of the priced tools (``prices``: ``ModelConfig.tool_rates``) the request enables,
    at most: an Anthropic server tool's ``max_uses`` (its ``type`` the tool's name and a version:
    ``web_search_20250305``), else ``default_calls`` for each; a Responses call's
    ``max_tool_calls``, which bounds every hosted tool call together, all at the dearest priced
    tool it enables, else ``default_calls`` for each. Empty when it enables none (nearly every
    call: ``prices`` is empty, or the request has no tools)."""
    if type(view) is ChatBody:
        return (("web_search", 1),) if "web_search" in prices and chat_searches(view) else ()
    tools = view.tools if (type(view) is MessagesBody or type(view) is ResponsesBody) else None
    if not prices or not tools:
        return ()
    found: dict[str, int] = {}
    if type(view) is MessagesBody:
        for tool in tools:
            name = _anthropic_tool(tool.get("type"), prices)
            if name is not None:
                uses = _count(tool.get("max_uses"))
                found[name] = found.get(name, 0) + (uses if uses else default_calls)
        return tuple(found.items())
    enabled = [_responses_tool(tool, prices) for tool in tools]
    priced = [name for name in dict.fromkeys(enabled) if name is not None and name in prices]
    if not priced:
        return ()
    bound = _pool_bound(view)
    if bound is None:
        return tuple((name, default_calls) for name in priced)
    # Every call may go to the dearest: reserved once, as that many calls of it.
    dearest = max(priced, key=lambda name: prices[name])
    return ((dearest, bound),)


# Anthropic's own tools that the client runs (the model stops for their results, as for a
# function's): every other typed tool runs on Anthropic's side, in the loop. An MCP toolset's
# calls are its server's (``mcp_servers``).
_CLIENT_RUN_TOOLS = frozenset({"custom", "bash", "text_editor", "computer", "memory", "mcp_toolset"})


def model_passes(view: RequestView, default_calls: int) -> int:
    """How many times a Messages request's server-tool loop may sample the model, each up to
    ``max_tokens`` (Anthropic: "The limit applies to each call to the requested model"): once
    after each call of a tool Anthropic runs, priced or not (its ``max_uses``, else
    ``default_calls``; ``default_calls`` for each MCP server), and the last. 1 for any other
    request: a Responses call's ``max_output_tokens`` bounds its whole response."""
    if type(view) is not MessagesBody:
        return 1
    calls = 0
    for tool in view.tools or ():
        if _server_tool(tool.get("type")):
            calls += _count(tool.get("max_uses")) or default_calls
    servers = (view.model_extra or {}).get("mcp_servers")
    if isinstance(servers, list):
        calls += len(servers) * default_calls
    return calls + 1


def _server_tool(kind: Any) -> bool:
    """Whether an Anthropic tool ``type`` is one Anthropic runs (``web_search_20250305``,
    ``code_execution_20250825``, ``tool_search_tool_regex``): any but a function (no type) and
    the tools the client runs, whatever their version. A tool type not known yet counts."""
    if not isinstance(kind, str):
        return False
    name, _, version = kind.rpartition("_")
    return (name if version.isdigit() else kind) not in _CLIENT_RUN_TOOLS


def _pool_bound(view: RequestView) -> int | None:
    return _count((view.model_extra or {}).get("max_tool_calls"))


def pools_tool_calls(view: RequestView) -> bool:
    """Whether one bound holds every hosted tool call of the request together (a Responses
    call's ``max_tool_calls``): its calls are reserved as one pool at the dearest tool, and a
    settle at the reserve bills what the pool leaves, not each tool's own reserve."""
    return type(view) is ResponsesBody and _pool_bound(view) is not None


def chat_searches(view: ChatBody) -> bool:
    """Whether a chat call searches the web: OpenAI's search models (``gpt-4o-search-preview``,
    ``gpt-5-search-api``) always do ("the model always retrieves information from the web before
    responding"), billed per call beside the tokens; a request may ask with
    ``web_search_options``."""
    return bool(_SEARCH_MODEL.search(view.model)) or isinstance(
        (view.model_extra or {}).get("web_search_options"), dict
    )


def _responses_tool(tool: dict[str, Any], prices: Mapping[str, int]) -> str | None:
    """The name a Responses tool's calls are priced under: its type's (undated), the name its
    calls are counted under, at its container's size (``_container_size``)."""
    name = _counted_tool(tool, prices)
    size = None if name is None else _container_size(name, tool)
    return name if size is None else f"{name}_{size}"


def _counted_tool(tool: dict[str, Any], prices: Mapping[str, int]) -> str | None:
    kind = tool.get("type")
    if not isinstance(kind, str):
        return None
    dated = _DATED.fullmatch(kind)
    name = dated.group(1) if dated else kind
    if name == WEB_SEARCH_PREVIEW and name in prices:
        return name
    return RESPONSES_COUNTED_AS.get(name, name)


def _container_size(name: str, tool: dict[str, Any]) -> str | None:
    """The memory a code interpreter's or hosted shell's new container asks for (``auto`` /
    ``container_auto``), when above the least; None for the least, or a container named by id."""
    if name not in _SIZED_CONTAINERS:
        return None
    container = tool.get("container") if name == "code_interpreter" else tool.get("environment")
    size = container.get("memory_limit") if isinstance(container, dict) else None
    return None if size is None or size == _LEAST_MEMORY else str(size)


def refuse_unpriced_containers(view: RequestView, prices: Mapping[str, int]) -> None:
    """Refuse a Responses request whose code interpreter or hosted shell asks a container larger
    than the least when the operator prices the tool and not that size: billed at the tool's one
    price, a 64g container would cost a 64th of what it is charged."""
    tools = view.tools if type(view) is ResponsesBody else None
    for tool in tools or ():
        name = _counted_tool(tool, prices)
        size = None if name is None or name not in prices else _container_size(name, tool)
        if name is not None and size is not None and f"{name}_{size}" not in prices:
            raise BadRequest(
                f"The {name} container's memory_limit '{size[:16]}' has no price for the model "
                f"'{view.model}' in this proxy's config: leave it at {_LEAST_MEMORY}, or ask the "
                f"operator to price '{name}_{size[:16]}'.",
                param="tools",
                code="unsupported_parameter",
            )


def counted_as(view: RequestView, prices: Mapping[str, int]) -> tuple[tuple[str, str], ...]:
    """The names a request's counted calls are billed under, where not their own: a Responses
    request enabling web_search_preview priced apart bills its web_search_call items at the
    preview's price (at the dearer, beside web_search: an item does not say which made it); one
    asking a larger container for a code interpreter or hosted shell, its calls at that size's
    (at the dearest size it asks)."""
    tools = view.tools if type(view) is ResponsesBody else None
    if not tools:
        return ()
    enabled = {_responses_tool(tool, prices) for tool in tools}
    found: list[tuple[str, str]] = []
    if (
        WEB_SEARCH_PREVIEW in prices
        and WEB_SEARCH_PREVIEW in enabled
        and not ("web_search" in enabled and prices.get("web_search", 0) > prices[WEB_SEARCH_PREVIEW])
    ):
        found.append(("web_search", WEB_SEARCH_PREVIEW))
    for base in sorted(_SIZED_CONTAINERS):
        sized = sorted(name for name in enabled if name and name.startswith(base + "_") and name in prices)
        if sized:
            dearest = max([*sized, *([base] if base in enabled else [])], key=lambda n: prices.get(n, 0))
            if dearest != base:
                found.append((base, dearest))
    return tuple(found)


def _anthropic_tool(kind: Any, prices: Mapping[str, int]) -> str | None:
    """The priced tool an Anthropic tool ``type`` names (``web_search_20250305``), if any."""
    if not isinstance(kind, str):
        return None
    name, _, version = kind.rpartition("_")
    return name if name in prices and version.isdigit() else None


def billed_tool_calls(
    prices: Mapping[str, int],
    observed: ToolCalls,
    reserved: ToolCalls,
    *,
    at_reserve: bool,
    aliases: tuple[tuple[str, str], ...] = (),
    pooled: bool = False,
) -> ToolCalls:
    """The priced tools' calls a settle bills: those the answer counts (under the names
    ``aliases`` give them: ``counted_as``); a call billed at its reserve (no usage came), its
    reserved calls, or more when the answer counted more. Reserved as one pool (``pooled``:
    ``pools_tool_calls``), the calls counted and those of the pool they leave: a call of any
    tool took one of it."""
    if not prices:
        return ()
    counted: dict[str, int] = {}
    renamed = dict(aliases)
    for name, count in observed:
        name = renamed.get(name, name)
        counted[name] = counted.get(name, 0) + count
    held = dict(reserved) if at_reserve else {}
    if pooled and held:
        # The pool bounds the calls of every tool together: each tool's larger of reserved and
        # counted would bill the pool at the dearest tool and the calls counted of the others
        # on top, past the bound and past the reserve. Unpriced tools' calls (and function
        # calls, counted as well) are left out of what the pool lost: never billed below it.
        left = max(0, sum(held.values()) - sum(counted.get(name, 0) for name in prices))
        for name, count in held.items():
            took = min(count, left)
            counted[name] = counted.get(name, 0) + took
            left -= took
        held = {}
    # In the order the operator priced them: one entry's field reads as the next one's.
    billed = ((name, max(counted.get(name, 0), held.get(name, 0))) for name in prices)
    return tuple((name, count) for name, count in billed if count)


def tool_calls_field(calls: ToolCalls) -> str:
    """The ledger's ``tool_calls``: ``web_search=3,file_search=1``."""
    return ",".join(f"{name}={count}" for name, count in calls)
