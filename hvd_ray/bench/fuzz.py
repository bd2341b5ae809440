"""Schemathesis over the server's own ``/openapi.json``: valid (positive) and invalid (negative)
requests for the OpenAI routes, each checked for what a client relies on: no 5xx, and every 4xx
with the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from collections import Counter

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models")


def check_error_body(resp) -> None:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body


def _checked(op, mode: str, n: int, base_url: str, headers: dict, seed, outcomes: Counter):
    """A hypothesis test of ``n`` ``mode`` examples of one operation."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    @settings(max_examples=n, deadline=None, database=None, derandomize=seed is not None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case):
        resp = case.call(base_url=base_url, headers=headers, timeout=300)
        outcomes[(op.path, mode, resp.status_code)] += 1
        assert resp.status_code < 500, (case.body, resp.text)
        if resp.status_code >= 400:
            check_error_body(resp)

    return run


def fuzz(base_url: str, api_key: str | None = None, examples: dict[str, int] | None = None,
         seed: int | None = 0) -> Counter:
    """Run the fuzz; returns ``{(route, mode, status): count}``. Raises AssertionError (hypothesis'
    falsifying example included) on the first 5xx or malformed 4xx."""
    import schemathesis

    examples = examples or {"positive": 20, "negative": 25}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    outcomes: Counter = Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path not in ROUTES:
            continue
        for mode, n in examples.items():
            _checked(op, mode, n if op.method.upper() == "POST" else 3, base_url, headers, seed, outcomes)()
    return outcomes
