"""The OpenAI-compatible endpoint agents play their episodes through (``rollout.agent``).

FastAPI on uvicorn, in a thread of the inference replica's TP rank 0, on loopback at a
port the system picks. Each episode has a URL of its own,
``http://127.0.0.1:<port>/agents/<key>/v1`` (the key is random and is also the API key its
agent is given), which serves:

- ``POST /chat/completions`` and ``POST /completions`` (no streaming);
- ``GET /models``: the one model, ``rollout.agent.model_name``.

This module only checks what it can without the episode - the body is a JSON object, the
model is the one served, no streaming, one choice - and answers anything else with the
API's error shape, ``{"error": {"message", "type", "param", "code"}}``. A request that
passes is handed to the rollout's thread (:attr:`AgentServer.requests`), which samples it
with the other agents' requests and answers it (:mod:`megarlhf.rollout.agents`).
"""


# (no "from __future__ import annotations": FastAPI reads the handlers' annotations)
import asyncio
import concurrent.futures
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass

STARTUP_S = 30.0  # uvicorn's start, at most


@dataclass
class Request:
    """A request for one episode's model, waiting for the rollout's thread: ``key`` is the
    episode's URL key, ``kind`` is ``chat`` or ``completion``, ``answer`` takes (HTTP
    status, JSON body)."""

    key: str
    episode: int
    kind: str
    body: dict
    answer: concurrent.futures.Future


def error_body(message: str, *, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    """The OpenAI API's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class AgentServer:
    """The endpoint: started once, serving whichever episodes :meth:`open` names."""

    def __init__(self, model_name: str):
        import uvicorn

        self.model_name = model_name
        self.requests: queue.Queue[Request] = queue.Queue()
        self.episodes: dict[str, int] = {}  # key -> the episode's index in its rollout
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="megarlhf-agent-endpoint", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STARTUP_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agents' endpoint (uvicorn on 127.0.0.1:{self.port}) "
                                   f"did not start within {STARTUP_S:g} s")
            time.sleep(0.01)

    def url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/agents/{key}/v1"

    def open(self, keys: dict[str, int]) -> None:
        """Serve these episodes ({key: episode}) from now on, and no others."""
        self.episodes = dict(keys)

    def end(self, key: str) -> None:
        """Stop serving one episode (its agent is done)."""
        self.episodes.pop(key, None)

    def close(self) -> None:
        self.episodes = {}
        self.server.should_exit = True
        self.thread.join(timeout=5)

    # -------------------------------------------------------------- the app

    def _app(self):
        from fastapi import FastAPI, Request as HTTPRequest
        from fastapi.exceptions import RequestValidationError
        from fastapi.responses import JSONResponse
        from starlette.exceptions import HTTPException

        app = FastAPI(title="megarlhf agent endpoint", docs_url=None, redoc_url=None,
                      openapi_url=None)

        def fail(status: int, message: str, **kw) -> JSONResponse:
            return JSONResponse(error_body(message, **kw), status_code=status)

        @app.exception_handler(HTTPException)
        async def http_error(_, err: HTTPException):
            return fail(err.status_code, str(err.detail),
                        code="not_found" if err.status_code == 404 else None)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, err: RequestValidationError):
            return fail(400, str(err))

        @app.get("/agents/{key}/v1/models")
        async def models(key: str):
            if key not in self.episodes:
                return fail(404, "no episode has this URL (it ended, or the key is wrong)",
                            code="episode_not_found")
            return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                "created": 0, "owned_by": "megarlhf"}]}

        async def serve(key: str, request: HTTPRequest, kind: str):
            episode = self.episodes.get(key)
            if episode is None:
                return fail(404, "no episode has this URL (it ended, or the key is wrong)",
                            code="episode_not_found")
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                return fail(400, f"the request body is not valid JSON ({err})",
                            code="invalid_json")
            if not isinstance(body, dict):
                return fail(400, f"the request body must be a JSON object, got "
                                 f"{type(body).__name__}", code="invalid_json")
            model = body.get("model")
            if model != self.model_name:
                return fail(404, f"The model {model!r} does not exist: this endpoint serves "
                                 f"{self.model_name!r} (rollout.agent.model_name)",
                            code="model_not_found", param="model")
            if body.get("stream"):
                return fail(400, "stream=true is not supported: the endpoint answers each "
                                 "request whole", param="stream")
            if body.get("n", 1) not in (1, None):
                return fail(400, f"n={body.get('n')!r}: the endpoint samples one choice per "
                                 "request (each is a turn of the episode)", param="n")
            answer: concurrent.futures.Future = concurrent.futures.Future()
            self.requests.put(Request(key, episode, kind, body, answer))
            status, payload = await asyncio.wrap_future(answer)
            return JSONResponse(payload, status_code=status)

        @app.post("/agents/{key}/v1/chat/completions")
        async def chat(key: str, request: HTTPRequest):
            return await serve(key, request, "chat")

        @app.post("/agents/{key}/v1/completions")
        async def completions(key: str, request: HTTPRequest):
            return await serve(key, request, "completion")

        return app
