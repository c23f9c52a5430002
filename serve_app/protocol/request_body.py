"""Reading an HTTP request's body under a size limit (413 past it, declared or streamed)."""

from __future__ import annotations

from starlette.requests import Request

from serve_app.protocol.errors import APIError


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or ``APIError(413)`` as soon as it is known to exceed ``limit`` bytes:
    from its Content-Length, or while reading a chunked body (never read past the limit)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {limit}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)
