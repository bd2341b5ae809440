"""Schemathesis over the server's own ``/openapi.json``: valid (positive) and invalid (negative)
requests for the OpenAI routes, each checked for what a client relies on: no 5xx, and every 4xx
with the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``.

A third mode, ``nasty``, takes valid bodies and overwrites one field with what the schema-driven
strategies never produce: text with lone UTF-16 surrogates (JSON ``"\\ud800"``) and other unusual
code points, huge or non-ASCII stop strings, arrays of out-of-range token ids."""

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

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=seed is not None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case):
        resp = case.call(base_url=base_url, headers=headers, timeout=300)
        outcomes[(op.path, mode, resp.status_code)] += 1
        assert resp.status_code < 500, (case.body, resp.text)
        if resp.status_code >= 400:
            check_error_body(resp)

    return run


def _nasty_patches(path: str):
    """One field of a valid body replaced by unusual text or token ids (a hypothesis strategy)."""
    from hypothesis import strategies as st

    char = st.one_of(
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),  # lone surrogates
        st.characters(min_codepoint=0x80, max_codepoint=0x10FFFF),  # any non-ASCII code point
        st.characters(),
    )
    text = st.text(char, min_size=1, max_size=24)
    stops = st.one_of(text, st.lists(st.one_of(text, st.text(char, min_size=200, max_size=300)), max_size=5))
    ids = st.lists(st.integers(min_value=-(2**40), max_value=2**40), min_size=1, max_size=40)
    common = [
        st.fixed_dictionaries({"stop": stops}),
        st.fixed_dictionaries({"model": text}),
        st.fixed_dictionaries({"user": text}),
        st.fixed_dictionaries({"stop_token_ids": ids}),
    ]
    if path == "/v1/chat/completions":
        message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text})
        mine = [st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3)})]
    else:
        mine = [st.fixed_dictionaries({"prompt": st.one_of(text, ids, st.lists(ids, min_size=1, max_size=2))})]
    return st.one_of(*mine, *common)


def _nasty(op, n: int, base_url: str, headers: dict, seed, outcomes: Counter):
    """Valid bodies with one nasty field, sent as ASCII JSON (surrogates as ``\\ud800`` escapes)."""
    import json

    import httpx
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=seed is not None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE), patch=_nasty_patches(op.path))
    def run(case, patch):
        body = {**(case.body if isinstance(case.body, dict) else {}), **patch, "max_tokens": 2, "stream": False}
        body.pop("stream_options", None)
        resp = httpx.post(
            f"{base_url}{op.path}",
            content=json.dumps(body).encode(),
            timeout=300,
            headers={**headers, "Content-Type": "application/json"},
        )
        outcomes[(op.path, "nasty", resp.status_code)] += 1
        assert resp.status_code < 500, (body, resp.text)
        if resp.status_code >= 400:
            check_error_body(resp)

    return run


def fuzz(
    base_url: str, api_key: str | None = None, examples: dict[str, int] | None = None, seed: int | None = 0
) -> Counter:
    """Run the fuzz; returns ``{(route, mode, status): count}``. Raises AssertionError (hypothesis'
    falsifying example included) on the first 5xx or malformed 4xx. ``examples``: per mode
    (positive, negative, nasty), the examples for each POST route."""
    import httpx
    import schemathesis

    examples = examples or {"positive": 20, "negative": 25, "nasty": 25}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    doc = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=60)
    doc.raise_for_status()
    schema = schemathesis.openapi.from_dict(doc.json())
    outcomes: Counter = Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path not in ROUTES:
            continue
        post = op.method.upper() == "POST"
        for mode, n in examples.items():
            if mode == "nasty":
                if post:
                    _nasty(op, n, base_url, headers, seed, outcomes)()
                continue
            _checked(op, mode, n if post else 3, base_url, headers, seed, outcomes)()
    return outcomes
