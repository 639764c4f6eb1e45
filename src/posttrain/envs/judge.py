"""An LLM as the judge: the reward of a reply is the score another language model gives it.

The judge is one of two things (give exactly one):

- `path`: a local Hugging Face chat model (a directory, hub id or embedded name), run greedily (`max_new_tokens` per
  verdict). The environment never loads it: the caller builds a `JudgeModel` (the recipes do it in
  `posttrain.algorithms.environments`, loaded once in this process, run in batches of `batch_size` by posttrain's
  transformers generator) and hands it in as `local_model`.
- `base_url` with `model`: an OpenAI-compatible server (vLLM, SGLang, TGI, a hosted API), one
  `POST {base_url}/v1/chat/completions` per reply to judge (a base_url that already ends in /v1 is not given a
  second one), greedy (temperature 0, `max_tokens` = max_new_tokens), `concurrency` requests at a time. Each request
  may take `timeout_s` in all (connecting, sending and reading the whole answer: a server that drips bytes is cut
  off at the deadline) and its answer at most `max_response_bytes` (a larger one is not read); a connection error,
  a timeout, HTTP 429 or 5xx is retried up to `max_retries` times, after retry_backoff_s · 2^k seconds before the
  k-th retry. Any other HTTP status is final; a redirect (3xx) is refused, never followed, so the request and its
  API key go to the configured address only. The API key, if the server needs one, is read from the environment variable named
  `api_key_env` (so it never appears in config.yaml). Only the standard library (urllib) is used.

What the judge reads: `template` filled with {prompt} (the last user message before the reply), {response} (the
reply), {min_score}, {max_score}, and every column of the row by name; sent as one user message, after
`system_prompt` when one is given (the local judge renders it with its chat template when it has one and
`use_chat_template` is on, else as plain text).

The verdict: `parse_score` finds every match of `score_pattern` (one capture group; by default "Score: N",
case-insensitive, also "**Score:** N", "score = N"). Exactly one distinct finite number within
[min_score, max_score] is a score; with `normalize` the reward is (score − min_score) / (max_score − min_score) in
[0, 1], else the score itself. Everything else masks the sample with an error saying why, and is counted, never
turned into a zero (which the advantage estimator would learn from):

    no_score        the pattern matches nothing (an empty or off-format reply)
    several_scores  it matches two or more different numbers ("Score: 3 ... Score: 9"; the same number twice is fine)
    not_a_number    what it captured is no finite number ("Score: seven", "Score: excellent", "Score: nan")
    out_of_range    the number lies outside [min_score, max_score]
    timeout, http_error, connection_error   the request failed after its retries
    invalid_response                        the server's answer is not a chat completion (bad JSON, no content)

`counts` holds, over the environment's life, how many samples each failure kind masked, `judged` (verdicts
asked of the judge) and `cache_hits` (samples answered from the cache); the training loop counts the masked
samples itself too (reward/errors).

Cache: a verdict is kept under the hash of the exact messages the judge reads (so of the prompt, the response and
every column the template uses) for the environment's lifetime, and a repeated (prompt, response), within a batch
or across steps, is not judged again. Only the judge's own answers are cached (a score or a parse failure);
transport failures (timeout, HTTP, connection, invalid response) are asked again next time.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import math
import os
import re
import socket
import string
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.config.environments import DEFAULT_JUDGE_TEMPLATE as DEFAULT_TEMPLATE
from posttrain.config.environments import DEFAULT_SCORE_PATTERN
from posttrain.envs.base import EnvStep, Message, check_batch, prompt_of, reply_of, single_turn_step
FIXED_FIELDS = ("prompt", "response", "min_score", "max_score")
QUOTED_REPLY_CHARS = 200
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Verdict:
    """What became of one reply the judge scored."""

    score: float | None
    """The judge's score in [min_score, max_score]; None when it failed."""
    failure: str | None
    """Why it failed, one of the kinds in the module docstring; None for a score."""
    error: str | None
    """The failure as a sentence (quoting the judge's reply), or None."""


