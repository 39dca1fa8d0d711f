"""The Mamba2 mixer (state-space duality, "SSD") over paged per-request state.

A Mamba2 layer keeps no per-token cache: a request's whole past is two small
tensors, the last `d_conv - 1` inputs of its causal convolution and the SSM
state. They live in pages of two per-layer pools that the runner provides:

- conv_states [num_pages, conv_dim, d_conv - 1]: the conv's inputs (x, B and C
  after in_proj, before the conv and its activation) of the request's last
  d_conv - 1 tokens, oldest first; zeros stand for tokens before the first.
- ssm_states [num_pages, num_heads, head_dim, d_state]: h in
  h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T and y_t = h_t C_t + D x_t.

Page 0 is the null page: never written, and as `state_in` it means "start from
zero" (it is not read at all, so it may hold anything). A StateSegment says
where one request's tokens of the step are, which page to resume from, where
to store the result and where to snapshot intermediate states (prefix caching
resumes from those). Every page is read before any is written, so a segment
may update its page in place (state_out == state_in).

The arithmetic follows transformers' torch path (BambaMixer): a chunked scan
for runs of several tokens, the recurrent update for single tokens, in float32.
One deliberate difference: dt is clamped to `time_step_limit` on both paths
(transformers skips the clamp in its one-token update), so that the result never
depends on how a prompt was chunked; with the default (0, inf) they agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.checkpoint.config import MambaConfig, ModelConfig


@dataclass(slots=True)
class StateSegment:
    """One request's share of a step."""

    start: int
    """Its first row in the flattened batch."""
    num: int
    """Its rows: start .. start + num - 1."""
    state_in: int
    """Page holding the state after the request's previously computed tokens (0: zero state)."""
    state_out: int
    """Page that receives the state after the segment's last token (may equal state_in)."""
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    """(k, page): store the state after the segment's first k tokens (1 <= k <= num) in page."""


@dataclass(slots=True)
class StateMetadata:
    """The segments of one step, shared by all Mamba2 layers of the model."""

    segments: list[StateSegment]


def state_shapes(config: ModelConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per-layer, per-page shapes: conv (conv_dim, d_conv - 1), ssm (heads, head_dim, d_state)."""
    m = _mamba(config)
    return (m.conv_dim, m.conv_kernel - 1), (m.num_heads, m.head_dim, m.state_size)


def _mamba(config: ModelConfig) -> MambaConfig:
    if config.mamba is None:
        raise ValueError(f"{config.architecture} has no Mamba2 layers")
    return config.mamba


class GatedRMSNorm(nn.Module):
    """RMS norm of y * silu(gate) over groups of channels (one group per B/C group)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """float32 throughout (as transformers' chunked path); the caller casts back."""
        h = y.float() * F.silu(gate.float())
        grouped = h.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2)


