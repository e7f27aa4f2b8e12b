"""Schema-driven fuzzing of one route of a running server, in a process of its own.

Generating requests from the OpenAPI document costs more than serving them, and it is
single-threaded Python: :func:`fuzz_route` runs one route's generation and requests, so
that routes can be fuzzed side by side in worker processes (one per core)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FuzzResult:
    seen: dict[int, int] = field(default_factory=dict)
    """Responses by status code."""
    failure: str | None = None
    """The first request that got a 5xx (status, body, curl command), or the error."""


def fuzz_route(url: str, auth: dict[str, str], method: str, path: str,
               examples: int) -> FuzzResult:  # fmt: skip
    """``examples`` requests generated for ``method path`` from the server's own
    ``/openapi.json`` (valid ones and ones that break the schema), with a fixed seed."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    result = FuzzResult()
    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=auth)
    op = schema[path][method]
    strategy = (op.as_strategy(GenerationMode.POSITIVE)
                | op.as_strategy(GenerationMode.NEGATIVE))
    session = requests.Session()

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(strategy)
    def run(case):
        response = case.call(base_url=url, session=session, headers=auth, timeout=30)
        result.seen[response.status_code] = result.seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (response.status_code, response.text[:300],
                                            case.as_curl_command())

    try:
        run()
    except BaseException as exc:  # noqa: BLE001 (reported by the test, whatever it is)
        result.failure = f"{type(exc).__name__}: {exc}"
    return result
