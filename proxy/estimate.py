"""Estimate a request before it is forwarded: the worst case to reserve.

Input is bounded from above (tiktoken, else UTF-8 bytes; much text not counted before starts
at its UTF-8 bytes and is counted after the reserve, see ``proxy.tokenizer``); output is the
request's own cap, else the model's ``max_output_tokens``, else the endpoint's default, times
``n``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from proxy.payload import (
    ChatBody,
    CompletionBody,
    EmbeddingBody,
    Endpoint,
    MessagesBody,
    RequestView,
    ResponsesBody,
    compaction_instructions,
    compacts,
    generations,
    prompts,
)
from proxy.prompt_parts import (
    encrypted_input_bytes,
    items_parts,
    media_parts,
    message_parts,
    search_result_bytes,
    variable_texts,
)
from proxy.tokenizer import QUICK_BOUND_CHARS, Tokenizer
from proxy.tool_fees import model_passes
from proxy.values import value_class

# Chat formats add a few tokens per message and for priming the reply.
TOKENS_PER_MESSAGE = 4
TOKENS_PER_REPLY = 3
# The special tokens a server's tokenizer adds to each text it tokenizes on its own (an
# embeddings input, a legacy completion's prompt or suffix), none of them in the text's count or
# bytes: BOS or [CLS], EOS or [SEP], and a SentencePiece model's word-start piece before a first
# character it writes as bytes. OpenAI adds none but for a null prompt (its "<|endoftext|>").
SPECIAL_TOKENS_PER_INPUT = 3
# The field that caps output when the request named none.
DEFAULT_CAP_FIELD: dict[Endpoint, str] = {
    "chat.completions": "max_completion_tokens",
    "completions": "max_tokens",
    "responses": "max_output_tokens",
    "messages": "max_tokens",
    "embeddings": "",
}
# OpenAI's legacy completions endpoint defaults max_tokens to 16.
LEGACY_DEFAULT_MAX_TOKENS = 16
# Anthropic's tool-use system prompt: 346 tokens on current models, at most 530 (Claude 3 Opus).
ANTHROPIC_TOOLS_INPUT_TOKENS = 600
# OpenAI writes a tool's enum as a TypeScript union ("a" | "b"): its cookbook counts 3 tokens for
# each item beside the item's own, where the item's JSON ("a",) counts about 1.
ENUM_ITEM_TOKENS = 2
# The input Anthropic adds for each of its own tools, by type prefix (its published figures: the
# computer tool's definition and its system prompt).
ANTHROPIC_TOOL_TOKENS = (("bash_", 245), ("text_editor_", 700), ("computer_", 735 + 499))


@value_class(kw_only=True)
class Estimate:
    prompt_text: str
    prompt_overhead_tokens: int
    input_tokens: int  # upper bound, reserved
    output_tokens: int  # worst case, reserved
    output_cap_field: str | None  # which request field caps the output, if any
    # The per-choice cap to forward when the request's own cap is absent or above what was
    # reserved: the upstream must never be allowed more output than the reserve covers.
    enforce_cap: int | None = None
    # The output reserved per choice (what the cap field holds once forwarded).
    output_cap: int = 0
    # The model passes each answer may take, each written up to ``output_cap`` (an Anthropic
    # server-tool loop's: ``tool_fees.model_passes``), all in ``output_tokens``: a clamp lowers
    # the cap of every pass.
    output_passes: int = 1
    # Texts input_tokens bounds by their UTF-8 bytes (a quick estimate), to be counted exactly
    # (``counted``) once the reserve is made; empty: the bound is final (the count, or the byte
    # length where no count can be had).
    uncounted: tuple[str, ...] = ()
    # Whose remembered counts the texts are looked up in and added to (the caller's tenant).
    cache_scope: str = ""
    # How many times the provider reads (and bills) the prompt: 2 for a compacting request (its
    # summarizing step reads it all, then the answer at most as much).
    input_reads: int = 1
    # Output a compacting Responses request reads again as input (OpenAI's pass comes mid-answer:
    # it reads what was written before it, and the answer goes on from the summary it writes):
    # its whole output reserve, kept when the text is counted, as a clamp of the output leaves it.
    output_read_tokens: int = 0
    # The texts a provider counts one by one, not as one prompt (an embeddings batch's inputs, a
    # legacy completion's prompts and suffixes): counted each on its own when no usage comes.
    separate_texts: tuple[str, ...] = ()
    # Reserved for the special tokens of ``separate_texts`` (SPECIAL_TOKENS_PER_INPUT each), kept
    # when the texts are counted, never billed by a count of the proxy's own (OpenAI adds none).
    special_tokens: int = 0
    # Calls of the priced hosted tools the request enables, at most (``tool_fees``), by tool, and
    # their cost at the model's prices in millionths of a micro-unit: reserved beside the tokens.
    tool_calls: tuple[tuple[str, int], ...] = ()
    tool_fees_exact: int = 0
    # The names the answer's counted calls are billed under, where not their own
    # (``tool_fees.counted_as``: web_search_call items of a web_search_preview request).
    tool_aliases: tuple[tuple[str, str], ...] = ()
    # ``tool_calls`` are one bound over every hosted tool's calls (``tool_fees.pools_tool_calls``).
    tool_calls_pooled: bool = False

    @property
    def input_exact(self) -> bool:
        return not self.uncounted


def counted(est: Estimate, tokenizer: Tokenizer, encoding: str) -> Estimate:
    """``est`` with its input counted exactly: tiktoken's work, run off the event loop."""
    if est.input_exact:
        return est
    read = tokenizer.upper_bound_of_parts(est.uncounted, encoding, scope=est.cache_scope)
    read += est.prompt_overhead_tokens
    exact = read * est.input_reads + est.special_tokens + est.output_read_tokens
    return replace(est, input_tokens=min(exact, est.input_tokens), uncounted=())