def parse_score(text: str, pattern: str | re.Pattern, min_score: float, max_score: float) -> Verdict:
    """The score in the judge's reply `text`: every match of `pattern`'s one capture group must read as the same
    finite number in [min_score, max_score] (see the module docstring for the failures)."""
    quoted = repr(text[:QUOTED_REPLY_CHARS] + ("..." if len(text) > QUOTED_REPLY_CHARS else ""))
    regex = re.compile(pattern) if isinstance(pattern, str) else pattern
    captured = [match.group(1) for match in regex.finditer(text)]
    if not captured:
        return Verdict(None, "no_score", f"no score in the judge's reply {quoted}")
    numbers = []
    for item in captured:
        try:
            number = float(item)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            return Verdict(None, "not_a_number", f"the judge's score {item!r} is not a number, in {quoted}")
        numbers.append(number)
    distinct = sorted(set(numbers))
    if len(distinct) > 1:
        listed = ", ".join(f"{n:g}" for n in distinct)
        return Verdict(None, "several_scores", f"the judge gave several different scores ({listed}) in {quoted}")
    score = distinct[0]
    if not min_score <= score <= max_score:
        return Verdict(None, "out_of_range",
                       f"the judge's score {score:g} is outside [{min_score:g}, {max_score:g}], in {quoted}")
    return Verdict(score, None, None)


@dataclass(frozen=True)
class JudgeReply:
    """The judge backend's answer to one conversation: its text, or why there is none (a transport failure:
    timeout, http_error, connection_error, invalid_response)."""

    text: str | None
    failure: str | None = None
    error: str | None = None


class JudgeModel(Protocol):
    """A local judge, built by the caller: greedy replies to conversations."""

    def complete(self, conversations: list[list[Message]]) -> list[str]:
        """The judge's reply to each conversation (a list of chat messages), in order."""
        ...

    def close(self) -> None:
        """Release the model."""
        ...


class CachedJudge:
    """The judge's replies to conversations, cached by the exact messages (transport failures are not cached, so a
    conversation is asked again next time); `counts` gains `judged` and `cache_hits`."""

    def __init__(self, backend: JudgeBackend, counts: Counter[str]):
        self.backend, self.counts = backend, counts
        self.cache: dict[str, JudgeReply] = {}

    def ask(self, conversations: list[list[Message]]) -> list[JudgeReply]:
        keys = [hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest() for c in conversations]
        fresh: dict[str, list[Message]] = {}
        for key, conversation in zip(keys, conversations):
            if key in self.cache or key in fresh:
                self.counts["cache_hits"] += 1
            else:
                fresh[key] = conversation
        failed: dict[str, JudgeReply] = {}
        for key, reply in zip(fresh, self.backend.complete(list(fresh.values()))):
            self.counts["judged"] += 1
            if reply.text is None:
                failed[key] = reply
            else:
                self.cache[key] = reply
        return [failed.get(key) or self.cache[key] for key in keys]


