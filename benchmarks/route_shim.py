"""A pass-through proxy in front of one `kvserve serve` replica, for vllm-router.

vllm-router re-serializes every OpenAI body from its own request type, adding
the fields that type has (`no_stop_trim` among them, with their defaults);
`kvserve serve` refuses any field it does not know (protocol.check_fields), so
every request through vllm-router would fail with 400. This proxy drops the
fields kvserve's protocol does not list (kvserve.serve.protocol, the source of
truth) and streams everything else both ways unchanged. It costs the
vllm-router rows one more loopback hop; the first few dropped fields and their
values are logged, so the run shows what was removed.

Run: python route_shim.py --upstream http://127.0.0.1:8001 --port 9001
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from kvserve.serve.protocol import CHAT_FIELDS, COMPLETION_FIELDS

ALLOWED = {"/v1/chat/completions": CHAT_FIELDS, "/v1/completions": COMPLETION_FIELDS}
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def make_app(upstream: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(3600.0))
    logged: set[str] = set()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        allowed = ALLOWED.get("/" + path)
        if allowed is not None and raw:
            body = json.loads(raw)
            dropped = {k: body.pop(k) for k in list(body) if k not in allowed}
            for key in dropped.keys() - logged:
                print(f"dropped {key}={dropped[key]!r}", file=sys.stderr, flush=True)
                logged.add(key)
            raw = json.dumps(body).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        req = client.build_request(request.method, "/" + path, content=raw, headers=headers)
        resp = await client.send(req, stream=True)

        async def body_iter() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
        return StreamingResponse(body_iter(), resp.status_code, out_headers)

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="the replica's base URL")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    app = make_app(args.upstream.rstrip("/"))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