def _with_json(parts: list[str], *values: Any) -> list[str]:
    """``parts`` and, as JSON text, each value the model is also sent as prompt (tools, schemas)."""
    for value in values:
        if value:
            parts = [*(parts or [""]), orjson.dumps(value).decode()]
    return parts


def _schema(response_format: Any) -> Any:
    """A structured-output schema (sent to the model as prompt); None for other formats."""
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        return response_format
    return None


def _anthropic_schema(view: MessagesBody) -> Any:
    """An Anthropic structured output's schema (``output_config.format``, or the beta's top-level
    ``output_format``), sent to the model as prompt as OpenAI's ``response_format`` is; None for
    none. Read where ``plan.plan_call`` reads it for JSON mode."""
    extra = view.model_extra or {}
    config = extra.get("output_config")
    form = config.get("format") if isinstance(config, dict) else None
    if form is None:
        form = extra.get("output_format")
    return _schema(form)


def media_of(view: RequestView) -> int:
    """Image, audio and file parts of the prompt."""
    if type(view) is ChatBody:
        return media_parts(view.messages)
    if type(view) is ResponsesBody:
        variables = view.prompt.get("variables") if view.prompt else None
        return media_parts(view.input, list(variables.values()) if isinstance(variables, dict) else None)
    if type(view) is MessagesBody:
        return media_parts(view.messages, view.system)
    return 0


def tools_overhead(view: RequestView, tools_input_tokens: int) -> int:
    """Input a provider adds to a call with tools beyond their JSON, which the text count holds:
    the model's tool-use system prompt (``tools_input_tokens``) and, for Anthropic's own tools,
    the definitions it writes for them (its published figures; a tool's JSON here is one line)."""
    # Chat's legacy ``functions`` are tools to the provider: the same tool-use prompt. Read from
    # the validated fields only: elsewhere a field of that name is passed through unread (an
    # extra of any type, which ``getattr`` would return all the same).
    tools: list[dict[str, Any]] | None = None
    if type(view) is ChatBody:
        tools = view.tools or view.functions
    elif type(view) is ResponsesBody or type(view) is MessagesBody:
        tools = view.tools
    if not tools and not _mcp_servers(view):
        return 0
    tokens = tools_input_tokens + ENUM_ITEM_TOKENS * _enum_items(tools)
    if type(view) is MessagesBody:
        for tool in tools or ():
            kind = tool.get("type")
            if isinstance(kind, str):
                tokens += next((n for prefix, n in ANTHROPIC_TOOL_TOKENS if kind.startswith(prefix)), 0)
    return tokens


