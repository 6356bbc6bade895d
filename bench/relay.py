"""The baseline: a bare aiohttp pass-through relay, no billing, no parsing.

Forwards ``POST /v1/chat/completions`` (body and Authorization as received) to the upstream and
streams the answer back piece by piece as it arrives. Whatever the proxy costs above this is
the price of billing.

With ``--redis URL`` it also makes two plain Redis script calls per call (redis-py, EVALSHA),
one before forwarding and one after the answer, where the proxy reserves and settles: the
issue's "relay plus two Redis round trips", the floor under any billing that keeps its state in
Redis. ``--pipelined`` makes those calls with the proxy's own client (``proxy/resp.py``, about a
third of redis-py's CPU per command) instead: the lowest floor this code base knows.

``python bench/relay.py --upstream http://127.0.0.1:N/v1 --port M [--redis URL]`` prints
``READY <url>``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proxy.resp import PipelinedConnection

Script = Callable[..., Awaitable[object]]
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)
BEFORE = web.AppKey("before", Script)
AFTER = web.AppKey("after", Script)
DONE = b"data: [DONE]\n\n"
# As small as a script can be and still write: what is left is the round trip itself.
BEFORE_LUA = "redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[1]) return 1"
AFTER_LUA = (
    "redis.call('HINCRBY', KEYS[1], 'reserved', -ARGV[1]) redis.call('HINCRBY', KEYS[1], 'used', 1) return 1"
)


async def relay(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"Content-Type": "application/json"}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    session = request.app[SESSION]
    before = request.app.get(BEFORE)
    if before is not None:
        await before(keys=["bench:relay"], args=[100])
    async with session.post(request.app[UPSTREAM] + "/chat/completions", data=body, headers=headers) as up:
        response = web.StreamResponse(status=up.status)
        response.content_type = up.content_type
        if up.content_length is not None:
            response.content_length = up.content_length
        await response.prepare(request)
        after = request.app.get(AFTER)
        stream = up.content_type == "text/event-stream"
        held = b""
        async for piece in up.content.iter_any():
            if after is not None and not stream:
                held += piece  # a JSON answer goes out once the call's second script has answered
                continue
            if after is not None and piece.endswith(DONE):
                # As the proxy's: a stream's events go out as they come, its [DONE] after the settle.
                piece, held = piece[: -len(DONE)], DONE
            if piece:
                await response.write(piece)
        if after is not None:
            await after(keys=["bench:relay"], args=[100])
            if held:
                await response.write(held)
        await response.write_eof()
        return response


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def pipelined_script(connection: PipelinedConnection, source: str) -> Script:
    """``script(keys=[...], args=[...])`` as redis-py's, by EVALSHA on the pipelined connection."""
    sha = hashlib.sha1(source.encode()).hexdigest()

    async def call(*, keys: list[str], args: list[object]) -> object:
        return await connection.call("EVALSHA", sha, len(keys), *keys, *args)

    return call


async def serve(
    host: str, port: int, upstream: str, max_seconds: float, redis_url: str | None, pipelined: bool
) -> None:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[UPSTREAM] = upstream.rstrip("/")
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/healthz", health)

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    async def redis_ctx(app: web.Application) -> AsyncIterator[None]:
        client = aioredis.Redis.from_url(redis_url or "", max_connections=1024)
        if pipelined:
            connection = PipelinedConnection(redis_url or "", timeout_s=5.0)
            for source in (BEFORE_LUA, AFTER_LUA):
                await connection.call("SCRIPT", "LOAD", source)
            app[BEFORE] = pipelined_script(connection, BEFORE_LUA)
            app[AFTER] = pipelined_script(connection, AFTER_LUA)
        else:
            app[BEFORE] = client.register_script(BEFORE_LUA)
            app[AFTER] = client.register_script(AFTER_LUA)
        yield
        if pipelined:
            await connection.close()
        await client.aclose()

    app.cleanup_ctx.append(session_ctx)
    if redis_url:
        app.cleanup_ctx.append(redis_ctx)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    print(f"READY http://{host}:{runner.addresses[0][1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), timeout=max_seconds)
    except TimeoutError:
        print("relay: --max-seconds reached, exiting", file=sys.stderr)
    await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--upstream", required=True, help="upstream base URL, e.g. http://127.0.0.1:9000/v1")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--redis", default=None, help="also call two Redis scripts per call (URL)")
    parser.add_argument(
        "--pipelined", action="store_true", help="make the Redis calls with the proxy's pipelined client"
    )
    parser.add_argument(
        "--uvloop", action="store_true", help="serve on uvloop, as the proxy does (event_loop: auto)"
    )
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long (safety)")
    args = parser.parse_args()
    loop_factory = None
    if args.uvloop:
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.host, args.port, args.upstream, args.max_seconds, args.redis, args.pipelined))
    return 0


if __name__ == "__main__":
    sys.exit(main())
