"""HTTP plumbing shared by the service clients: one retry policy, one error mapping.

One owner per retry: this module's tenacity policy. The openai SDK runs with
``max_retries=0`` and Prefect never retries a request.
"""

from __future__ import annotations

import email.utils
import functools
import html
import json
import logging
import random
import re
import ssl
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx2
import tenacity

from quarry.errors import (
    BadResponse,
    DialectMismatch,
    InputTooLong,
    RequestRejected,
    ServiceError,
    ServiceUnavailable,
)

T = TypeVar("T")

# 424: TEI's backend failed; 429: overloaded (permits are per input, no queueing);
# 503: unhealthy or starting. All are worth another try after a pause.
TRANSIENT_STATUS = frozenset({408, 424, 429, 500, 502, 503, 504})
REJECTED_STATUS = frozenset({400, 401, 403, 404, 405, 413, 422})


logger = logging.getLogger(__name__)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # httpx2 builds a TLS context per client, loading the CA bundle each time (about
    # 50 ms of CPU); a command opens several clients, and an ingest benchmark saw it
    # as 5% of the run. One per process (honouring SSL_CERT_FILE) serves them all.
    return httpx2.create_ssl_context()


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """Authorization header for a service key; the key itself is never logged."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_client(
    *,
    transport: httpx2.BaseTransport | None = None,
    timeout: float,
    api_key: str | None = None,
) -> httpx2.Client:
    """An HTTP client for a service: the process's TLS context, ``api_key`` as Bearer."""
    return httpx2.Client(
        transport=transport,
        timeout=timeout,
        headers=bearer_headers(api_key),
        verify=_tls_context(),
    )


def async_http_client(
    *,
    transport: httpx2.AsyncBaseTransport | None = None,
    timeout: float,
    api_key: str | None = None,
    limits: httpx2.Limits,
) -> httpx2.AsyncClient:
    """The async twin of :func:`http_client`; ``limits`` bounds its connection pool."""
    return httpx2.AsyncClient(
        transport=transport,
        timeout=timeout,
        headers=bearer_headers(api_key),
        verify=_tls_context(),
        limits=limits,
    )


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long and how often a client retries transient failures.

    The defaults suit a TEI behind a queue: short first waits, capped backoff, and
    a total budget in seconds so a dead service fails fast instead of hanging.
    """

    budget: float = 30.0
    initial: float = 0.1
    maximum: float = 5.0
    jitter: float = 0.5
    # False: a timed-out attempt is raised at once, for a caller that paces its
    # requests (quarry._pacing) to send again at a lower depth.
    retry_timeouts: bool = True
    # What sets ``budget``, as the retry warning names it for whoever would change it.
    budget_source: str = "QUARRY_RETRY_BUDGET"
    # The most one ``/info`` attempt waits; None: INFO_TIMEOUT_S capped at the budget
    # (but at least a second). A probe that tries once and has its own deadline sets it.
    info_timeout_s: float | None = None
    # Told of each failed attempt, those about to be retried and the last (the query API
    # and the ingest note a service that was down even when a retry then reached it).
    on_retry: Callable[[BaseException | None], None] | None = field(
        default=None, compare=False, repr=False
    )

    def capped(self, budget: float, source: str) -> RetryPolicy:
        """This policy with its budget at most ``budget``, which ``source`` sets (named
        by the retry warning): itself when its own is no larger."""
        if self.budget <= budget:
            return self
        return replace(self, budget=budget, budget_source=source)

    def retrying(self) -> tenacity.Retrying:
        """A tenacity controller for one logical request."""

        def retried(error: BaseException) -> bool:
            if not isinstance(error, TransientFailure):
                return False
            return self.retry_timeouts or not error.timed_out

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(retried),
            # Before, not after: no wait (a long Retry-After) and no attempt that would
            # start past the budget, so a caller waits at most about the budget.
            stop=tenacity.stop_before_delay(self.budget),
            wait=_RetryAfterOrBackoff(self.initial, self.maximum, self.jitter),
            reraise=True,
            sleep=time.sleep,
            before_sleep=self.announce_retry,
        )

    def announce_retry(self, state: tenacity.RetryCallState) -> None:
        """Say once per request, on its first retry, that it is waiting and for how long:
        a service that is down would otherwise hold a command silent for the whole budget."""
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        if self.on_retry is not None:
            self.on_retry(error)
        if state.attempt_number != 1 or self.budget <= 0:
            return
        logger.warning(
            "%s; retrying for up to %gs (%s)",
            error if error is not None else "request failed",
            self.budget,
            self.budget_source,
        )


NO_WAIT = RetryPolicy(budget=5.0, initial=0.0, maximum=0.0, jitter=0.0)
"""A testing switch in the manner of stamina: retries still happen, waits do not."""


class TransientFailure(ServiceUnavailable):
    """Retried; re-raised as ServiceUnavailable once the budget is spent."""

    def __init__(
        self,
        url: str,
        message: str,
        *,
        status: int | None,
        retry_after: float | None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(url, message, status=status)
        self.retry_after = retry_after
        self.timed_out = timed_out  # no answer within the client's timeout

    @classmethod
    def timeout(cls, url: str, error: BaseException, *, late: bool = False) -> TransientFailure:
        """No answer in time (httpx2's timeout, or openai's wrapping one); ``late``: the
        service took too long to answer (see :func:`answer_late`)."""
        return cls(url, timeout_reason(error), status=None, retry_after=None, timed_out=late)

    @classmethod
    def transport(cls, url: str, error: BaseException) -> TransientFailure:
        """No connection, or one lost mid-exchange (httpx2's or openai's error)."""
        return cls(url, connection_failure(error), status=None, retry_after=None)


class _RetryAfterOrBackoff(tenacity.wait.wait_base):
    """Exponential backoff with jitter, but never shorter than the server's Retry-After."""

    def __init__(self, initial: float, maximum: float, jitter: float) -> None:
        self._backoff = tenacity.wait_exponential(multiplier=initial, max=maximum)
        self._jitter = jitter
        self._maximum = maximum

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        wait = float(self._backoff(retry_state)) if self._maximum > 0 else 0.0
        if self._jitter and wait:
            wait += random.uniform(0, self._jitter * wait)
        outcome = retry_state.outcome
        error = outcome.exception() if outcome is not None else None
        if isinstance(error, TransientFailure) and error.retry_after is not None:
            wait = max(wait, min(error.retry_after, 60.0))
        return wait