def _enum_items(value: Any) -> int:
    """How many items the enums of tool schemas (``value``, at any depth) list."""
    items = 0
    stack = [value]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            enum = value.get("enum")
            items += len(enum) if isinstance(enum, list) else 0
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return items


def _mcp_servers(view: RequestView) -> bool:
    """Anthropic's MCP connector (``mcp_servers``, no ``tools`` needed): the servers' tools,
    which Anthropic fetches, are tools to the model, with the same tool-use system prompt."""
    servers = (view.model_extra or {}).get("mcp_servers") if type(view) is MessagesBody else None
    return isinstance(servers, list) and bool(servers)


def chat_messages(view: RequestView) -> int:
    """The messages a chat format frames (each with its role's tokens): a chat call's messages, a
    Responses call's input items and an Anthropic call's messages, each with one more for the
    system prompt (its instructions, its system) whether sent or not; none for the endpoints
    that take plain text (legacy completions, embeddings)."""
    if type(view) is ChatBody:
        return len(view.messages)
    if type(view) is ResponsesBody:
        return (1 if isinstance(view.input, str) else len(view.input or ())) + 1
    if type(view) is MessagesBody:
        return len(view.messages) + 1
    return 0


def prompt_of(endpoint: Endpoint, view: RequestView) -> tuple[list[str], int, int]:
    """Texts to count (their prompt is them joined by line breaks), fixed overhead in tokens,
    and tokens given directly as token ids."""
    if type(view) is ChatBody:
        # vLLM's RAG documents and chat template arguments: written into the prompt by the
        # templates that read them (Command R writes each document's keys and values).
        extra = view.model_extra or {}
        parts = _with_json(
            message_parts(view.messages),
            view.tools,
            view.functions,
            _schema(view.response_format),
            extra.get("documents"),
            extra.get("chat_template_kwargs"),
        )
        return parts, TOKENS_PER_MESSAGE * chat_messages(view) + TOKENS_PER_REPLY, 0
    if type(view) is ResponsesBody:
        text_format = view.text.get("format") if view.text else None
        variables = variable_texts(view.prompt.get("variables")) if view.prompt else []
        parts = _with_json(
            items_parts(view.input or [], view.instructions) + variables, view.tools, _schema(text_format)
        )
        return parts, TOKENS_PER_MESSAGE * chat_messages(view) + TOKENS_PER_REPLY, 0
    if type(view) is MessagesBody:
        # A compaction's own summarizing prompt is read too (reserved with the input it reads).
        texts = items_parts(view.messages, view.system) + compaction_instructions(view)
        parts = _with_json(texts, view.tools, _anthropic_schema(view))
        return parts, TOKENS_PER_MESSAGE * chat_messages(view) + TOKENS_PER_REPLY, 0
    source = (view.prompt if type(view) is CompletionBody else view.input) or ""
    # Insert mode: each prompt of a list is sent with the suffix.
    suffix = [view.suffix] * prompts(view) if type(view) is CompletionBody and view.suffix else []
    if isinstance(source, str):
        return [source, *suffix], 0, 0
    texts = [s for s in source if isinstance(s, str)] + suffix
    ids = sum(1 for s in source if isinstance(s, int))
    ids += sum(len(s) for s in source if isinstance(s, list))
    return texts, 0, ids


