"""Built-in workloads: seeded token streams that exercise prefix sharing.

A workload yields the requests known up front and, for multi-turn, creates a
follow-up request whenever a turn finishes (its prompt contains the answer).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

VOCAB_SIZE = 32000


@dataclass(slots=True)
class SimRequest:
    """One request of a workload: arrival (in steps), prompt and output length."""

    request_id: str
    arrival_step: int
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class Workload:
    """Requests known up front, plus a hook for follow-ups (multi-turn)."""

    name: str
    requests: list[SimRequest]
    follow_up: Callable[[SimRequest, list[int], int], SimRequest | None] | None = None
    """(finished request, its output tokens, current step) -> next request or None."""
    max_total_tokens: int = 0
    """Tokens of all requests ever issued (prompt + output), to size an ample pool."""
    params: dict[str, int] = field(default_factory=dict)
    expected_requests: int = 0
    """Requests the run will see, follow-ups included (for the progress bar)."""

    def __post_init__(self) -> None:
        if not self.expected_requests:
            self.expected_requests = len(self.requests)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_SIZE) for _ in range(n)]


def identical_burst(
    *, seed: int = 0, num_requests: int = 8, prompt_len: int = 600, output_len: int = 16
) -> Workload:
    """N identical prompts, all arriving in step 0 (nano-vllm #219's scenario)."""
    prompt = _tokens(random.Random(seed), prompt_len)
    reqs = [SimRequest(f"burst-{i}", 0, list(prompt), output_len) for i in range(num_requests)]
    return Workload(
        "identical-burst",
        reqs,
        max_total_tokens=num_requests * (prompt_len + output_len),
        params={"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len},
    )


def shared_prefix(
    *,
    seed: int = 0,
    num_groups: int = 16,
    prompts_per_group: int = 32,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 64,
) -> Workload:
    """SGLang's generated-shared-prefix: per group a system prompt, then questions."""
    rng = random.Random(seed)
    reqs = []
    for g in range(num_groups):
        system = _tokens(rng, system_len)
        for p in range(prompts_per_group):
            prompt = system + _tokens(rng, question_len)
            reqs.append(SimRequest(f"group{g}-q{p}", 0, prompt, output_len))
    rng.shuffle(reqs)
    n = num_groups * prompts_per_group
    return Workload(
        "shared-prefix",
        reqs,
        max_total_tokens=n * (system_len + question_len + output_len),
        params={
            "num_groups": num_groups,
            "prompts_per_group": prompts_per_group,
            "system_len": system_len,
            "question_len": question_len,
            "output_len": output_len,
        },
    )


def multi_turn(
    *,
    seed: int = 0,
    num_conversations: int = 64,
    num_turns: int = 6,
    turn_len: int = 100,
    output_len: int = 100,
    output_spread: int = 0,
) -> Workload:
    """Chats: each turn's prompt is the previous prompt + its answer + a new message.

    A turn arrives in the step after the previous one finished. With
    `output_spread`, each answer's length is drawn from output_len ± spread
    (seeded per conversation and turn), so chats drift out of step as real
    ones do; without it every chat's turns arrive together, in the same order.
    """
    if not 0 <= output_spread < output_len:
        raise ValueError(f"output_spread must be in [0, {output_len}), got {output_spread}")
    rng = random.Random(seed)

    def answer_len(conv: str, turn: int) -> int:
        if not output_spread:
            return output_len
        spread = random.Random(f"{seed}:{conv}:{turn}:len")
        return output_len + spread.randint(-output_spread, output_spread)

    first = [
        SimRequest(f"conv{c}-turn0", 0, _tokens(rng, turn_len), answer_len(f"conv{c}", 0))
        for c in range(num_conversations)
    ]

    def follow_up(done: SimRequest, output: list[int], step: int) -> SimRequest | None:
        conv, turn = done.request_id.rsplit("-turn", 1)
        nxt = int(turn) + 1
        if nxt >= num_turns:
            return None
        # Each message is seeded by (seed, conversation, turn): reproducible in any order.
        msg_rng = random.Random(f"{seed}:{conv}:{nxt}")
        prompt = done.prompt_token_ids + output + _tokens(msg_rng, turn_len)
        return SimRequest(f"{conv}-turn{nxt}", step + 1, prompt, answer_len(conv, nxt))

    longest = output_len + output_spread
    total = (
        sum(t * (turn_len + longest) + turn_len + longest for t in range(num_turns))
        * num_conversations
    )
    return Workload(
        "multi-turn",
        first,
        follow_up,
        max_total_tokens=total,
        expected_requests=num_conversations * num_turns,
        params={
            "num_conversations": num_conversations,
            "num_turns": num_turns,
            "turn_len": turn_len,
            "output_len": output_len,
            "output_spread": output_spread,
        },
    )


def random_lengths(
    *, seed: int = 0, num_requests: int = 256, min_len: int = 100, max_len: int = 1024
) -> Workload:
    """Unrelated prompts; input and output lengths uniform in [min_len, max_len]."""
    rng = random.Random(seed)
    reqs = []
    total = 0
    for i in range(num_requests):
        n_in = rng.randint(min_len, max_len)
        n_out = rng.randint(min_len, max_len)
        reqs.append(SimRequest(f"random-{i}", 0, _tokens(rng, n_in), n_out))
        total += n_in + n_out
    return Workload(
        "random",
        reqs,
        max_total_tokens=total,
        params={"num_requests": num_requests, "min_len": min_len, "max_len": max_len},
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "identical-burst": identical_burst,
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "random": random_lengths,
}
