"""Fake OpenAI-compatible upstream provider for tests.

Speaks the OpenAI wire format (chat completions, legacy completions,
embeddings, models) and records what it "charged" in ``FakeUpstream.bill``.
``POST /v1/responses`` (OpenAI Responses API) and ``POST /v1/messages``
(Anthropic Messages API) are served by ``tests.fake_formats``, which documents
their extra modes and control keys.

Each request is steered by an extra JSON body field ``"fake"`` (with the
openai SDK: ``extra_body={"fake": {...}}``); every key is optional:

  mode             ok | truncate | content_filter | refusal | error |
                   stall_before_headers | stall_mid_stream | cut |
                   malformed_sse | no_done | non_json
  status, error_body   mode=error: HTTP status (500) and json | text | none body
  stall_s          sleep for the stall modes (default 30)
  after_chunks     content chunks sent before stall/cut/malformed (default 2)
  content          exact reply text, sent in pieces of chunk_chars (default 4)
  reply_tokens     reply is "tok0 tok1 ..." with this many words (default 8)
  finish_reasons   one finish_reason per choice (n > 1)
  usage            dict deep-merged into the usage object sent and billed
  no_usage         never send usage (still billed)
  keepalive        ": keep-alive" comments between streamed content chunks
  chunk_delay_s    sleep between streamed events
  tail_delay_s     sleep between a stream's last event and its end (Responses, Messages)
  id_prefix        Responses: the prefix of a response id (default resp_)
  first_event_delay_s  sleep between a stream's headers and its first event
  delay_s          sleep before answering at all (any mode)
  hold             wait before answering until the test calls ``release()`` (any mode)
  two_usage        send the usage chunk twice (usage_early: before last content)
  headers          dict of extra response headers (a long set-cookie, a CSP)

Token rule: prompt = words in message contents + 3 per message (chat), words
in the prompt(s) (completions), words per input with a minimum of 1
(embeddings); one reply word/chunk = one completion token, times n (legacy completions:
best_of when larger, as a provider bills the answers it writes and does not return).

Standalone: ``python -m tests.fake_upstream --port N [--api-key K]`` prints ``READY <base_url>``;
control endpoints: GET /_fake/bill, GET /_fake/received_count, POST /_fake/reset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import ssl
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

BILLING_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
FORMAT_PATHS = ("/v1/responses", "/v1/messages")  # answered by tests.fake_formats
REFUSAL_TEXT = "I can't help with that."
MODELS = ("gpt-4o-mini", "gpt-4o", "text-embedding-3-small")
JsonDict = dict[str, Any]


@dataclass(frozen=True)
class BillEntry:
    request_no: int
    path: str
    model: str
    stream: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    mode: str
    cache_creation_tokens: int = 0  # Anthropic cache_creation_input_tokens (not in prompt_tokens)
    cache_read_tokens: int = 0  # Anthropic cache_read_input_tokens (not in prompt_tokens)


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: Any
    raw: bytes
    method: str = "POST"
    query: str = ""  # as it came, still percent-encoded


@dataclass(frozen=True)
class _Plan:
    pieces: list[str]  # reply pieces; each one is a completion token
    finish: list[str]  # finish_reason per choice (len == n)
    refusal: bool


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def error_response(
    status: int,
    message: str,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    etype = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": etype, "param": param, "code": code}}
    return web.Response(
        status=status, body=_dumps(body).encode(), content_type="application/json", headers=headers
    )


def _words(value: Any) -> int:
    """Whitespace-separated words in a string, list of strings or text parts."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(p.get("text")) if isinstance(p, dict) else _words(p) for p in value)
    return 0


def _embed_inputs(inp: Any) -> tuple[int, int]:
    """(number of inputs, prompt tokens) for an embeddings ``input``."""
    if isinstance(inp, list) and inp and all(isinstance(x, int) for x in inp):
        return 1, len(inp)  # one pre-tokenised input
    items = inp if isinstance(inp, list) else [inp]
    toks = sum(len(x) if isinstance(x, list) else max(1, _words(x)) for x in items)
    return len(items), toks


