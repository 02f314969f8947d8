"""The gated delta rule (Gated DeltaNet's recurrence), as transformers' `qwen3_next` defines it.

State S [heads, key_dim, value_dim] per sequence; each token decays it by exp(g), writes the
correction beta * (v - S^T k) along k, and reads it with q:
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
with q and k L2-normalised and q scaled by key_dim^-1/2. Prefill runs it chunk-parallel (the UT
transform turns a chunk's updates into triangular solves and matmuls); decode runs one step.
Everything here is float32 whatever the activations are, as the state is."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
# Decays past e^-40 (4e-18) are taken as zero: below float32's resolution of any sum they enter,
# and what would otherwise carry subnormals into the products (a microcode assist at each
# operation they enter on x86: Qwen3.5-2B's prompts ran 1.85x slower with them)
DECAY_FLOOR = -40.0


def decay_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of log decays (x <= 0), zero past DECAY_FLOOR."""
    return x.masked_fill(x < DECAY_FLOOR, float("-inf")).exp()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(query, key, value, g, beta):
    """[L, heads, d] inputs -> float32 [heads, L, d] with q/k normalised and q scaled; key heads
    repeated to the value heads (each serves value_heads // key_heads of them)."""
    groups = value.shape[-2] // key.shape[-2]
    if groups > 1:
        query, key = query.repeat_interleave(groups, -2), key.repeat_interleave(groups, -2)
    query, key, value = (x.transpose(0, 1).float() for x in (query, key, value))
    query, key = l2norm(query), l2norm(key)
    query = query * query.shape[-1] ** -0.5
    return query, key, value, g.t().float(), beta.t().float()


def chunk_terms(q, k, v, g, beta) -> dict[str, torch.Tensor]:
    """What each chunk's step needs, for all chunks at once (the UT transform): q, k and v
    [heads, chunks, CHUNK, d] (padded), g and beta [heads, chunks, CHUNK]."""
    decay = g.cumsum(-1)  # log decay from the chunk's start
    from_start = decay_exp(decay)[..., None]
    future = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = decay_exp((decay[..., :, None] - decay[..., None, :]).masked_fill(future, float("-inf")))
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # unit lower triangular once I is added
    new_values = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    # the decayed keys fall with their rows' decay: rows past the floor are zero, and so is
    # their part of the system (the solve would carry them on into the subnormals)
    gone = (decay < DECAY_FLOOR)[..., None]
    k_decayed = torch.linalg.solve_triangular(
        system.masked_fill(gone, 0),
        k_beta * from_start,
        upper=False,
        unitriangular=True,
    )
    return {
        "new_values": new_values,
        "k_decayed": k_decayed,
        "within": (q @ k.transpose(-1, -2)) * pair,
        "q": q * from_start,
        "k": k * decay_exp(decay[..., -1:] - decay)[..., None],
        "chunk_decay": decay_exp(decay[..., -1])[..., None, None],
    }


def chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prompt: query/key [L, key_heads, dk], value [L, heads, dv], g/beta
    [L, heads], state [heads, dk, dv] -> (output [L, heads, dv] float32, final state)."""
    q, k, v, g, beta = _prepare(query, key, value, g, beta)
    length = q.shape[1]
    pad = -length % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    heads, n = q.shape[0], (length + pad) // CHUNK
    q, k, v = (x.reshape(heads, n, CHUNK, x.shape[-1]) for x in (q, k, v))
    terms = chunk_terms(q, k, v, g.reshape(heads, n, CHUNK), beta.reshape(heads, n, CHUNK))
    state = state.float()
    out = torch.empty_like(v)
    for i in range(n):  # sequential over chunks only
        fresh = terms["new_values"][:, i] - terms["k_decayed"][:, i] @ state
        out[:, i] = terms["q"][:, i] @ state + terms["within"][:, i] @ fresh
        state = state * terms["chunk_decay"][:, i] + terms["k"][:, i].transpose(-1, -2) @ fresh
    return out.reshape(heads, -1, out.shape[-1])[:, :length].transpose(0, 1), state


def step_inputs(query, key, value, g, beta):
    """A decode step's inputs as the rule takes them: q and k normalised (q scaled, key heads
    repeated), v, all [B, heads, d] float32, and each head's decay (e^g) and beta [B, heads]."""
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepare(query, key, value, g, beta))
    return q, k, v, decay_exp(g), beta


def step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token per row: query/key [B, key_heads, dk], value [B, heads, dv], g/beta [B, heads];
    the rows `slots` of states [rows, heads, dk, dv] advanced in place -> output [B, heads, dv]
    float32."""
    q, k, v, decay, beta = step_inputs(query, key, value, g, beta)
    state = states[slots].float() * decay[..., None, None]
    remembered = (k.unsqueeze(-2) @ state).squeeze(-2)  # [B, heads, dv]
    delta = (v - remembered) * beta[..., None]
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    states[slots] = state.to(states.dtype)
    return (q.unsqueeze(-2) @ state).squeeze(-2)


def fla_kernels():
    """flash-linear-attention's Triton kernels for CUDA when the package is installed, else None.
    Same contract as `chunked` and `step`: a prompt is a batch of one, decode rows a batch of
    one-token sequences (their states gathered and scattered back)."""
    try:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )
    except ImportError:
        return None

    def call(kernel, query, key, value, g, beta, state, batch_dim):
        groups = value.shape[-2] // key.shape[-2]
        if groups > 1:
            query, key = query.repeat_interleave(groups, -2), key.repeat_interleave(groups, -2)
        out, final = kernel(
            *(x.unsqueeze(batch_dim) for x in (query, key, value)),
            g=g.float().unsqueeze(batch_dim),
            beta=beta.unsqueeze(batch_dim),
            initial_state=state.float() if batch_dim else state.float().unsqueeze(0),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out.squeeze(batch_dim).float(), final if batch_dim else final[0]

    def fla_chunked(query, key, value, g, beta, state):
        return call(chunk_gated_delta_rule, query, key, value, g, beta, state, 0)

    def fla_step(query, key, value, g, beta, states, slots):
        kernel = fused_recurrent_gated_delta_rule
        out, state = call(kernel, query, key, value, g, beta, states[slots], 1)
        states[slots] = state.to(states.dtype)
        return out

    return fla_chunked, fla_step
