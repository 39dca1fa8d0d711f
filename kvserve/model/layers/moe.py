"""The sparse feed-forward block of mixture-of-experts decoders: a router and its experts.

The router is transformers' arithmetic step for step (softmax in float32 over
the router logits, `torch.topk`, optionally the top-k renormalised), so its
choices, ties included (topk's order), are the reference's. The experts run
grouped: the step's token-to-expert assignments are sorted by expert (a
stable sort, so tokens keep their order), and each expert that got tokens
runs once on all of them; an expert without tokens costs nothing, and there
is no loop over tokens. Each token's outputs are added expert by expert in
ascending order, as transformers adds them, so float32 sums are the
reference's.

Each expert is a module of its own (a gated MLP whose gate and up projections
the loader fuses), so the quantization modes pack expert weights exactly as
they pack a dense MLP's (kvserve.model.quant). The router's weight is a plain
parameter, not a linear layer: it stays in the engine's dtype (a quantized
router would change which experts run).

Written by hand: torch has no grouped expert dispatch on the CPU, and the
libraries that have one (vLLM's fused MoE, megablocks) run on GPUs only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from kvserve.model.checkpoint.moe_config import MoeConfig


class TopKRouter(nn.Module):
    """Router logits -> (the top-k weights [T, k], their expert ids [T, k])."""

    def __init__(self, hidden: int, moe: MoeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_float = moe.weights_in_float

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x, self.weight)
        probs = nn.functional.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_float:
            weights = weights.to(logits.dtype)
        return weights, experts


class MixtralExpert(nn.Module):
    """Mixtral's expert: w2(silu(w1(x)) * w3(x)), under its checkpoint's names."""

    FUSED_PROJECTIONS: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("w1", "w3")}
    gate_up_proj: nn.Module  # set by the fusion

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.w2(nn.functional.silu(gate) * up)


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's sigmoid gate of the shared expert: one row, kept in the engine's dtype
    like the router (not a linear layer, so no quantization mode packs it)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(nn.functional.linear(x, self.weight))


class SparseMoeBlock(nn.Module):
    """`gate` (the router) and `experts`, and where the family has one the
    `shared_expert` every token runs (`shared_expert_gate` scales it), under the
    checkpoints' names."""

    def __init__(
        self, hidden: int, moe: MoeConfig, expert: Callable[[int, int], nn.Module]
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden, moe)
        self.experts = nn.ModuleList(
            expert(hidden, moe.expert_intermediate_size) for _ in range(moe.num_experts)
        )
        self.on_expert_rows: Callable[[torch.Tensor], None] | None = None
        """Told, before each expert runs, which of the step's rows it sees (LoRA adapters
        on experts: kvserve.lora.targets)."""
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = expert(hidden, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = SharedExpertGate(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = run_experts(self.experts, x, weights, experts, self.on_expert_rows)
        if self.shared_expert is None or self.shared_expert_gate is None:
            return out
        return out + self.shared_expert_gate(x) * self.shared_expert(x)


def run_experts(
    experts: nn.ModuleList,
    x: torch.Tensor,
    weights: torch.Tensor,
    chosen: torch.Tensor,
    on_rows: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * experts[chosen[t, j]](x[t]) for every token t, grouped by expert.

    Each token's choices are put in ascending expert order first, and its weighted
    outputs are added in that order (transformers adds them expert by expert, from
    zero): the same float sums. The outputs come back to (token, choice) order with one
    indexed copy, and k additions combine them: no scatter-add, which costs more on the
    CPU than a small expert's matmuls.
    """
    tokens, top_k = chosen.shape
    chosen, slots = chosen.sort(dim=-1)
    weights = weights.gather(-1, slots)
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order
    counts = torch.bincount(flat, minlength=len(experts)).tolist()  # the step's one sync
    rows = order // top_k
    inputs = x[rows]
    outputs = []
    start = 0
    for expert_id, count in enumerate(counts):
        if count:
            if on_rows is not None:
                on_rows(rows[start : start + count])
            outputs.append(experts[expert_id](inputs[start : start + count]))
            start += count
    if not outputs:  # no tokens at all
        return torch.zeros_like(x)
    by_choice = torch.empty((tokens * top_k, x.shape[-1]), dtype=outputs[0].dtype, device=x.device)
    by_choice[order] = torch.cat(outputs)
    weighted = (by_choice.view(tokens, top_k, -1) * weights[..., None]).to(x.dtype)
    out = weighted[:, 0]
    for choice in range(1, top_k):
        out = out + weighted[:, choice]
    return out
