"""A toy proxy for prefill/decode disaggregation with minivllm's P2pZmqConnector.

Each completion or chat request goes first to the prefill server (a `kv_producer`) with `max_tokens=1`, `n=1`
and `kv_transfer_params={"do_remote_decode": true}`; the `kv_transfer_params` of its answer (the producer's
block ids, engine id, host and port) are added to the original request, which then goes to the decode server
(a `kv_consumer`). The decode server's answer, streamed or not, is the client's answer. A completion of
several prompts is prefilled but not transferred (the servers refuse to hold blocks one response cannot
name): the decode server computes it.

    minivllm serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer", "kv_port": 14579}'
    minivllm serve MODEL --port 8200 --kv-transfer-config '{"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"}'
    python examples/disagg_proxy.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Errors keep the OpenAI shape, `{"error": {"message", "type", "param", "code"}}`, whatever goes wrong behind
the proxy: a backend that refuses the connection (or whose connection pool is exhausted) is a 503, one that
drops the connection, answers garbage or times out is a 502, a backend's own error is passed on with its
status (wrapped in that shape if it was not JSON), and a stream that breaks after it started ends with an
`error` event. A body that is not a JSON object is a 400. A backend's 200 that is no answer (not JSON, a
prefill answer carrying an `error` or a `kv_transfer_params` that is not an object) is a 502. Whenever the
decode server does not take a request (it refused it, failed, or is down), the proxy releases the blocks the
producer holds for it.

A client that disconnects while its request waits for the decode (or, streamed, for the decode's first bytes)
cancels that call, so the decode server aborts the request, as a stream's disconnect does. The rule for the
producer's blocks: every set of `kv_transfer_params` the proxy received is released by the proxy itself once
its decode is over (DONE with `prompt_digest` to every producer rank, `release_remote_blocks`): a decode it
cancelled, a stream that ended early, a decode that failed, and a decode that finished, which may not have
pulled (a consumer whose adapter or weights differ refuses the KV and computes the prompt; its own DONE
names its prompt's digest, which frees nothing, so the blocks stayed held for `abort_timeout_s`). The decode
server does not do it: it aborts a request whose client left before its engine (and connector) saw it, and
nobody told the producer, which held the blocks for `abort_timeout_s` (120 s). A DONE the consumer also sent,
or one for blocks it pulled already, is harmless (the producer ACKs and frees nothing). A client that leaves
during the prefill does not cancel it: the producer may have finished the request already (its blocks held
for a pull) with the answer on its way, which a cancel dropped, and nobody could name the blocks. The
prefill goes on for nobody, for at most `PREFILL_GRACE_S` (or `timeout_s` if less), and its answer's
parameters are released; a prefill still running then is cancelled, and the producer aborts it.

Source: the role of vLLM's examples/online_serving/disaggregated_serving (toy proxy server); the error body of
vLLM v0.15 entrypoints/openai/protocol.py `ErrorResponse`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from http import HTTPStatus

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.distributed.kv_transfer.kv_connector.v1.p2p_zmq_connector import release_remote_blocks

logger = logging.getLogger("disagg_proxy")


def error_body(status: int, message: str) -> dict:
    "OpenAI's error shape; `type` is the status phrase, as in `BadGatewayError`."
    phrase = HTTPStatus(status).phrase.replace(" ", "")
    err_type = phrase if phrase.endswith("Error") else phrase + "Error"  # not InternalServerErrorError
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def backend_failure(role: str, url: str, e: httpx.HTTPError) -> JSONResponse:
    "A transport failure talking to a backend: 503 if it could not be reached, else 502."
    unreachable = isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))
    status = 503 if unreachable else 502
    logger.warning("%s server %s: %s: %s", role, url, type(e).__name__, e)
    what = "is unavailable" if unreachable else "failed"
    return error_response(status, f"the {role} server {what}: {type(e).__name__}: {e}")


def passthrough(r: httpx.Response) -> Response:
    "A backend's own answer, with its status; a non-JSON error body is wrapped in OpenAI's shape."
    if r.status_code != 200:
        try:
            body = r.json()
            if isinstance(body, dict) and "error" in body:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        except ValueError:
            pass
        return error_response(r.status_code, f"backend error: {r.text[:500]}")
    try:
        r.json()
    except ValueError:  # a 200 that is not JSON is no answer: the backend is broken, not the client
        return error_response(502, f"the backend's answer is not JSON: {r.text[:200]!r}")
    return Response(r.content, status_code=r.status_code, media_type="application/json")


MAX_PREFILL_ANSWER_BYTES = 64 << 20  # one token and kv_transfer_params; echoed prompt logprobs at most
PREFILL_GRACE_S = 10.0  # how long a prefill whose client left may go on, so that its blocks can be released


async def _disconnected(request: Request) -> None:
    "Return once the client has gone (its body was read already: the next message is the disconnect)."
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, call, cancel: bool = True):
    """`await call` (a backend request, or a task of one), unless the client disconnects first: then None is
    returned and the call is cancelled, which closes its connection, so the backend aborts the request as it
    would for the client itself; with `cancel` False it is left running (the caller holds the task).
    Starlette does not cancel a handler whose client left: without this, a client that gave up left the
    decode server generating every `max_tokens` for nobody. Re-raises what the call raised."""
    task = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    if not cancel:
        return None
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await task
    return None


def _is_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def _seconds(text: str) -> float:
    "argparse type of a timeout flag: a positive, finite number of seconds."
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not _is_seconds(value):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number of seconds; got {text!r}")
    return value


# fields of the client's request that the one-token prefill must not carry (it would refuse or stop early)
_DECODE_ONLY_FIELDS = (
    "stream_options",
    "best_of",
    "max_completion_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
)


def build_app(
    prefill_url: str, decode_url: str, timeout_s: float = 600.0, health_timeout_s: float = 5.0
) -> FastAPI:
    """The proxy's app. `timeout_s`: the longest a prefill or a non-streamed decode may take in all
    (seconds; a long prompt on a CPU may take minutes), and the longest wait for each read of a stream;
    past it the client gets a 502. A prefill's answer is read up to `MAX_PREFILL_ANSWER_BYTES`. `health_timeout_s`: `/health`'s wait for each backend, short, so that a backend that accepts
    connections and never answers (a stopped process: `kill -STOP`) shows as unhealthy at once. Raises
    ValueError for a timeout that is not a positive number."""
    for name, value in (("timeout_s", timeout_s), ("health_timeout_s", health_timeout_s)):
        if not _is_seconds(value):
            raise ValueError(f"{name} must be a positive, finite number of seconds; got {value!r}")
    client = httpx.AsyncClient(timeout=timeout_s)
    behind: set[asyncio.Task] = set()  # releases (and prefills) going on for clients that left

    def _in_background(coro) -> None:
        "Run `coro` on its own task, kept until it ends (the event loop holds tasks weakly)."
        task = asyncio.ensure_future(coro)
        behind.add(task)
        task.add_done_callback(behind.discard)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if behind:  # let the releases under way reach the producer before the connections close
            await asyncio.wait(set(behind), timeout=min(timeout_s, PREFILL_GRACE_S) + 3)
        await client.aclose()  # its pooled connections close with the app, not at garbage collection

    app = FastAPI(lifespan=lifespan)

    def _prefill_body(body: dict) -> dict:
        # n=1: the prefill is one request whatever the client's n (one response names one set of blocks)
        # ignore_eos: an EOS (or a stop) as the one token would finish it "stopped", and a stopped request
        # hands over no blocks. Whatever limits the client's own decode (min_tokens, stops) is the decode
        # server's business: with max_tokens=1, a min_tokens of 5 was the producer's 400 for a valid request.
        p_body = dict(body, max_tokens=1, n=1, stream=False, ignore_eos=True,
                      kv_transfer_params={"do_remote_decode": True})  # fmt: skip
        for key in _DECODE_ONLY_FIELDS:
            p_body.pop(key, None)
        return p_body

    async def _post(url: str, body: dict, headers: dict, max_bytes: int | None = None) -> httpx.Response:
        """POST and read the whole answer within `timeout_s` in all (httpx's timeout bounds each read only: a
        backend trickling a byte a second held the client for minutes), at most `max_bytes` of it. Raises
        httpx.ReadTimeout past the deadline, httpx.RemoteProtocolError past the size."""
        try:
            async with (
                asyncio.timeout(timeout_s),
                client.stream("POST", url, json=body, headers=headers) as r,
            ):
                chunks, size = [], 0
                async for chunk in r.aiter_bytes():
                    size += len(chunk)
                    if max_bytes is not None and size > max_bytes:
                        raise httpx.RemoteProtocolError(f"its answer is over {max_bytes} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise httpx.ReadTimeout(f"no complete answer within {timeout_s:g} s") from None
        kept = {k: v for k, v in r.headers.items() if k.lower() == "content-type"}
        return httpx.Response(r.status_code, headers=kept, content=b"".join(chunks))

    async def _prefill(path: str, body: dict, headers: dict, request: Request) -> dict | Response:
        p_body = _prefill_body(body)
        task = asyncio.ensure_future(_post(prefill_url + path, p_body, headers, MAX_PREFILL_ANSWER_BYTES))
        try:
            r = await _unless_gone(request, task, cancel=False)
        except httpx.HTTPError as e:
            return backend_failure("prefill", prefill_url, e)
        if r is None:  # the client left: the prefill goes on for nobody, and its blocks are released
            _in_background(_release_abandoned_prefill(path, body, headers, task))
            return Response(status_code=499)
        if r.status_code != 200:
            return passthrough(r)
        try:
            answer = r.json()
        except ValueError:
            return error_response(502, "the prefill server's answer is not JSON")
        if not isinstance(answer, dict):
            return error_response(502, "the prefill server's answer is not an object")
        if "error" in answer:  # a 200 carrying an error: the prefill failed, whatever its status says
            return error_response(
                502, f"the prefill server answered with an error: {str(answer['error'])[:300]}"
            )
        params = answer.get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):  # the client never sent this field
            return error_response(502, "the prefill server's kv_transfer_params is not an object")
        return answer

    async def _release_abandoned_prefill(path: str, body: dict, headers: dict, task: asyncio.Task) -> None:
        """The client left while `task` (its prefill) ran: wait for its answer up to `PREFILL_GRACE_S`, and
        release the blocks it names. A cancel instead lost the answer of a prefill the producer had finished
        (7 of 27 blocks left held by 60 departing clients). Past the grace the prefill is cancelled: the
        producer aborts a request still running."""
        try:
            r = await asyncio.wait_for(task, PREFILL_GRACE_S)
            params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        except (TimeoutError, httpx.HTTPError, ValueError, AttributeError):
            return  # cancelled, failed, or no answer with parameters: nothing is held for it
        await _release(path, body, params, headers, answered=True)

    async def _release(path: str, body: dict, params: dict | None, headers: dict, answered: bool) -> None:
        """Nobody will pull the blocks `params` name: the client left (its decode cancelled, its stream ended
        early, its prefill finished for nobody), or the decode server did not take the request: it refused
        it (a prompt longer than its `max_model_len`, a `max_tokens` too large for it, a model name only the
        prefill server serves), it failed (a 5xx, a timeout, garbage) or it is down (`answered` False). The
        producer held such blocks until its `abort_timeout_s` (120 s): clients repeating such requests (or
        60 clients leaving, 27 blocks) filled its KV cache. Tell the producer DONE directly
        (`release_remote_blocks`, with the parameters' `prompt_digest`); parameters without one (an older
        producer) are released as before, by asking a decode server that answered for the one-token request
        the producer served, which it pulls (this fails when the decode server refuses the prompt itself).
        A decode that finished is released too, by `prompt_digest` only (`answered` False): it may not have
        pulled (a consumer of another adapter or weights refuses the KV), and after a pull it frees nothing.
        """
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        if isinstance(params.get("prompt_digest"), str):
            acked = await asyncio.to_thread(release_remote_blocks, params)
            if not acked:
                rid = params.get("remote_request_id")
                logger.warning("prefill server: no rank acknowledged releasing %s", rid)
            return
        if not answered:
            return
        try:
            await client.post(decode_url + path, json=dict(_prefill_body(body), kv_transfer_params=params),
                              headers=headers)  # fmt: skip
        except httpx.HTTPError as e:
            logger.warning("decode server %s: %s: %s (releasing the producer's blocks)", decode_url,
                           type(e).__name__, e)  # fmt: skip

    async def _relay(upstream: httpx.Response, release):
        """Relay the decode's stream; `release(ended)` (a coroutine) then runs on its own task, however it
        ended (`ended`: the stream was relayed whole)."""
        ended = False
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
            ended = True
        except httpx.HTTPError as e:  # the decode server went away mid-stream: end with an error event
            logger.warning("decode server %s: %s: %s (mid-stream)", decode_url, type(e).__name__, e)
            body = error_body(502, f"the decode server failed mid-stream: {type(e).__name__}: {e}")
            yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()  # after any partial event
        finally:  # released whatever the end: a decode that never pulled left the blocks held
            _in_background(release(ended))  # on a task: the generator may be being cancelled (client left)
            await upstream.aclose()

    async def _handle(path: str, request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        prefilled = await _prefill(path, body, headers, request)
        if isinstance(prefilled, Response):
            return prefilled
        params = prefilled.get("kv_transfer_params")
        d_body = dict(body, kv_transfer_params=params)
        try:
            if not body.get("stream"):
                answer = await _unless_gone(request, _post(decode_url + path, d_body, headers))
            else:
                req = client.build_request("POST", decode_url + path, json=d_body, headers=headers)
                answer = await _unless_gone(request, client.send(req, stream=True))
            if answer is None:  # the client left: the decode server aborts, maybe before its engine saw it
                await _release(path, body, params, headers, answered=True)
                return Response(status_code=499)
            if not body.get("stream"):
                out = passthrough(answer)
                if out.status_code != 200:  # refused, failed, or a 200 that is no answer
                    await _release(path, body, params, headers, answered=True)
                else:  # it may not have pulled (it refused the KV): by prompt_digest only, no fallback
                    _in_background(_release(path, body, params, headers, answered=False))
                return out
            upstream = answer
        except httpx.HTTPError as e:  # down, timed out, or broke the connection: it took nothing
            await _release(path, body, params, headers, answered=False)
            return backend_failure("decode", decode_url, e)
        if upstream.status_code != 200:
            await upstream.aread()
            await upstream.aclose()
            await _release(path, body, params, headers, answered=True)
            return passthrough(upstream)
        # a finished stream is released by prompt_digest only (`answered` False: no one-token fallback)
        relay = _relay(upstream, lambda ended: _release(path, body, params, headers, answered=not ended))
        return StreamingResponse(relay, status_code=200, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        try:
            return passthrough(await client.get(decode_url + "/v1/models"))
        except httpx.HTTPError as e:
            return backend_failure("decode", decode_url, e)

    @app.get("/health")
    async def health():
        try:
            codes = [(await client.get(u + "/health", timeout=health_timeout_s)).status_code
                     for u in (prefill_url, decode_url)]  # fmt: skip
            ok = all(c == 200 for c in codes)
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
    ap.add_argument("--timeout", type=_seconds, default=600.0,
                    help="seconds to wait for a backend (to connect, and for each read while it computes); "
                         "past it the client gets a 502 (default 600)")  # fmt: skip
    ap.add_argument(
        "--health-timeout", type=_seconds, default=5.0, help="seconds /health waits for each backend"
    )
    args = ap.parse_args()
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout, args.health_timeout)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
