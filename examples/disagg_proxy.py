"""A toy proxy for prefill/decode disaggregation with minivllm's P2pZmqConnector.

Each completion or chat request goes first to the prefill server (a `kv_producer`) with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true}`; the `kv_transfer_params` of its answer (the producer's block
ids, engine id, host and port) are added to the original request, which then goes to the decode server (a
`kv_consumer`). The decode server's answer, streamed or not, is the client's answer.

    minivllm serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": 14579}'
    minivllm serve MODEL --port 8200 --kv-transfer-config '{"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"}'
    python examples/disagg_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Source: the role of vLLM's examples/online_serving/disaggregated_serving (toy proxy server).
"""
from __future__ import annotations

import argparse

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=timeout_s)

    async def _prefill(path: str, body: dict, headers: dict) -> dict | Response:
        p_body = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        p_body.pop("stream_options", None)
        p_body.pop("max_completion_tokens", None)
        r = await client.post(prefill_url + path, json=p_body, headers=headers)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return r.json()

    async def _handle(path: str, request: Request):
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        prefilled = await _prefill(path, body, headers)
        if isinstance(prefilled, Response):
            return prefilled
        d_body = dict(body, kv_transfer_params=prefilled.get("kv_transfer_params"))
        if not body.get("stream"):
            r = await client.post(decode_url + path, json=d_body, headers=headers)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        req = client.build_request("POST", decode_url + path, json=d_body, headers=headers)
        upstream = await client.send(req, stream=True)

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        r = await client.get(decode_url + "/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.get("/health")
    async def health():
        try:
            ok = all([(await client.get(u + "/health")).status_code == 200 for u in (prefill_url, decode_url)])
        except httpx.HTTPError:  # a backend is down or still starting
            ok = False
        return Response(status_code=200 if ok else 503)

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", required=True, help="base URL of the kv_producer server")
    ap.add_argument("--decode", required=True, help="base URL of the kv_consumer server")
    args = ap.parse_args()
    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