class JudgeEnvironment:
    """Single turn. Reward: a judge model's score of the reply (see the module docstring for every option).

    local_model: a local judge built by the caller, or base_url (with model) for a server; exactly one.
    Metadata out: the row's metadata plus `judge_score` (the raw score, None when the verdict failed).
    """

    def __init__(
        self,
        local_model: JudgeModel | None = None,
        base_url: str | None = None,
        model: str | None = None,
        api_key_env: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        system_prompt: str | None = None,
        score_pattern: str = DEFAULT_SCORE_PATTERN,
        min_score: float = 1.0,
        max_score: float = 10.0,
        normalize: bool = True,
        max_new_tokens: int = 64,
        timeout_s: float = 60.0,
        max_response_bytes: int = 4_000_000,
        max_retries: int = 3,
        retry_backoff_s: float = 1.0,
        concurrency: int = 8,
    ):
        if not min_score < max_score:
            raise ValueError(f"min_score ({min_score}) must be below max_score ({max_score})")
        for name, value in (("max_new_tokens", max_new_tokens), ("concurrency", concurrency)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.pattern = _score_regex(score_pattern)
        self.template_fields = _template_fields(template)
        self.template, self.system_prompt = template, system_prompt
        self.min_score, self.max_score, self.normalize = min_score, max_score, normalize
        self.backend = judge_backend(local_model, base_url, model, api_key_env, max_new_tokens, timeout_s,
                                     max_response_bytes, max_retries, retry_backoff_s, concurrency)
        self.counts: Counter[str] = Counter()
        """Failure kinds, `judged` and `cache_hits`, over the environment's life."""
        self.replies = CachedJudge(self.backend, self.counts)

    def step(self, message_logs: list[list[Message]], metadata: list[dict[str, Any]]) -> EnvStep:
        check_batch(message_logs, metadata)
        conversations = [self._judge_messages(log, row, index)
                         for index, (log, row) in enumerate(zip(message_logs, metadata))]
        rewards, errors, metadata_out = [], [], []
        for reply, row in zip(self.replies.ask(conversations), metadata):
            verdict = (Verdict(None, reply.failure, reply.error) if reply.text is None
                       else parse_score(reply.text, self.pattern, self.min_score, self.max_score))
            if verdict.failure is not None:
                self.counts[verdict.failure] += 1
            rewards.append(None if verdict.score is None else self._reward(verdict.score))
            errors.append(None if verdict.error is None else f"judge ({verdict.failure}): {verdict.error}")
            metadata_out.append({**row, "judge_score": verdict.score})
        return single_turn_step(rewards, errors, metadata_out)

    def close(self) -> None:
        """Release the local judge model (nothing to release for a server)."""
        self.backend.close()

    def _reward(self, score: float) -> float:
        if not self.normalize:
            return score
        return (score - self.min_score) / (self.max_score - self.min_score)

    def _judge_messages(self, log: list[Message], row: dict[str, Any], index: int) -> list[Message]:
        fields = {**row, "prompt": prompt_of(log), "response": reply_of(log), "min_score": f"{self.min_score:g}",
                  "max_score": f"{self.max_score:g}"}
        missing = [name for name in self.template_fields if name not in fields]
        if missing:
            raise ValueError(f"the judge's template uses {{{missing[0]}}}, but row {index} of the batch has no such "
                             f"column (it has {', '.join(sorted(fields))})")
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return [*messages, {"role": "user", "content": self.template.format(**fields)}]


class JudgeBackend(Protocol):
    """Where verdicts come from: a judge server or a local judge model."""

    def complete(self, conversations: list[list[Message]]) -> list[JudgeReply]:
        """The judge's reply to each conversation, in order; a transport failure is a reply without text."""
        ...

    def close(self) -> None:
        """Release what the backend holds."""
        ...


def judge_backend(local_model: JudgeModel | None = None, base_url: str | None = None, model: str | None = None,
                  api_key_env: str | None = None, max_new_tokens: int = 64, timeout_s: float = 60.0,
                  max_response_bytes: int = 4_000_000, max_retries: int = 3, retry_backoff_s: float = 1.0,
                  concurrency: int = 8) -> JudgeBackend:
    """The judge a JudgeEnvironment asks (the options mean what they mean there): an OpenAI-compatible server at
    base_url, or the local model handed in; exactly one. Environments with a verdict format of their own (the HLE
    and GDPval tasks, `posttrain.envs.judged`) ask it directly, with the same deadlines, retries and key handling."""
    if (local_model is None) == (base_url is None):
        raise ValueError("give the judge as either path (a local model) or base_url (an OpenAI-compatible "
                         f"server), exactly one of them; got a local model: {local_model is not None}, "
                         f"base_url={base_url!r}")
    if base_url is not None:
        if model is None:
            raise ValueError("base_url needs model, the name the server serves the judge under")
        return _HTTPJudge(base_url, model, _api_key(api_key_env), max_new_tokens, timeout_s, max_retries,
                          retry_backoff_s, concurrency, max_response_bytes)
    if model is not None or api_key_env is not None:
        raise ValueError("model and api_key_env belong to a judge server (base_url), not a local path")
    return _LocalJudge(local_model)


def _score_regex(pattern: str) -> re.Pattern:
    try:
        regex = re.compile(pattern)
    except re.error as error:
        raise ValueError(f"score_pattern {pattern!r} is not a regular expression: {error}") from None
    if regex.groups != 1:
        raise ValueError(f"score_pattern {pattern!r} must have exactly one capture group (the score), it has "
                         f"{regex.groups}")
    return regex


def _template_fields(template: str) -> list[str]:
    """The top-level names the template's placeholders use; ValueError for a malformed template."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise ValueError(f"the judge's template cannot be filled: {error} (write a literal brace as {{{{ or }}}})") \
            from None
    names = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not name or name.isdigit():
            raise ValueError(f"the judge's template has a positional placeholder {{{field}}}; name a field instead "
                             f"({', '.join(FIXED_FIELDS)} or a column of the data)")
        names.append(name)
    return names


def _api_key(variable: str | None) -> str | None:
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ValueError(f"api_key_env={variable!r}: the environment variable {variable} is not set (or empty)")
    return key


class _HTTPJudge:
    """An OpenAI-compatible chat-completions endpoint, called with urllib from a small thread pool."""

    def __init__(self, base_url: str, model: str, api_key: str | None, max_tokens: int, timeout_s: float,
                 max_retries: int, retry_backoff_s: float, concurrency: int, max_response_bytes: int):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be at least 1, got {max_response_bytes}")
        if max_retries < 0 or retry_backoff_s < 0:
            raise ValueError(f"max_retries and retry_backoff_s must be non-negative, got {max_retries}, "
                             f"{retry_backoff_s}")
        root = base_url.rstrip("/")
        self.url = root + ("/chat/completions" if root.endswith("/v1") else "/v1/chat/completions")
        self.model, self.api_key, self.max_tokens = model, api_key, max_tokens
        self.timeout_s, self.max_retries, self.retry_backoff_s = timeout_s, max_retries, retry_backoff_s
        self.concurrency, self.max_response_bytes = concurrency, max_response_bytes

    def complete(self, conversations: list[list[Message]]) -> list[JudgeReply]:
        if not conversations:
            return []
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(conversations))) as pool:
            return list(pool.map(self._ask, conversations))

    def close(self) -> None:
        """Nothing to release."""

    def _ask(self, messages: list[Message]) -> JudgeReply:
        body = json.dumps({"model": self.model, "messages": messages, "temperature": 0.0,
                           "max_tokens": self.max_tokens}).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        failed = JudgeReply(None)
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            started = time.monotonic()
            try:
                status, payload, location = _post(self.url, body, headers, self.timeout_s, self.max_response_bytes)
            except _TooLarge as error:
                return JudgeReply(None, "invalid_response", f"the answer from {self.url} is larger than "
                              f"max_response_bytes={self.max_response_bytes} ({error}); it was not read")
            except (OSError, http.client.HTTPException) as error:  # refused, reset, cut at the deadline, truncated
                if time.monotonic() - started >= self.timeout_s or isinstance(error, TimeoutError):
                    failed = JudgeReply(None, "timeout", f"no complete answer from {self.url} within "
                                    f"timeout_s={self.timeout_s:g} s (the limit on the whole request)")
                elif isinstance(error, (ConnectionRefusedError, socket.gaierror)):
                    failed = JudgeReply(None, "connection_error", f"cannot reach {self.url}: {error}")
                else:
                    failed = JudgeReply(None, "connection_error", f"the connection to {self.url} failed: {error!r}")
                continue
            if 300 <= status < 400:
                # Never followed: the request, API key included, would go wherever the answer points.
                return JudgeReply(None, "http_error", f"HTTP {status} from {self.url} redirects to {location!r}; "
                              "redirects are not followed (the API key would go with them): set base_url to the "
                              "address that answers")
            if status >= 400:
                detail = payload[:QUOTED_REPLY_CHARS].decode("utf-8", "replace")
                failed = JudgeReply(None, "http_error", f"HTTP {status} from {self.url}: {detail!r}")
                if status not in RETRIED_STATUSES:
                    return failed
                continue
            return _chat_content(payload, self.url)
        tries = self.max_retries + 1
        return JudgeReply(None, failed.failure, f"{failed.error} (after {tries} attempt{'s' if tries > 1 else ''})")


class _TooLarge(Exception):
    """An answer past max_response_bytes (its announced or its read size, in the message)."""


def _post(url: str, body: bytes, headers: dict[str, str], timeout_s: float, max_bytes: int
          ) -> tuple[int, bytes, str | None]:
    """POST `body` to `url` once: (status, body, Location header). The whole exchange (connecting, sending,
    the headers and every byte of the answer) must end within `timeout_s`: a watchdog shuts the socket at the
    deadline, so a server that sends one byte at a time cannot hold the call past it (a per-read timeout
    would). At most `max_bytes` of the answer are read (_TooLarge past them). Redirects are returned, never
    followed. http(s)_proxy / no_proxy from the environment are honoured, as urllib does."""
    deadline = time.monotonic() + timeout_s
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        proxy_parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        connection_class = http.client.HTTPSConnection if https else http.client.HTTPConnection
        connection = connection_class(proxy_parts.hostname, proxy_parts.port, timeout=timeout_s)
        if https:
            connection.set_tunnel(parts.hostname, parts.port)
        else:
            target = url
    elif https:
        connection = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout_s)
    else:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    watchdog = None
    try:
        connection.connect()
        sock = connection.sock
        watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _cut, (sock,))
        watchdog.daemon = True
        watchdog.start()
        connection.request("POST", target, body, headers)
        response = connection.getresponse()
        announced = response.getheader("Content-Length")
        if announced is not None and announced.isdigit() and int(announced) > max_bytes:
            raise _TooLarge(f"it announced {int(announced)} bytes")
        chunks, size = [], 0
        while chunk := response.read(min(1 << 16, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise _TooLarge(f"more than {max_bytes} bytes arrived")
            if time.monotonic() > deadline:
                raise TimeoutError
        if time.monotonic() > deadline:
            raise TimeoutError
        return response.status, b"".join(chunks), response.getheader("Location")
    finally:
        if watchdog is not None:
            watchdog.cancel()
        connection.close()


def _cut(sock: socket.socket) -> None:
    """The deadline passed: end every read and write on `sock` (they return or raise at once)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed: the call ended by itself
        pass


def _chat_content(payload: bytes, url: str) -> JudgeReply:
    """The assistant message of a chat-completions answer, or an invalid_response failure."""
    try:
        content = json.loads(payload)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        content = None
    if not isinstance(content, str):
        quoted = payload[:QUOTED_REPLY_CHARS].decode("utf-8", "replace")
        return JudgeReply(None, "invalid_response", f"{url} answered with no chat completion message: {quoted!r}")
    return JudgeReply(content)


class _LocalJudge:
    """A judge model in this process, built by the caller (`JudgeModel`)."""

    def __init__(self, model: JudgeModel):
        self.model = model

    def complete(self, conversations: list[list[Message]]) -> list[JudgeReply]:
        if not conversations:
            return []
        return [JudgeReply(text) for text in self.model.complete(conversations)]

    def close(self) -> None:
        self.model.close()
