"""A fast, minimal fake OpenAI upstream for the benchmark (its own process).

``POST /v1/chat/completions`` (any path ending in ``/chat/completions``), any Authorization:

* non-streaming: one ``chat.completion`` JSON body with ``usage``;
* ``"stream": true``: ``--chunks N`` content chunks framed exactly like OpenAI
  (``data: {...}\\n\\n``), a finish chunk, and when the request has
  ``stream_options.include_usage`` a ``"usage": null`` field on every chunk plus a final
  ``"choices": []`` usage chunk; then ``data: [DONE]\\n\\n``. With ``--obfuscation`` every chunk
  ends, as OpenAI's do unless ``stream_options.include_obfuscation`` is false, in an
  ``"obfuscation"`` field of random letters and digits whose length varies from chunk to chunk.

A request may override the chunk count with an extra body field ``"x_bench_chunks": N`` (the
proxy and the relay forward unknown fields unchanged). Chunk bodies are rendered once per
(chunks, include_usage, model) and cached, so the upstream spends as little CPU as possible.

``python bench/upstream.py --port N [--chunks 20]`` prints ``READY http://127.0.0.1:N/v1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import string
import sys
import time
from typing import Any

from aiohttp import web

Json = dict[str, Any]
REPLY_WORD = "tok "
FINGERPRINT = "fp_bench"
PAD_ALPHABET = string.ascii_letters + string.digits


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Upstream:
    def __init__(
        self, *, chunks: int, reply_tokens: int, chunk_delay_s: float, obfuscation: bool = False
    ) -> None:
        self.chunks = chunks
        self.obfuscation = obfuscation
        self._padding = random.Random(7)
        self.reply_tokens = reply_tokens
        self.chunk_delay_s = chunk_delay_s
        self.counter = 0
        self._stream_cache: dict[tuple[int, bool, str, bool], tuple[list[bytes], bytes | None]] = {}

    # -- rendering ----------------------------------------------------------------------

    def _stream_events(
        self, chunks: int, include_usage: bool, model: str, padded: bool = False
    ) -> tuple[list[bytes], bytes | None]:
        """(the content events incl. role and finish chunks, the usage-chunk template or None)."""
        key = (chunks, include_usage, model, padded)
        cached = self._stream_cache.get(key)
        if cached is not None:
            return cached
        base: Json = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": FINGERPRINT,
        }

        def event(choices: list[Json]) -> bytes:
            obj = {**base, "choices": choices}
            if include_usage:
                obj["usage"] = None
            if padded:
                length = self._padding.randint(1, 12)
                obj["obfuscation"] = "".join(self._padding.choices(PAD_ALPHABET, k=length))
            return b"data: " + _dumps(obj) + b"\n\n"

        def choice(delta: Json, finish: str | None) -> Json:
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        events = [event([choice({"role": "assistant", "content": "", "refusal": None}, None)])]
        events += [event([choice({"content": REPLY_WORD}, None)]) for _ in range(chunks)]
        events.append(event([choice({}, "stop")]))
        usage_template = None
        if include_usage:
            # "%d" placeholders are filled per request with the prompt token count.
            usage_template = (
                b"data: "
                + _dumps({**base, "choices": [], "usage": "@USAGE@"}).replace(
                    b'"@USAGE@"',
                    b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
                    b'"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},'
                    b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
                    b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}',
                )
                + b"\n\n"
            )
        self._stream_cache[key] = (events, usage_template)
        return events, usage_template

    def _completion(self, model: str, prompt_tokens: int) -> bytes:
        completion = self.reply_tokens
        payload = {
            "id": f"chatcmpl-{self.counter}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": REPLY_WORD * completion, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
            },
            "system_fingerprint": FINGERPRINT,
        }
        return _dumps(payload)

    # -- handlers -----------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "bad JSON", "type": "invalid_request_error"}}, status=400
            )
        self.counter += 1
        model = str(body.get("model") or "gpt-4o-mini")
        prompt_tokens = max(1, len(raw) // 4)  # cheap and deterministic; not a tokenizer
        headers = {"x-request-id": f"req_bench_{self.counter}"}
        if not body.get("stream"):
            return web.Response(
                body=self._completion(model, prompt_tokens), content_type="application/json", headers=headers
            )
        chunks = body.get("x_bench_chunks", self.chunks)
        chunks = chunks if isinstance(chunks, int) and 0 <= chunks <= 100_000 else self.chunks
        opts = body.get("stream_options")
        include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        declined = isinstance(opts, dict) and opts.get("include_obfuscation") is False
        padded = self.obfuscation and not declined
        events, usage_template = self._stream_events(chunks, include_usage, model, padded)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        delay = self.chunk_delay_s
        for event in events:
            await response.write(event)
            if delay:
                await asyncio.sleep(delay)
        tail = b"data: [DONE]\n\n"
        if usage_template is not None:
            tail = usage_template % (prompt_tokens, chunks, prompt_tokens + chunks) + tail
        await response.write(tail)
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": "gpt-4o-mini", "object": "model", "created": 1700000000, "owned_by": "bench"}]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "requests": self.counter})


def build_app(upstream: Upstream) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", upstream.chat)
    app.router.add_post("/chat/completions", upstream.chat)
    app.router.add_get("/v1/models", upstream.models)
    app.router.add_get("/healthz", upstream.health)
    return app


async def serve(host: str, port: int, upstream: Upstream, max_seconds: float) -> None:
    runner = web.AppRunner(build_app(upstream), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"READY http://{host}:{bound}/v1", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), timeout=max_seconds)
    except TimeoutError:
        print("upstream: --max-seconds reached, exiting", file=sys.stderr)
    await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=20, help="content chunks per stream (default 20)")
    parser.add_argument("--reply-tokens", type=int, default=16, help="completion tokens, non-streaming")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0, help="sleep between stream events")
    parser.add_argument(
        "--obfuscation", action="store_true", help="chunks end in OpenAI's padding field, of a varying length"
    )
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long (safety)")
    args = parser.parse_args()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        parser.error("the benchmark upstream listens on loopback only")
    upstream = Upstream(
        chunks=args.chunks,
        reply_tokens=args.reply_tokens,
        chunk_delay_s=args.chunk_delay_ms / 1000,
        obfuscation=args.obfuscation,
    )
    asyncio.run(serve(args.host, args.port, upstream, args.max_seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