# TEI answers /info from its router, never from behind the inference queue: an attempt
# slower than this, or than the caller's whole retry budget, is a service in trouble,
# not one at work (the client's own timeout is sized for embedding a batch).
INFO_TIMEOUT_S = 5.0


def info_timeout(client_timeout: httpx2.Timeout, policy: RetryPolicy) -> httpx2.Timeout:
    """The timeout of one ``/info`` attempt: the client's, capped at the policy's
    ``info_timeout_s``, else at INFO_TIMEOUT_S and the retry budget (but at least a second)."""
    limit = policy.info_timeout_s
    if limit is None:
        limit = min(INFO_TIMEOUT_S, max(1.0, policy.budget))
    read = client_timeout.read
    return httpx2.Timeout(limit if read is None else min(read, limit))


_TIMEOUT_STAGES = {
    "ConnectTimeout": "connecting",
    "ReadTimeout": "waiting for the answer",
    "WriteTimeout": "sending the request",
    "PoolTimeout": "waiting for a free connection",
}


def timeout_reason(error: BaseException) -> str:
    """What a timeout (httpx2's, or openai's wrapping one) says, also when its text is empty."""
    if not isinstance(error, httpx2.TimeoutException) and error.__cause__ is not None:
        error = error.__cause__
    stage = _TIMEOUT_STAGES.get(type(error).__name__)
    said = str(error)
    return "timed out" + (f" {stage}" if stage else "") + (f": {said}" if said else "")


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):  # neither: as if there were none
        return None


_HTML_PAGE = re.compile(
    r"\ufeff?\s*(?:<\?xml[^>]*>\s*)?(?:<!--.*?-->\s*)*"
    r"<(?:!doctype\s+html|html|head|body|title|center|h1)\b",
    re.I | re.S,
)
_HTML_TITLE = re.compile(r"<title[^>]*>([^<]*)</title>", re.I)


