"""The ingress's prefill/decode split: a request's prompt first runs on a prefill replica.

What `kvserve route --prefill --decode` does (router/disaggregated.py, whose decisions it
shares), with replicas found through Ray: the decode deployment's request router predicts
the prompt's tokens and the best decode replica's hit (`best_hit`, registered in book.py);
a prompt with at least `prefill_min_tokens` of them uncached there is sent, as its
one-token non-streamed copy, through the prefill deployment's handle, whose request router
chooses the prefill replica with the best predicted hit. That replica answers with where it
serves the prompt's blocks (replica.py `prefill`), and the ingress hands the endpoint to
the decode replica with the request itself, which pulls what its cache lacks. A restarted
prefill replica (another port) is thus found by its first answer; nothing is written down.

Whatever goes wrong with the prefill (no prediction, a replica gone, a 4xx, no answer within
`prefill_timeout`: the call is then cancelled, which aborts it on the replica) only costs the
decode replica the prompt's computation: the answer is the same. The ingress's /metrics
counts each such prefill by reason (`kvserve:router_prefill_fallbacks_total`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ray.serve.handle import DeploymentHandle, DeploymentResponse

from kvserve.ray.book import BOOK
from kvserve.request_limits import LimitError, decode_body
from kvserve.router.disaggregated import prefill_body, worth_prefilling

log = logging.getLogger("kvserve.ray")
UNASSIGNED = "none"
"""The replica label of a prefill that fell back before Serve assigned it to a replica."""


class PrefillFirst:
    def __init__(
        self, prefill: DeploymentHandle, decode: str, min_tokens: int, timeout: float = 30.0
    ) -> None:
        self.prefill = prefill.options(stream=False)  # its router follows the replicas now
        self.decode = decode
        """The decode deployment's name (its request router's `best_hit` in the book)."""
        self.min_tokens = min_tokens
        self.timeout = timeout

    async def run(self, scope: dict[str, Any], body: bytes) -> str | None:
        """The producer that ran this request's prompt (tcp://...), or None: none did."""
        predictor = BOOK.predictors.get(self.decode)
        predicted = await predictor([scope, body]) if predictor is not None else None
        if predicted is None or not worth_prefilling(*predicted, self.min_tokens):
            return None
        try:
            parsed = decode_body(body)
        except LimitError:
            return None
        if not isinstance(parsed, dict):
            return None
        copy = json.dumps(prefill_body(parsed)).encode()
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(copy)).encode()))
        response = self.prefill.prefill.remote({**scope, "headers": headers}, copy)
        assert isinstance(response, DeploymentResponse)
        try:
            answer = await asyncio.wait_for(_answer(response), self.timeout)
        except TimeoutError:
            response.cancel()  # the prefill replica aborts it
            self._fell_back(response, "timeout")
            log.warning("prefill took over %gs: the decode replica computes the prompt",
                        self.timeout)  # fmt: skip
            return None
        except Exception as exc:  # a replica gone, or none: the decode replica computes it
            self._fell_back(response, "failed")
            log.warning("prefill failed (%s): the decode replica computes the prompt", exc)
            return None
        sent = BOOK.answered(response.request_id, answer["status"], answer["cached_tokens"])
        if answer["status"] != 200:
            if sent is not None:
                BOOK.prefill_fallbacks.labels(sent.replica, "status").inc()
            log.info("prefill answered %d: the decode replica computes the prompt",
                     answer["status"])  # fmt: skip
            return None
        producer = answer.get("producer")
        return producer if isinstance(producer, str) else None

    @staticmethod
    def _fell_back(response: DeploymentResponse, reason: str) -> None:
        sent = BOOK.answered(response.request_id, 0, None)
        # `none`: Serve had not handed the call to a replica (none up, or none answering
        # its queue-length probe, as a stopped process does not).
        BOOK.prefill_fallbacks.labels(sent.replica if sent else UNASSIGNED, reason).inc()


async def _answer(response: DeploymentResponse) -> Any:
    """The prefill replica's answer (a coroutine, for asyncio.wait_for)."""
    return await response
