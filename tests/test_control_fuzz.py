"""The control API against its own OpenAPI document (GET /openapi.json), fuzzed with schemathesis:
whatever it is sent, no 5xx it does not document and every answer in the documented shape."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from lgt.testing.proxy import ProxyProc

schemathesis = pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, upstream) -> Iterator[ProxyProc]:
    p = ProxyProc(tmp_path_factory.mktemp("fuzz") / "store", upstream.url).start()
    yield p
    p.stop()


def test_the_control_api_keeps_its_word(fuzzed: ProxyProc) -> None:
    """Every operation of the document, fuzzed (bounded examples each), through schemathesis' own
    strategies and checks (its pytest plugin does not load under this pytest)."""
    from hypothesis import given

    schema = schemathesis.openapi.from_url(f"{fuzzed.control_url}/openapi.json")
    headers = {"Authorization": f"Bearer {fuzzed.client.token}"}
    ran: set[str] = set()
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("timeout"), (int, float)):
                case.body["timeout"] = min(case.body["timeout"], 2)  # a pause waits its timeout out
            case.call_and_validate(headers=headers)

        check()
        ran.add(operation.label)
    assert {"POST /pause", "POST /resume", "GET /state", "POST /flush", "POST /rewards", "GET /rewards",
            "POST /resources", "GET /metrics", "POST /policies"} <= ran  # every operation of the control API
    fuzzed.client.resume()


def test_the_document_is_served_without_a_token(fuzzed: ProxyProc) -> None:
    import httpx

    doc = httpx.get(f"{fuzzed.control_url}/openapi.json", trust_env=False).json()
    assert doc["openapi"].startswith("3.1")
    assert {"/pause", "/resume", "/rewards", "/resources"} <= set(doc["paths"])