def error_message(body: bytes | str) -> str:
    """The human part of an error body: TEI's ``error``, OpenAI's ``message``, or the text."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        parsed = json.loads(text)
    except ValueError:
        if _HTML_PAGE.match(text):
            # A proxy's or gateway's page (it may name internal hosts): its title only.
            title = _HTML_TITLE.search(text[:4096])
            named = f" ({' '.join(html.unescape(title[1]).split())[:100]!r})" if title else ""
            return f"an HTML page{named}, from a proxy or gateway in front of the service"
        return text.strip()[:500] or "(empty body)"
    if isinstance(parsed, dict):
        for key in ("error", "message", "detail"):
            value = parsed.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)[:500]
    return text.strip()[:500]


def raise_for_status(
    url: str,
    status: int,
    body: bytes | str,
    headers: httpx2.Headers | None = None,
    *,
    documents: Sequence[str] = (),
    dialect_hint: str | None = None,
) -> None:
    """Turn a non-2xx answer into the right quarry error; return quietly on 2xx."""
    if 200 <= status < 300:
        return
    message = error_message(body)
    if status in TRANSIENT_STATUS:
        retry_after = parse_retry_after(headers.get("retry-after") if headers else None)
        raise TransientFailure(
            url, f"HTTP {status}: {message}", status=status, retry_after=retry_after
        )
    if status in (413, 422) and "must have less than" in message:  # 413: TEI before 1.9
        raise InputTooLong(url, f"HTTP {status}: {message}", status=status, documents=documents)
    if dialect_hint and (status in (404, 405) or (status == 422 and "missing field" in message)):
        raise DialectMismatch(
            url, f"HTTP {status}: {message}. {dialect_hint}", status=status, documents=documents
        )
    if status in (401, 403):
        raise RequestRejected(
            url,
            f"HTTP {status}: {message} (check the API key setting for this service)",
            status=status,
        )
    raise RequestRejected(url, f"HTTP {status}: {message}", status=status, documents=documents)


def call_with_retries(
    policy: RetryPolicy, url: str, attempt: Callable[[], T], *, documents: Sequence[str] = ()
) -> T:
    """Run ``attempt`` under ``policy``; a spent budget raises ServiceUnavailable for the url."""
    retrying = policy.retrying()
    started = time.monotonic()
    try:
        return retrying(attempt)
    except TransientFailure as error:
        if error.timed_out and not policy.retry_timeouts:
            raise  # the caller sends it again, or says why not
        if policy.on_retry is not None:
            policy.on_retry(error)
        raise ServiceUnavailable(
            url,
            gave_up(policy, retrying.statistics, started, error),
            status=error.status,
            documents=documents,
        ) from error


def gave_up(
    policy: RetryPolicy, statistics: Mapping[str, Any], started: float, error: BaseException
) -> str:
    """What a request that ran out of retries says: the attempts and time it really took
    (a Retry-After past the budget stops at once), then its last failure."""
    tries = int(statistics.get("attempt_number", 1))
    spent = time.monotonic() - started
    return (
        f"still failing after {tries} attempt{'s' if tries != 1 else ''} in {spent:.1f}s "
        f"(retry budget {policy.budget:g}s): {getattr(error, 'reason', None) or error.args[0]}"
    )


def connection_failure(error: BaseException) -> str:
    """What a transport error (httpx2's, or openai's wrapping one) says happened."""
    cause = error if isinstance(error, httpx2.TransportError) else error.__cause__
    said = str(cause or error) or type(cause or error).__name__
    if isinstance(cause, httpx2.RemoteProtocolError | httpx2.ReadError):
        return f"connection lost before the answer was complete: {said}"
    if isinstance(cause, httpx2.WriteError):
        return f"connection lost while sending the request: {said}"
    return f"cannot connect: {said}"


def says_down(error: ServiceUnavailable) -> bool:
    """A failure that says the service is unreachable or down (not busy, not this input)."""
    return error.status in (None, 502, 503, 504)


def answer_late(error: BaseException | None) -> bool:
    """Whether a timeout is the service's answer coming late (a read timeout), not a
    request that never reached it (connect, write or pool timeouts): only the former
    says the service is slower than its load allows (see quarry._pacing)."""
    return isinstance(error, httpx2.ReadTimeout)


def send(
    client: httpx2.Client,
    method: str,
    url: str,
    *,
    json_body: Any = None,
    documents: Sequence[str] = (),
    dialect_hint: str | None = None,
) -> httpx2.Response:
    """One HTTP exchange, with transport errors and 5xx/429 classified as transient.

    A client closed under the request (a stopping run closes its clients) raises
    CancelledError: the service is fine, and nobody waits for the answer.
    """
    if client.is_closed:
        raise CancelledError(f"{url}: abandoned, the client is closed")
    try:
        response = client.request(method, url, json=json_body)
    except httpx2.TimeoutException as error:
        raise TransientFailure.timeout(url, error, late=answer_late(error)) from error
    except httpx2.TransportError as error:
        if client.is_closed:
            raise CancelledError(f"{url}: abandoned, the client is closed") from error
        raise TransientFailure.transport(url, error) from error
    raise_for_status(
        url,
        response.status_code,
        response.content,
        response.headers,
        documents=documents,
        dialect_hint=dialect_hint,
    )
    return response


def request_json(
    client: httpx2.Client,
    policy: RetryPolicy,
    method: str,
    url: str,
    *,
    json_body: Any = None,
    documents: Sequence[str] = (),
    dialect_hint: str | None = None,
) -> Any:
    """Send a request with retries and return its parsed JSON body."""

    def attempt() -> Any:
        response = send(
            client,
            method,
            url,
            json_body=json_body,
            documents=documents,
            dialect_hint=dialect_hint,
        )
        return json_answer(url, response)

    return call_with_retries(policy, url, attempt, documents=documents)


def json_answer(url: str, response: httpx2.Response, documents: Sequence[str] = ()) -> Any:
    """A response's JSON body; BadResponse naming ``url`` when it is not JSON."""
    try:
        return response.json()
    except ValueError as error:
        raise BadResponse(
            url, f"answer is not JSON: {response.text[:200]!r}", documents=documents
        ) from error


__all__ = [
    "NO_WAIT",
    "REJECTED_STATUS",
    "TRANSIENT_STATUS",
    "RetryPolicy",
    "ServiceError",
    "TransientFailure",
    "answer_late",
    "call_with_retries",
    "error_message",
    "gave_up",
    "json_answer",
    "raise_for_status",
    "request_json",
    "send",
]
