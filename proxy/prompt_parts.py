"""What a request body's prompt holds, for the estimate: every text the provider bills as input
(contents, names, tool calls and results, at any depth), its media parts, and the encrypted
search results it sends back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson

# Content parts whose tokens are not text: OpenAI chat, Responses, Anthropic, and the video and
# audio by URL of OpenAI-compatible servers (vLLM, SGLang).
MEDIA_PART_TYPES = frozenset(
    {
        "image_url",
        "input_audio",
        "video_url",
        "audio_url",
        "file",
        "input_image",
        "input_file",
        "image",
        "document",
        "computer_screenshot",
    }
)
# Where parts nest: a message's content, a tool result's content or output. Not elsewhere: a
# tool call's own arguments ("input") are the model's JSON, whatever types they name.
_PART_HOLDERS = ("content", "output")


def _parts(*sources: Any) -> Iterator[dict[str, Any]]:
    """Every object of the messages, items or variables of ``sources``, a tool result's parts
    included (not the insides of a media part or a search result, but the blocks of an Anthropic
    document whose source is content of its own: its images are billed as images)."""
    stack = list(sources)
    while stack:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            yield value
            if _is_media(value):
                source = value.get("source")
                if isinstance(source, dict) and source.get("type") == "content":
                    stack.append(source.get("content"))
            elif value.get("type") != "web_search_result":
                held = (value.get(key) for key in _PART_HOLDERS)
                stack.extend(inner for inner in held if isinstance(inner, list | dict))


def search_result_bytes(*sources: Any) -> int:
    """The length of the page text Anthropic's web search results carry back encrypted (billed as
    input again in later turns): counted in bytes, as no tokenizer can read it."""
    results = (part for part in _parts(*sources) if part.get("type") == "web_search_result")
    blobs = (result.get("encrypted_content") for result in results)
    return sum(len(blob) for blob in blobs if isinstance(blob, str))


# Input items whose content goes back encrypted and is read as input again: a Responses
# compaction item (the earlier conversation, compacted) and reasoning item, an Anthropic
# redacted thinking block (within a tool-use turn), each by the field holding it.
_ENCRYPTED_INPUT = {
    "compaction": "encrypted_content",
    "reasoning": "encrypted_content",
    "redacted_thinking": "data",
}


def encrypted_input_bytes(*sources: Any) -> int:
    """The length of what a request sends back encrypted that the provider reads as input:
    counted in bytes, as no tokenizer can read it (an upper bound where the provider drops some,
    as OpenAI may earlier turns' reasoning)."""
    total = 0
    for part in _parts(*sources):
        kind = part.get("type")  # may be anything a client sent: a list
        field = _ENCRYPTED_INPUT.get(kind) if isinstance(kind, str) else None
        blob = part.get(field) if field else None
        if isinstance(blob, str):
            total += len(blob)
    return total


def media_parts(*sources: Any) -> int:
    """How many image, audio and file parts the messages, items or variables of ``sources``
    hold, a tool result's included, and earlier audio answers sent back by id."""
    return sum(1 for part in _parts(*sources) if _is_media(part) or _is_audio_reference(part))


def _is_audio_reference(message: dict[str, Any]) -> bool:
    """An assistant message that sends an earlier audio answer back by its id: the provider
    reads that audio again, as input."""
    return message.get("role") == "assistant" and isinstance(message.get("audio"), dict)


def _is_media(part: dict[str, Any]) -> bool:
    kind = part.get("type")
    # A type may be anything: a list. An object with a role is a message (its content is what
    # the model reads), whatever type it also names: never a media part whose text is skipped.
    return isinstance(kind, str) and kind in MEDIA_PART_TYPES and "role" not in part


# Keys whose strings are not prompt text: ids, enums, signatures, and payloads that are not
# text (media are priced per part, by ``media_parts``; encrypted reasoning is opaque).
_NOT_TEXT = frozenset(
    {
        "type",
        "id",
        "call_id",
        "tool_call_id",
        "tool_use_id",
        "status",
        "signature",
        "encrypted_content",
        "result",  # an image generation call's image
        "cache_control",
        "audio",  # a chat message's reference to earlier audio: {"id": ...}
        "data",
        "url",
        "file_id",
        "file_data",
        "image_url",
        "media_type",
        "mime_type",
        "detail",
        "format",
    }
)
# Roles a chat format writes as one token, which the per-message overhead holds. Any other is
# text the provider bills: vLLM takes custom roles, and a template such as Llama 3's writes the
# role into the prompt.
_OVERHEAD_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
# Keys whose object value the model reads as JSON, its keys included: a tool call's input or
# arguments, and a tool's schema (an MCP tool list passed back among the items; a schema's
# property names are keys, its "type"s would be dropped as enums).
_AS_JSON = frozenset({"input", "arguments", "input_schema", "parameters", "schema"})


def prompt_texts(value: Any) -> list[str]:
    """Every string a prompt value carries, at any depth, in order: contents, refusals, names,
    tool calls and their results, reasoning summaries, whatever an item type holds. What the
    provider bills as input is among them, so a new item type cannot slip past the reserve."""
    parts: list[str] = []
    stack = [value]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            stack.extend(reversed(value))
        elif isinstance(value, dict):
            kind = value.get("type")
            if _is_media(value):
                if kind == "document":
                    stack.extend(reversed(_document_texts(value)))
                continue
            for key, inner in reversed(value.items()):
                if key in _NOT_TEXT or (
                    key == "role" and isinstance(inner, str) and inner in _OVERHEAD_ROLES
                ):
                    continue
                if key in _AS_JSON and isinstance(inner, dict | list):
                    parts.append(orjson.dumps(inner).decode())
                else:
                    stack.append(inner)
    return parts


def _document_texts(document: dict[str, Any]) -> list[Any]:
    """What of an Anthropic document is text the model reads: its title and context, and a
    plain-text or content-block source (a PDF, a URL or a file is priced per part)."""
    source = document.get("source")
    texts = [document.get("title"), document.get("context")]
    if isinstance(source, dict):
        if source.get("type") == "text":
            texts.append(source.get("data"))
        elif source.get("type") == "content":
            texts.append(source.get("content"))
    return texts


def variable_texts(variables: Any) -> list[str]:
    """The text of a stored prompt's variables: strings, or parts carrying text (an image or a
    file part adds none, as in messages)."""
    return prompt_texts(list(variables.values())) if isinstance(variables, dict) else []


def message_parts(messages: list[dict[str, Any]]) -> list[str]:
    """All text a chat request sends: contents, names, refusals and tool calls."""
    return prompt_texts(messages)


def items_parts(
    items: str | list[dict[str, Any]], extra: str | list[dict[str, Any]] | None = None
) -> list[str]:
    """All text of a Responses ``input`` (or Anthropic ``messages``) plus instructions/system."""
    return prompt_texts(extra) + (prompt_texts(items) or [""])
