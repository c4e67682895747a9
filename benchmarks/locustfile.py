"""Locust users for vLLM's OpenAI-compatible server (yali-vllm load and soak tests).

Two streaming users:

* ``ChatCompletionsUser`` -- ``POST /v1/chat/completions`` with ``stream: true``
* ``CompletionsUser``     -- ``POST /v1/completions`` with ``stream: true``

Every request records, as custom locust events (so they show up in the CSV stats):

* ``request_type="TTFT"``: time from sending the request to the first token chunk;
* ``request_type="ITL"``: the gap between consecutive token chunks, one event per chunk;

and the request itself (``request_type="POST"``, name = the endpoint path) with the
end-to-end time.  A request is a failure on an HTTP error, a stream error (an
``error`` object in the stream, bad JSON, a stream that ends without ``[DONE]``, a
timeout) or an empty completion (no token chunk, or ``completion_tokens == 0``).

Environment (all optional):

=============================== ============================================ =======
LOAD_MODEL                      model name; default: first id of /v1/models
LOAD_MAX_TOKENS                 max_tokens per request (clamped 1..4096)     64
LOAD_PROMPT_WORDS               prompt length in words (clamped 1..8192)     128
LOAD_CHAT_WEIGHT                weight of the chat user (0 = off)            1
LOAD_COMPLETIONS_WEIGHT         weight of the completions user (0 = off)     1
LOAD_IGNORE_EOS                 1: generate exactly max_tokens               1
LOAD_TIMEOUT_S                  read timeout per request, seconds            120
LOAD_WAIT_S                     max think time between requests, seconds     0
LOAD_API_KEY                    sent as ``Authorization: Bearer <key>``;
                                unset or empty: no header
=============================== ============================================ =======

Run (headless): ``locust -f benchmarks/locustfile.py --headless -u 32 -r 8 -t 60s
--host http://127.0.0.1:8000 --csv out/locust --html out/locust.html --only-summary``
(``benchmarks/load_test.py`` does this for you, against servers it starts).
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

# locust first: importing it monkey-patches the standard library (gevent), which
# must happen before requests/urllib3/ssl are imported.
from locust import User, between, constant, events, task  # isort: skip
from locust.exception import StopUser  # isort: skip

import requests  # isort: skip

TTFT = "TTFT"
ITL = "ITL"
STREAM_STAT_NAME = "stream"  # one TTFT row and one ITL row in the stats, all endpoints together


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    try:
        val = int(os.environ.get(name, default))
    except ValueError:
        val = default
    return max(lo, min(hi, val))


def _env_float(name: str, default: float, lo: float, hi: float) -> float:
    try:
        val = float(os.environ.get(name, default))
    except ValueError:
        val = default
    return max(lo, min(hi, val))


MAX_TOKENS = _env_int("LOAD_MAX_TOKENS", 64, 1, 4096)
PROMPT_WORDS = _env_int("LOAD_PROMPT_WORDS", 128, 1, 8192)
CHAT_WEIGHT = _env_int("LOAD_CHAT_WEIGHT", 1, 0, 1000)
COMPLETIONS_WEIGHT = _env_int("LOAD_COMPLETIONS_WEIGHT", 1, 0, 1000)
IGNORE_EOS = os.environ.get("LOAD_IGNORE_EOS", "1").strip().lower() not in ("0", "false", "no", "")
REQUEST_TIMEOUT_S = _env_float("LOAD_TIMEOUT_S", 120.0, 1.0, 3600.0)
WAIT_S = _env_float("LOAD_WAIT_S", 0.0, 0.0, 60.0)
API_KEY = os.environ.get("LOAD_API_KEY", "")  # = vLLM's --api-key / VLLM_API_KEY

if CHAT_WEIGHT == 0 and COMPLETIONS_WEIGHT == 0:
    raise ValueError("LOAD_CHAT_WEIGHT and LOAD_COMPLETIONS_WEIGHT are both 0: no user to run")

_WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly "
    "judge boxing matches in the valley near an old stone bridge at dawn "
    "tensor parallel all reduce latency matters for every generated token"
).split()


class StreamError(Exception):
    """The server's stream was malformed, carried an error, or ended early."""


class EmptyCompletion(Exception):
    """The request succeeded at HTTP level but produced no tokens."""


class HTTPStatusError(Exception):
    pass