def estimate(
    endpoint: Endpoint,
    view: RequestView,
    *,
    encoding: str,
    tokenizer: Tokenizer,
    model_max_output_tokens: int | None,
    default_max_output_tokens: int,
    media_part_input_tokens: int = 0,
    tools_input_tokens: int = 0,
    quick_chars: int = QUICK_BOUND_CHARS,
    cache_scope: str = "",
    template_call_tokens: int = 0,
    template_message_tokens: int = 0,
    default_tool_calls: int = 0,
) -> Estimate:
    """``template_call_tokens`` and ``template_message_tokens``: what the model's chat template
    adds beyond OpenAI's chat format, per call and per message (``ModelConfig``'s
    ``prompt_overhead_tokens`` and ``message_overhead_tokens``). ``default_tool_calls``: the
    calls a server tool with no bound of its own may make (``limits.default_max_tool_calls``)."""
    parts, overhead, id_tokens = prompt_of(endpoint, view)
    overhead += tools_overhead(view, tools_input_tokens)
    if not (type(view) is EmbeddingBody or type(view) is CompletionBody):
        # A fixed part of the input, as the per-message tokens are: kept when the text is
        # counted after a quick reserve, and charged when the provider gives no usage (it bills
        # the template's tokens as input too). Legacy completions and embeddings are sent no
        # chat template: the special tokens their server adds are SPECIAL_TOKENS_PER_INPUT's.
        overhead += template_call_tokens + template_message_tokens * chat_messages(view)
    if type(view) is MessagesBody:
        overhead += search_result_bytes(view.messages) + encrypted_input_bytes(view.messages)
    elif type(view) is ResponsesBody:
        overhead += encrypted_input_bytes(view.input)
    if media_part_input_tokens:
        # A fixed part of the input, as the per-message tokens are: kept when the text is
        # counted after a quick reserve, and charged when the provider gives no usage.
        overhead += media_part_input_tokens * media_of(view)
    text = "\n".join(parts)
    bound, exact = tokenizer.quick_bound_of_parts(parts, encoding, quick_chars=quick_chars, scope=cache_scope)
    reads = 2 if compacts(view) else 1
    separate = tuple(parts) if (type(view) is EmbeddingBody or type(view) is CompletionBody) else ()
    specials = SPECIAL_TOKENS_PER_INPUT * len(separate)
    input_tokens = (bound + overhead) * reads + id_tokens + specials
    later = () if exact else tuple(parts)
    if type(view) is EmbeddingBody:
        return Estimate(
            prompt_text=text,
            prompt_overhead_tokens=overhead + id_tokens,
            input_tokens=input_tokens,
            output_tokens=0,
            output_cap_field=None,
            uncounted=later,
            cache_scope=cache_scope,
            separate_texts=separate,
            special_tokens=specials,
        )
    cap_field: str | None = None
    cap: int | None = None
    if type(view) is ChatBody and view.max_completion_tokens is not None:
        # Both sent (OpenAI refuses that; another upstream may honour either): the larger.
        cap_field, cap = "max_completion_tokens", max(view.max_completion_tokens, view.max_tokens or 0)
    elif type(view) is ResponsesBody:
        if view.max_output_tokens is not None:
            cap_field, cap = "max_output_tokens", view.max_output_tokens
    elif view.max_tokens is not None:
        cap_field, cap = "max_tokens", view.max_tokens
    asked = cap
    if cap is None:
        if type(view) is CompletionBody:
            cap = min(LEGACY_DEFAULT_MAX_TOKENS, model_max_output_tokens or LEGACY_DEFAULT_MAX_TOKENS)
        else:
            cap = model_max_output_tokens or default_max_output_tokens
    elif model_max_output_tokens is not None:
        cap = min(cap, model_max_output_tokens)
    # A legacy completion scoring its prompt (max_tokens 0, echo): vLLM runs it as max_tokens 1
    # and bills that token for each answer, though it returns the prompt alone.
    reserved = max(cap, 1) if type(view) is CompletionBody else cap
    passes = model_passes(view, default_tool_calls)
    output_tokens = reserved * generations(view) * passes
    # Anthropic's summarizing step comes before the answer, which reads no output again.
    output_read = output_tokens if type(view) is ResponsesBody and reads > 1 else 0
    return Estimate(
        prompt_text=text,
        prompt_overhead_tokens=overhead + id_tokens,
        input_tokens=input_tokens + output_read,
        output_tokens=output_tokens,
        output_cap_field=cap_field or DEFAULT_CAP_FIELD[endpoint],
        enforce_cap=cap if asked != cap else None,
        output_cap=cap,
        output_passes=passes,
        uncounted=later,
        cache_scope=cache_scope,
        input_reads=reads,
        output_read_tokens=output_read,
        separate_texts=separate,
        special_tokens=specials,
    )