def _merge(base: JsonDict, extra: JsonDict) -> JsonDict:
    out = dict(base)
    for k, v in extra.items():
        old = out.get(k)
        out[k] = _merge(old, v) if isinstance(v, dict) and isinstance(old, dict) else v
    return out


def _tok_words(r: int) -> list[str]:
    return [f"tok{i}" + (" " if i < r - 1 else "") for i in range(r)]


def _detail(usage: JsonDict, key: str, sub: str) -> int:
    d = usage.get(key)
    return int(d.get(sub) or 0) if isinstance(d, dict) else 0


class FakeUpstream:
    def __init__(
        self,
        *,
        api_key: str | None = "sk-upstream-secret",
        default_reply_tokens: int = 8,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.api_key = api_key
        self.default_reply_tokens = default_reply_tokens
        self.host = host
        self.port = port
        self.bill: list[BillEntry] = []
        self.received: list[Received] = []
        self.base_url = ""
        self._counter = 0
        # What the provider keeps (Responses API): a stored response's or a conversation's
        # context in tokens, billed again as input by a call that continues it.
        self.contexts: dict[str, int] = {}
        # A stored response's output items by id, in tokens: read as input by a call naming one.
        self.items: dict[str, int] = {}
        # Code execution containers (Responses' code interpreter, Anthropic's code execution):
        # kept, with their files, for a later call to run in by id.
        self.containers: set[str] = set()
        self._runner: web.AppRunner | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._released = asyncio.Event()  # for "hold": set by release()

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self.base_url = f"http://{self.host}:{self.port}/v1"
        return self.base_url

    async def start_tls(self, context: ssl.SSLContext) -> str:
        """The same upstream on a port of its own over TLS (once ``start``-ed): its https base URL."""
        assert self._runner is not None
        site = web.TCPSite(self._runner, self.host, 0, ssl_context=context)
        await site.start()
        port = int(self._runner.addresses[-1][1])
        return f"https://{self.host}:{port}/v1"

    def release(self) -> None:
        """Answer the calls held (``"hold": true``), and any that ask to be held from now on."""
        self._released.set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def reset(self) -> None:
        self.bill.clear()
        self.received.clear()

    @property
    def billed_prompt_tokens(self) -> int:
        return sum(b.prompt_tokens for b in self.bill)

    @property
    def billed_completion_tokens(self) -> int:
        return sum(b.completion_tokens for b in self.bill)

    @property
    def calls(self) -> int:
        paths = BILLING_PATHS + FORMAT_PATHS
        return sum(1 for r in self.received if r.method == "POST" and r.path in paths)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/_fake/"):
            return self._control(request)
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        query = request.rel_url.raw_query_string
        self.received.append(Received(request.path, dict(request.headers), body, raw, request.method, query))
        if request.method == "POST" and request.path in FORMAT_PATHS:
            from tests import fake_formats  # imported late: it builds on this module

            return await self._tracked(fake_formats.answer(self, request, body))
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return error_response(401, "Incorrect API key provided.", code="invalid_api_key")
        if request.method == "GET" and request.path == "/v1/models":
            data = [{"id": m, "object": "model", "created": 1700000000, "owned_by": "fake"} for m in MODELS]
            return web.json_response({"object": "list", "data": data})
        if request.method != "POST" or request.path not in BILLING_PATHS:
            return error_response(404, f"Unknown request URL: {request.method} {request.path}.")
        if not isinstance(body, dict):
            return error_response(400, "We could not parse the JSON body of your request.")
        return await self._tracked(self._answer(request, body))

    async def _tracked(self, answer: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # so close() can cancel stalled handlers
        try:
            return await answer
        finally:
            self._tasks.discard(task)

    def _control(self, request: web.Request) -> web.Response:
        if request.method == "GET" and request.path == "/_fake/bill":
            return web.json_response([asdict(b) for b in self.bill])
        if request.method == "GET" and request.path == "/_fake/received_count":
            return web.json_response({"count": len(self.received), "calls": self.calls})
        if request.method == "POST" and request.path == "/_fake/reset":
            self.reset()
            return web.json_response({"ok": True})
        return error_response(404, f"Unknown control URL: {request.method} {request.path}.")

    def _plan(self, body: JsonDict, ctl: JsonDict, chat: bool) -> _Plan:
        mode = str(ctl.get("mode", "ok"))
        n = int(body.get("n") or 1)
        cap_raw = (body.get("max_completion_tokens") if chat else None) or body.get("max_tokens")
        cap = int(cap_raw) if isinstance(cap_raw, int) else None
        finish = "stop"
        refusal = mode == "refusal" and chat
        if refusal:
            words = REFUSAL_TEXT.split()
            pieces = [w + " " for w in words[:-1]] + words[-1:]
        else:
            limit = (cap if cap is not None else 5) if mode == "truncate" else cap
            content = ctl.get("content")
            if isinstance(content, str):
                size = max(1, int(ctl.get("chunk_chars", 4)))
                pieces = [content[i : i + size] for i in range(0, len(content), size)]
                if limit is not None and len(pieces) > limit:
                    pieces, finish = pieces[:limit], "length"
            else:
                r = int(ctl.get("reply_tokens", self.default_reply_tokens))
                if mode == "truncate" or (limit is not None and r > limit):
                    r, finish = (limit if limit is not None else r), "length"
                pieces = _tok_words(r)
            if mode == "truncate":
                finish = "length"
            elif mode == "content_filter":
                pieces, finish = pieces[: len(pieces) // 2], "content_filter"
        frs = ctl.get("finish_reasons")
        finishes = [str(frs[i]) if isinstance(frs, list) and i < len(frs) else finish for i in range(n)]
        return _Plan(pieces, finishes, refusal)

    @staticmethod
    def _usage(prompt: int, completion: int | None, ctl: JsonDict) -> JsonDict:
        usage: JsonDict
        if completion is None:  # embeddings
            usage = {"prompt_tokens": prompt, "total_tokens": prompt}
        else:
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0},
            }
        extra = ctl.get("usage")
        if isinstance(extra, dict):
            usage = _merge(usage, extra)
            if "total_tokens" not in extra:
                p, c = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
                usage["total_tokens"] = int(p) + int(c)
        return usage

    async def _answer(self, request: web.Request, body: JsonDict) -> web.StreamResponse:
        path = request.path
        ctl: JsonDict = body["fake"] if isinstance(body.get("fake"), dict) else {}
        mode = str(ctl.get("mode", "ok"))
        self._counter += 1
        no = self._counter
        model = str(body.get("model", ""))
        chat, embed = path == "/v1/chat/completions", path == "/v1/embeddings"
        stream = bool(body.get("stream")) and not embed
        headers = {"x-request-id": f"req_{no}", **(ctl.get("headers") or {})}
        plan: _Plan | None = None
        n_inputs = 0
        if embed:
            n_inputs, prompt = _embed_inputs(body.get("input"))
            usage = self._usage(prompt, None, ctl)
        else:
            if chat:
                msgs = body.get("messages")
                msgs = msgs if isinstance(msgs, list) else []
                prompt = sum(_words(m.get("content")) + 3 for m in msgs if isinstance(m, dict))
                # An earlier audio answer sent back by id: read again as input (OpenAI's error for
                # one it does not keep).
                for m in msgs:
                    audio = m.get("audio") if isinstance(m, dict) else None
                    if isinstance(audio, dict) and isinstance(audio.get("id"), str):
                        if audio["id"] not in self.items:
                            return error_response(404, f"Audio with id '{audio['id']}' not found.")
                        prompt += self.items[audio["id"]]
            else:
                prompt = _words(body.get("prompt"))
            plan = self._plan(body, ctl, chat)
            # Legacy completions: best_of answers are written (and billed), n of them returned.
            best_of = body.get("best_of") if not chat and isinstance(body.get("best_of"), int) else 0
            usage = self._usage(prompt, len(plan.pieces) * max(len(plan.finish), best_of), ctl)
        if mode != "error" or isinstance(ctl.get("usage"), dict):
            cached = _detail(usage, "prompt_tokens_details", "cached_tokens")
            reasoning = _detail(usage, "completion_tokens_details", "reasoning_tokens")
            p_tok, c_tok = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
            self.bill.append(BillEntry(no, path, model, stream, p_tok, c_tok, cached, reasoning, mode))
        if ctl.get("delay_s"):
            await asyncio.sleep(float(ctl["delay_s"]))
        if ctl.get("hold"):
            await self._released.wait()
        if mode == "stall_before_headers":
            await asyncio.sleep(float(ctl.get("stall_s", 30)))
        if mode == "error":
            status = int(ctl.get("status", 500))
            kind = ctl.get("error_body", "json")
            if kind == "text":
                return web.Response(status=status, text="upstream exploded", headers=headers)
            if kind == "none":
                return web.Response(status=status, headers=headers)
            return error_response(status, "The fake upstream failed on purpose.", headers=headers)
        if mode == "non_json":
            return web.Response(body=b"<html>oops</html>", content_type="application/json", headers=headers)
        sent_usage = None if ctl.get("no_usage") else usage
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{no}", "created": int(time.time()), "model": model}
        # An audio answer (modalities with "audio"): kept for a later turn to send back by id.
        audio_id = f"audio_{no}" if chat and "audio" in (body.get("modalities") or ()) else None
        if audio_id is not None and plan is not None:
            self.items[audio_id] = len(plan.pieces)
        payload: JsonDict
        if plan is None:
            vec = [0.1, 0.2, 0.3]
            data = [{"object": "embedding", "index": i, "embedding": vec} for i in range(n_inputs)]
            payload = {"object": "list", "data": data, "model": model}
        elif stream:
            opts = body.get("stream_options")
            include = isinstance(opts, dict) and bool(opts.get("include_usage"))
            return await self._stream(request, headers, chat, meta, plan, sent_usage, include, ctl, audio_id)
        else:
            text = "".join(plan.pieces)
            content, refusal = (None, text) if plan.refusal else (text, None)
            msg = {"role": "assistant", "content": content, "refusal": refusal}
            if audio_id is not None:
                msg["content"] = None
                msg["audio"] = {"id": audio_id, "data": "UklGRg==", "expires_at": 1, "transcript": text}
            choices = [
                {"index": i, "message": msg, "logprobs": None, "finish_reason": fr}
                if chat
                else {"text": text, "index": i, "logprobs": None, "finish_reason": fr}
                for i, fr in enumerate(plan.finish)
            ]
            obj_name = "chat.completion" if chat else "text_completion"
            payload = {"id": meta["id"], "object": obj_name, **meta, "choices": choices}
        if sent_usage is not None:
            payload["usage"] = sent_usage
        if plan is not None:
            payload["system_fingerprint"] = "fp_fake"
        raw = _dumps(payload).encode()
        if mode == "cut":
            resp = web.StreamResponse(headers={"Content-Type": "application/json", **headers})
            resp.content_length = len(raw)
            await resp.prepare(request)
            await resp.write(raw[: len(raw) // 2])
            self._cut(request)
            return resp
        return web.Response(body=raw, content_type="application/json", headers=headers)

    @staticmethod
    def _cut(request: web.Request) -> None:
        if request.transport is not None:
            request.transport.close()

    async def _stream(
        self,
        request: web.Request,
        headers: dict[str, str],
        chat: bool,
        meta: JsonDict,
        plan: _Plan,
        usage: JsonDict | None,
        include_usage: bool,
        ctl: JsonDict,
        audio_id: str | None = None,
    ) -> web.StreamResponse:
        mode = str(ctl.get("mode", "ok"))
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        base: JsonDict = {"id": meta["id"], "object": obj_name, **meta, "system_fingerprint": "fp_fake"}

        def event(choices: list[JsonDict], usage_value: JsonDict | None = None) -> str:
            obj = {**base, "choices": choices}
            if include_usage:
                obj["usage"] = usage_value
            return f"data: {_dumps(obj)}\n\n"

        def choice(i: int, piece: str | None, fr: str | None) -> JsonDict:
            if chat and audio_id is not None and piece is not None:
                # An audio answer's deltas: its transcript (and sound), its id on each.
                delta = {"audio": {"id": audio_id, "transcript": piece, "data": "UklGRg=="}}
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": fr}
            if chat:
                delta = {} if piece is None else {"refusal" if plan.refusal else "content": piece}
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": fr}
            return {"text": piece or "", "index": i, "logprobs": None, "finish_reason": fr}

        n = len(plan.finish)
        ops: list[tuple[str, str]] = []
        if chat:
            first: JsonDict = {"role": "assistant", "content": "", "refusal": None}
            if plan.refusal:
                first = {"role": "assistant", "content": None, "refusal": ""}
            for i in range(n):
                role = {"index": i, "delta": first, "logprobs": None, "finish_reason": None}
                ops.append(("role", event([role])))
        for piece in plan.pieces:
            for i in range(n):
                ops.append(("content", event([choice(i, piece, None)])))
        for i, fr in enumerate(plan.finish):
            ops.append(("finish", event([choice(i, None, fr)])))
        if include_usage and usage is not None:
            usage_ops = [("usage", event([], usage))] * (2 if ctl.get("two_usage") else 1)
            content_at = [k for k, op in enumerate(ops) if op[0] == "content"]
            first_finish = next(k for k, op in enumerate(ops) if op[0] == "finish")
            pos = len(ops)
            if ctl.get("usage_early"):
                pos = content_at[-1] if content_at else first_finish
            ops[pos:pos] = usage_ops
        if mode in ("stall_mid_stream", "cut", "malformed_sse"):
            content_at = [k for k, op in enumerate(ops) if op[0] == "content"]
            k = min(int(ctl.get("after_chunks", 2)), len(content_at))
            ops.insert(content_at[k - 1] + 1 if k > 0 else (n if chat else 0), ("trigger", ""))
        if mode != "no_done":
            ops.append(("done", "data: [DONE]\n\n"))

        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await resp.prepare(request)
        delay = float(ctl.get("chunk_delay_s", 0))
        seen_content = False
        try:
            if ctl.get("first_event_delay_s"):
                await asyncio.sleep(float(ctl["first_event_delay_s"]))
            for idx, (kind, data) in enumerate(ops):
                if kind == "trigger":
                    if mode == "cut":
                        self._cut(request)
                        return resp
                    if mode == "stall_mid_stream":
                        await asyncio.sleep(float(ctl.get("stall_s", 30)))
                    else:
                        await resp.write(b"data: {not json\n\n")
                    continue
                if idx and delay:
                    await asyncio.sleep(delay)
                if kind == "content":
                    if seen_content and ctl.get("keepalive"):
                        await resp.write(b": keep-alive\n\n")
                    seen_content = True
                await resp.write(data.encode())
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp


async def _serve(args: argparse.Namespace) -> None:
    fake = FakeUpstream(
        api_key=args.api_key or None, default_reply_tokens=args.default_reply_tokens, port=args.port
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"READY {await fake.start()}", flush=True)
    await stop.wait()
    await fake.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible upstream")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--api-key", default="sk-upstream-secret", help='"" disables auth')
    parser.add_argument("--default-reply-tokens", type=int, default=8)
    asyncio.run(_serve(parser.parse_args()))


if __name__ == "__main__":
    main()