class Mamba2Mixer(nn.Module):
    """in_proj -> causal conv + silu -> selective scan -> gated norm -> out_proj.

    Parameter names are those of transformers' BambaMixer, so checkpoints load by name.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        m = _mamba(config)
        self.num_heads = m.num_heads
        self.head_dim = m.head_dim
        self.num_groups = m.num_groups
        self.state_size = m.state_size
        self.kernel = m.conv_kernel
        self.intermediate = m.intermediate_size
        self.conv_dim = m.conv_dim
        self.chunk_size = m.chunk_size
        self.dt_limit = m.time_step_limit
        hidden = config.hidden_size
        self.in_proj = nn.Linear(
            hidden, self.intermediate + self.conv_dim + self.num_heads, bias=m.proj_bias
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, m.conv_kernel, groups=self.conv_dim, bias=m.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(
            self.intermediate, self.intermediate // self.num_groups, config.rms_norm_eps
        )
        self.out_proj = nn.Linear(self.intermediate, hidden, bias=m.proj_bias)

    def forward(
        self,
        x: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: StateMetadata,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; reads and writes the segments' state pages."""
        conv_states, ssm_states = cache
        segments = meta.segments
        _check_segments(segments, x.shape[0])
        gate, xbc, dt = self.in_proj(x).split(
            [self.intermediate, self.conv_dim, self.num_heads], dim=-1
        )
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        # All reads before any write: a page may be both read and written in this step.
        pages_in = torch.tensor([s.state_in for s in segments], device=x.device)
        is_null = (pages_in == 0)[:, None, None]
        conv_in = torch.where(is_null, 0.0, conv_states[pages_in].to(xbc.dtype))
        ssm_in = torch.where(is_null[..., None], 0.0, ssm_states[pages_in].float())
        y = torch.empty(
            x.shape[0], self.num_heads, self.head_dim, dtype=torch.float32, device=x.device
        )
        writes: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        singles = [i for i, s in enumerate(segments) if s.num == 1]
        if singles:
            self._single_tokens(segments, singles, xbc, dt, conv_in, ssm_in, y, writes)
        for i, seg in enumerate(segments):
            if seg.num > 1:
                self._run(seg, xbc, dt, conv_in[i], ssm_in[i], y, writes)
        _store(conv_states, ssm_states, writes)
        out = self.norm(y.flatten(1), gate)
        return self.out_proj(out.to(x.dtype))

    def _single_tokens(
        self,
        segments: list[StateSegment],
        which: list[int],
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_in: torch.Tensor,
        ssm_in: torch.Tensor,
        y: torch.Tensor,
        writes: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> None:
        """All one-token segments (decodes) of the step at once, by the recurrent update."""
        rows = torch.tensor([segments[i].start for i in which], device=xbc.device)
        idx = torch.tensor(which, device=xbc.device)
        window = torch.cat((conv_in[idx], xbc[rows, :, None]), dim=-1)  # [S, conv_dim, K]
        xs, b, c = self._split(self._conv(window)[..., 0])
        out, states = ssd_step(xs, dt[rows], self._A(), b, c, ssm_in[idx])
        y[rows] = out + self.D.float()[:, None] * xs
        for j, i in enumerate(which):
            seg = segments[i]
            for page in [p for _, p in seg.snapshots] + [seg.state_out]:
                writes.append((page, window[j, :, 1:], states[j]))

    def _run(
        self,
        seg: StateSegment,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_in: torch.Tensor,
        state: torch.Tensor,
        y: torch.Tensor,
        writes: list[tuple[int, torch.Tensor, torch.Tensor]],
    ) -> None:
        """One multi-token segment, its scan split at the snapshot offsets."""
        rows = slice(seg.start, seg.start + seg.num)
        window = torch.cat((conv_in, xbc[rows].T), dim=-1)  # [conv_dim, K - 1 + num]
        xs, b, c = self._split(self._conv(window[None])[0].T)
        seg_dt = dt[rows]
        A = self._A()
        out = torch.empty_like(xs)
        done = 0
        for cut in sorted({k for k, _ in seg.snapshots} | {seg.num}):
            part = slice(done, cut)
            if cut - done == 1:
                out[part], state = ssd_step(
                    xs[part], seg_dt[part], A, b[part], c[part], state[None]
                )
                state = state[0]
            else:
                out[part], state = ssd_scan(
                    xs[part], seg_dt[part], A, b[part], c[part], state, self.chunk_size
                )
            conv_after = window[:, cut : cut + self.kernel - 1]
            for page in [p for k, p in seg.snapshots if k == cut]:
                writes.append((page, conv_after, state))
            done = cut
        writes.append((seg.state_out, window[:, seg.num : seg.num + self.kernel - 1], state))
        y[rows] = out + self.D.float()[:, None] * xs

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + silu over [S, conv_dim, K - 1 + n] -> [S, conv_dim, n]."""
        weight = self.conv1d.weight
        out = F.conv1d(window.to(weight.dtype), weight, self.conv1d.bias, groups=self.conv_dim)
        return F.silu(out).to(window.dtype)

    def _split(self, act: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., conv_dim] -> x [..., heads, head_dim], B and C [..., groups, d_state], float32."""
        n = self.num_groups * self.state_size
        xs, b, c = act.float().split([self.intermediate, n, n], dim=-1)
        return (
            xs.unflatten(-1, (self.num_heads, self.head_dim)),
            b.unflatten(-1, (self.num_groups, self.state_size)),
            c.unflatten(-1, (self.num_groups, self.state_size)),
        )

    def _A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [S, H, P], dt [S, H], B/C [S, G, N], state [S, H, P, N].

    Returns (h C without the D skip [S, H, P], the new state).
    """
    heads = x.shape[1]
    B = B.repeat_interleave(heads // B.shape[1], dim=1)  # head h reads group h // (H / G)
    C = C.repeat_interleave(heads // C.shape[1], dim=1)
    decay = torch.exp(dt * A)[..., None, None]
    state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return torch.einsum("shpn,shn->shp", state, C), state


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """L tokens of one sequence: x [L, H, P], dt [L, H], B/C [L, G, N], state [H, P, N].

    Within a chunk the outputs are an attention-like masked product (C B^T weighted by
    the decay between positions); across chunks only the state is carried. Returns
    (outputs without the D skip [L, H, P], the state after the last token).
    """
    length, heads, _ = x.shape
    B = B.repeat_interleave(heads // B.shape[1], dim=1)
    C = C.repeat_interleave(heads // C.shape[1], dim=1)
    pad = -length % chunk
    # Padded tokens have dt = 0: no input and no decay, so the final state is unchanged.
    xdt = _chunks(x * dt[..., None], pad, chunk)  # [c, Q, H, P]
    B, C = _chunks(B, pad, chunk), _chunks(C, pad, chunk)  # [c, Q, H, N]
    a = _chunks(dt * A, pad, chunk).transpose(1, 2)  # [c, H, Q]: log-decay per token
    cum = a.cumsum(-1)
    within = torch.exp(_segment_sums(a))  # [c, H, Q, Q]: decay from token s to token l
    scores = torch.einsum("clhn,cshn->chls", C, B) * within
    out = torch.einsum("chls,cshp->clhp", scores, xdt)
    to_end = torch.exp(cum[..., -1:] - cum)  # [c, H, Q]: decay from a token to its chunk end
    local = torch.einsum("cshn,chs,cshp->chpn", B, to_end, xdt)  # each chunk's own input
    chunk_decay = torch.exp(cum[..., -1])  # [c, H]
    starts = []
    for i in range(local.shape[0]):
        starts.append(state)
        state = state * chunk_decay[i][:, None, None] + local[i]
    carried = torch.einsum("clhn,chpn->clhp", C, torch.stack(starts))
    out = out + carried * torch.exp(cum).transpose(1, 2)[..., None]
    return out.flatten(0, 1)[:length], state


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """Zero-pad dim 0 by `pad` and split it into [num_chunks, chunk, ...]."""
    t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
    return t.unflatten(0, (-1, chunk))


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q]: out[l, s] = a[s+1] + ... + a[l] for s <= l, -inf above.

    Summed by a masked cumsum rather than as cum[l] - cum[s]: no cancellation between
    two large partial sums.
    """
    q = a.shape[-1]
    lower = torch.ones(q, q, dtype=torch.bool, device=a.device).tril()
    terms = a[..., :, None].expand(*a.shape, q).masked_fill(~lower.tril(-1), 0.0)
    return terms.cumsum(dim=-2).masked_fill(~lower, -torch.inf)


def _store(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    writes: list[tuple[int, torch.Tensor, torch.Tensor]],
) -> None:
    """Write (page, conv state, ssm state) triples into the pools."""
    if not writes:
        return
    pages = [p for p, _, _ in writes]
    if 0 in pages:
        raise ValueError("a state would be written into the null page 0")
    index = torch.tensor(pages, device=conv_states.device)
    conv = torch.stack([c for _, c, _ in writes]).to(conv_states.dtype)
    ssm = torch.stack([s for _, _, s in writes]).to(ssm_states.dtype)
    conv_states.index_copy_(0, index, conv)
    ssm_states.index_copy_(0, index, ssm)


def _check_segments(segments: list[StateSegment], num_tokens: int) -> None:
    """The segments must tile the batch rows exactly, with valid snapshot offsets."""
    covered = 0
    for seg in sorted(segments, key=lambda s: s.start):
        if seg.start != covered or seg.num < 1:
            raise ValueError(f"segments must tile the {num_tokens} batch rows; got {segments}")
        covered += seg.num
        bad = [k for k, _ in seg.snapshots if not 1 <= k <= seg.num]
        if bad:
            raise ValueError(f"snapshot offsets {bad} outside 1..{seg.num} of {seg}")
    if covered != num_tokens:
        raise ValueError(f"segments cover {covered} rows of a batch of {num_tokens}")