def auth_headers(api_key: str = API_KEY) -> dict[str, str]:
    """Headers every request carries: the bearer token vLLM checks when it has an API key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def make_prompt(rng: random.Random, words: int = PROMPT_WORDS) -> str:
    # A random head makes prompts distinct, so prefix caching does not hide prefill.
    head = f"Request {rng.getrandbits(48):012x}."
    return head + " " + " ".join(rng.choice(_WORDS) for _ in range(words))


def fire(request_type: str, name: str, response_time_ms: float, length: int = 0, exc: BaseException | None = None, context: dict[str, Any] | None = None) -> None:
    events.request.fire(
        request_type=request_type,
        name=name,
        response_time=response_time_ms,
        response_length=length,
        exception=exc,
        context=context or {},
    )


def iter_sse_data(resp: requests.Response):
    """Yield the ``data:`` payloads of a server-sent-events response as they arrive."""
    # chunk_size=None: yield each HTTP chunk as soon as it arrives (uvicorn streams
    # chunked); a fixed chunk size would make urllib3 wait for that many bytes.
    for raw in resp.iter_lines(chunk_size=None):
        if not raw:
            continue
        line = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
        if line.startswith(":") or not line.startswith("data:"):
            continue  # SSE comment / keep-alive / other field
        yield line[5:].strip()


class _StreamingUser(User):
    abstract = True
    endpoint = ""
    wait_time = constant(0) if WAIT_S <= 0 else between(0, WAIT_S)

    _model_name: str | None = os.environ.get("LOAD_MODEL") or None

    def on_start(self) -> None:
        self.session = requests.Session()
        self.session.trust_env = False  # loopback only: never a proxy
        self.session.headers.update(auth_headers())
        self.rng = random.Random()
        if _StreamingUser._model_name is None:
            _StreamingUser._model_name = self._discover_model()

    def on_stop(self) -> None:
        self.session.close()

    def _discover_model(self) -> str:
        url = f"{self.host.rstrip('/')}/v1/models"
        last: BaseException | None = None
        for _ in range(3):
            t0 = time.perf_counter()
            try:
                r = self.session.get(url, timeout=10)
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
                fire("GET", "/v1/models", (time.perf_counter() - t0) * 1000.0, len(r.content))
                return model
            except Exception as e:  # noqa: BLE001 -- recorded as a failure below
                last = e
                time.sleep(1.0)
        fire("GET", "/v1/models", 0.0, 0, last)
        raise StopUser()

    # -- per endpoint -----------------------------------------------------------------
    def prompt_fields(self, prompt: str) -> dict[str, Any]:
        """The endpoint's prompt field(s): {"prompt": ...} or {"messages": [...]}."""
        raise NotImplementedError

    def payload(self, model: str, prompt: str) -> dict[str, Any]:
        return {
            "model": model,
            **self.prompt_fields(prompt),
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": IGNORE_EOS,
        }

    @staticmethod
    def token_text(choice: dict[str, Any]) -> str | None:
        """Text of a token chunk, or None if the chunk carries no generated token."""
        raise NotImplementedError

    # -- the request --------------------------------------------------------------------
    def stream_request(self) -> None:
        model = _StreamingUser._model_name
        assert model is not None
        url = f"{self.host.rstrip('/')}{self.endpoint}"
        body = self.payload(model, make_prompt(self.rng))
        start = time.perf_counter()
        last_token_t: float | None = None
        n_chunks = 0
        text_len = 0
        completion_tokens: int | None = None
        exc: BaseException | None = None
        try:
            with self.session.post(url, json=body, stream=True, timeout=(10.0, REQUEST_TIMEOUT_S)) as resp:
                if resp.status_code != 200:
                    raise HTTPStatusError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                done = False
                for data in iter_sse_data(resp):
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError as e:
                        raise StreamError(f"bad JSON in stream: {data[:120]!r}") from e
                    if obj.get("error"):
                        raise StreamError(f"error in stream: {str(obj['error'])[:200]}")
                    usage = obj.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        completion_tokens = int(usage["completion_tokens"])
                    choices = obj.get("choices") or []
                    if not choices:
                        continue
                    piece = self.token_text(choices[0])
                    if piece is None:
                        continue
                    now = time.perf_counter()
                    if last_token_t is None:
                        fire(TTFT, STREAM_STAT_NAME, (now - start) * 1000.0)
                    else:
                        fire(ITL, STREAM_STAT_NAME, (now - last_token_t) * 1000.0)
                    last_token_t = now
                    n_chunks += 1
                    text_len += len(piece)
                if not done:
                    raise StreamError("stream ended without [DONE]")
                if n_chunks == 0 or completion_tokens == 0:
                    raise EmptyCompletion(f"empty completion (chunks={n_chunks}, completion_tokens={completion_tokens})")
        except (requests.RequestException, StreamError, EmptyCompletion, HTTPStatusError, ValueError, OSError) as e:
            exc = e
        fire(
            "POST",
            self.endpoint,
            (time.perf_counter() - start) * 1000.0,
            text_len,
            exc,
            {"chunks": n_chunks, "completion_tokens": completion_tokens},
        )

    @task
    def generate(self) -> None:
        self.stream_request()


class ChatCompletionsUser(_StreamingUser):
    abstract = CHAT_WEIGHT == 0
    weight = max(CHAT_WEIGHT, 1)
    endpoint = "/v1/chat/completions"

    def prompt_fields(self, prompt: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": prompt}]}

    @staticmethod
    def token_text(choice: dict[str, Any]) -> str | None:
        delta = choice.get("delta") or {}
        if "role" in delta and not delta.get("content"):
            return None  # vLLM's first chunk announces the role; no token yet
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key) is not None:
                return str(delta[key])
        if delta.get("tool_calls"):
            return json.dumps(delta["tool_calls"])
        return None


class CompletionsUser(_StreamingUser):
    abstract = COMPLETIONS_WEIGHT == 0
    weight = max(COMPLETIONS_WEIGHT, 1)
    endpoint = "/v1/completions"

    def prompt_fields(self, prompt: str) -> dict[str, Any]:
        return {"prompt": prompt}

    @staticmethod
    def token_text(choice: dict[str, Any]) -> str | None:
        text = choice.get("text")
        return None if text is None else str(text)
