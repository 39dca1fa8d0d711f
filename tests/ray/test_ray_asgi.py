"""What the ingress forwards of a request: its path below Serve's route prefix, so the
replicas' app and the request router see `/v1/...` wherever the application is mounted
(test_ray_serve.py serves two applications at `/kvserve` and `/default`)."""

from __future__ import annotations

import json

import pytest

from kvserve.ray.asgi import app_path, forwarded_scope

pytest.importorskip("ray")


@pytest.mark.parametrize(
    ("path", "root_path", "expected"),
    [
        ("/v1/chat/completions", "", "/v1/chat/completions"),  # route_prefix: /
        ("/llm/v1/chat/completions", "/llm", "/v1/chat/completions"),
        ("/llm", "/llm", "/"),
        ("/llm/metrics", "/llm/", "/metrics"),
        ("/llmx/v1/models", "/llm", "/llmx/v1/models"),  # not below the prefix: as it is
    ],
)
def test_the_path_below_the_route_prefix(path, root_path, expected):
    assert app_path({"path": path, "root_path": root_path}) == expected


def test_the_forwarded_scope_is_the_request_at_the_apps_root():
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/llm/v1/completions",
        "raw_path": b"/llm/v1/completions",
        "root_path": "/llm",
        "query_string": b"a=1",
        "headers": [(b"content-type", b"application/json")],
        "client": ["127.0.0.1", 5000],
        "app": object(),  # what does not travel
    }
    out = forwarded_scope(scope)
    assert out["path"] == "/v1/completions" and out["raw_path"] == b"/v1/completions"
    assert out["root_path"] == "" and "app" not in out
    assert out["query_string"] == b"a=1" and out["client"] == ("127.0.0.1", 5000)


def test_the_request_router_reads_a_deep_body_as_unknown():
    """A body nested 100,000 deep gets no prediction (the replica answers its 400): read
    depth-bounded, it neither recurses nor fails the routing."""
    from kvserve.ray.router import _forwarded

    scope = {"path": "/v1/completions", "method": "POST"}
    assert _forwarded([scope, b"[" * 100_000 + b"]" * 100_000]) is None
    assert _forwarded([scope, b'{"prompt": "hi"}']) == ("completions", {"prompt": "hi"})


def test_the_request_router_does_not_tokenize_what_the_replicas_refuse():
    """With the replicas' limits, a prompt longer than any that fits is not read for a
    prediction (Serve's choice sends it; the replica answers its 400 unread)."""
    from kvserve.ray.router import _forwarded
    from kvserve.request_limits import PromptLimits

    limits = PromptLimits(max_model_len=100, chars_per_token=32, max_n=4)
    scope = {"path": "/v1/completions", "method": "POST"}
    fits = b'{"prompt": "' + b"x" * 3200 + b'"}'
    assert _forwarded([scope, fits], limits) is not None
    assert _forwarded([scope, fits.replace(b'"}', b'x"}')], limits) is None
    assert _forwarded([scope, b'{"prompt": "hi", "n": 5}'], limits) is None
    chat = {"path": "/v1/chat/completions", "method": "POST"}
    long_chat = b'{"messages": [{"role": "user", "content": "' + b"y" * 3201 + b'"}]}'
    assert _forwarded([chat, long_chat], limits) is None
    many = json.dumps({"prompt": ["hi"] * 257}).encode()  # MAX_BATCH_PROMPTS + 1
    assert _forwarded([scope, many], limits) is None
    deep = b'{"prompt": "hi", "user": ' + b'{"a": ' * 40 + b"1" + b"}" * 41
    assert _forwarded([scope, deep], limits) is None
