"""docs/serving.md's table of endpoints and fields (issue 30, item 7) is the server's own:
every route it serves is a row, and each row's served, ignored and refused fields are the
lists the handlers check bodies against."""

from __future__ import annotations

import re
from pathlib import Path

from kvserve.serve.app import create_app
from kvserve.serve.http.tokenizer_worker import TokenizerWorker
from kvserve.serve.messages_api import request as messages
from kvserve.serve.openai import adapters, embeddings
from kvserve.serve.request import fields, protocol
from kvserve.serve.responses_api import request as responses
from kvserve.serve.state import ServerState

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
NONE: frozenset[str] = frozenset()
EXPECTED = {
    "POST /v1/completions": (
        protocol.COMPLETION_FIELDS,
        NONE,
        set(fields.UNSUPPORTED[False]),
        "ignored, named",
    ),
    "POST /v1/chat/completions": (
        protocol.CHAT_FIELDS,
        NONE,
        set(fields.UNSUPPORTED[True]),
        "ignored, named",
    ),
    "POST /v1/responses": (responses.SERVED, responses.IGNORED, set(responses.REFUSED), "400"),
    "POST /v1/messages": (messages.SERVED, messages.IGNORED, set(messages.REFUSED), "400"),
    "POST /v1/messages/count_tokens": (
        messages.COUNT_SERVED,
        messages.IGNORED,
        set(messages.REFUSED),
        "400",
    ),
    "POST /v1/embeddings": (embeddings.SERVED, NONE, set(embeddings.REFUSED), "ignored, named"),
    "POST /tokenize": (protocol.TOKENIZE_FIELDS, NONE, NONE, "400"),
    "POST /detokenize": (protocol.DETOKENIZE_FIELDS, NONE, NONE, "400"),
    "POST /v1/load_lora_adapter": (adapters.LOAD_FIELDS, NONE, NONE, "400"),
    "POST /v1/unload_lora_adapter": (adapters.UNLOAD_FIELDS, NONE, NONE, "400"),
}


def table() -> dict[str, list[str]]:
    """Endpoint -> its row's other cells, from the page's `## Endpoints and fields`."""
    text = PAGE.read_text().split("## Endpoints and fields", 1)[1]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1:]
        elif rows and not line.startswith("|"):
            break
    return rows


def names(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_every_route_is_a_row():
    state = ServerState(
        engine=None,
        served_name="x",
        description="x",
        tokenizer=TokenizerWorker(None, None),
    )
    routes = {
        f"{method} {route.path}"
        for route in create_app(state).routes
        for method in getattr(route, "methods", ())
        if method != "HEAD"
    }
    assert routes == set(table())


def test_each_rows_fields_are_the_handlers_lists():
    rows = table()
    for endpoint, (served, ignored, refused, other) in EXPECTED.items():
        cells = rows[endpoint]
        assert names(cells[0]) == set(served), endpoint
        assert names(cells[1]) == set(ignored), endpoint
        assert names(cells[2]) == set(refused), endpoint
        assert cells[3] == other, endpoint
    for endpoint in set(rows) - set(EXPECTED):  # the rest take no body fields
        assert rows[endpoint] == ["—"] * 4, endpoint
