"""Schema-driven fuzzing of one route of a running server, in a process of its own.

Generating requests from the OpenAPI document costs more than serving them, and it is
single-threaded Python: :func:`fuzz_route` runs one route's generation and requests, so
that routes can be fuzzed side by side in worker processes (one per core)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class FuzzResult:
    seen: dict[int, int] = field(default_factory=dict)
    """Responses by status code (of the requests that passed)."""
    failure: str | None = None
    """The first request that failed a check (why, the status, body and curl command), or
    the error (a client timeout: the route hung)."""


def stream_error(body: str) -> int | None:
    """The code of an ``error`` event of a server-sent event stream that is a 408 (the
    request hung until the server's deadline) or a 5xx; None if there is none."""
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line[6:])
        except ValueError:
            continue
        error = event.get("error") if isinstance(event, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        if isinstance(code, int) and (code == 408 or code >= 500):
            return code
    return None


def checked_call(case, url: str, auth: dict[str, str], timeout: float, session=None):
    """Send ``case`` and check its answer: neither a 5xx nor a 408, within ``timeout``
    seconds, matching the document (status, content type, body schema), no 408 or 5xx
    error event in a stream, and a 4xx for a request that breaks the schema. The response;
    an ``AssertionError`` naming the failure, the status, body and curl command."""
    import requests
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance, negative_data_rejection]
    try:
        response = case.call(base_url=url, session=session, headers=auth, timeout=timeout)
    except requests.Timeout:
        raise AssertionError(f"no answer within {timeout} s: the route hangs",
                             case.as_curl_command()) from None
    status = response.status_code
    where = (status, response.text[:300], case.as_curl_command())
    assert status != 408, ("408: the request hung until the server's deadline", *where)
    if response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        code = stream_error(response.text)
        assert code is None, (f"a {code} error event in the stream", *where)
    try:
        case.validate_response(response, checks=checks, headers=auth)
    except BaseException as exc:
        raise AssertionError(f"{type(exc).__name__}: {exc}", *where) from None
    return response


def fuzz_route(url: str, auth: dict[str, str], method: str, path: str, positive: int,
               negative: int, timeout: float) -> FuzzResult:  # fmt: skip
    """``positive`` requests generated for ``method path`` from the server's own
    ``/openapi.json`` and ``negative`` ones that break it, with a fixed seed, each checked
    by :func:`checked_call`."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    result = FuzzResult()
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=auth, timeout=timeout)
    op = schema[path][method]
    session = requests.Session()

    def check(case) -> None:
        status = checked_call(case, url, auth, timeout, session).status_code
        result.seen[status] = result.seen.get(status, 0) + 1

    def run(mode: GenerationMode, examples: int) -> None:
        @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), phases=["generate"])
        @given(op.as_strategy(mode))
        def each(case):
            check(case)

        each()

    try:
        run(GenerationMode.POSITIVE, positive)
        try:
            run(GenerationMode.NEGATIVE, negative)
        except Unsatisfiable:
            pass  # a route that takes no input: no request breaks its schema
    except BaseException as exc:  # noqa: BLE001 (reported by the test, whatever it is)
        inner = getattr(exc, "exceptions", ())  # hypothesis's groups: what failed inside
        result.failure = "\n".join(f"{type(e).__name__}: {e}" for e in (exc, *inner))
    return result
