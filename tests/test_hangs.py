"""Hangs and slow rejections (issue 41 item 12): clients stalled inside a request's line or
headers are timed out."""

from __future__ import annotations

import asyncio

from molt_core.chat.server import ChatServer


def test_clients_stalled_in_the_request_line_or_headers_are_closed():
    """100 clients stop inside the request line, 100 inside the headers, 100 inside the second
    request's headers on a kept-alive connection: the server closes each once its head timeout
    (body_timeout_s) is up, as it answers a body stall with a 408. (Before: held forever.)"""
    async def stall(server: ChatServer, head: bytes, first: bytes = b"") -> bytes:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            if first:               # a whole request (a 404), then the stall on the same socket
                writer.write(first)
                got = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                await reader.readexactly(int(got.split("content-length: ")[1].split("\r")[0]))
            writer.write(head)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 120)   # not a time assert: a hang guard
        finally:
            writer.close()

    async def main() -> list[bytes]:
        server = ChatServer(body_timeout_s=1.0)
        await server.start()
        whole = b"GET /nothing HTTP/1.1\r\nhost: x\r\n\r\n"
        heads = [b"POST /s/abc/v1/chat/compl"] * 100 + [
            b"POST /s/abc/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-ty"] * 100
        try:
            return await asyncio.gather(*(stall(server, h) for h in heads), *(
                stall(server, b"GET /again HTTP/1.1\r\nhos", whole) for _ in range(100)))
        finally:
            await server.close()

    answers = asyncio.run(main())
    assert all(a == b"" for a in answers), [a for a in answers if a][:1]
