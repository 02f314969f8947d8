"""Gated DeltaNet, Qwen3.5's linear-attention layer (transformers' `Qwen3_5GatedDeltaNet`).

x -> in_proj_qkv -> causal depthwise conv1d + SiLU -> q, k, v; gates from in_proj_a (decay, with
A_log and dt_bias), in_proj_b (beta) and in_proj_z (output gate); the gated delta rule; a gated
RMSNorm per value head; out_proj. A sequence's whole past is its conv state (the conv's last
kernel - 1 inputs) and its recurrent state, one row of each per cache slot."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmcli.kernels import delta_rule
from mmcli.models.cache import AttentionBatch
from mmcli.models.config import TextConfig
from mmcli.models.layers.linear import Linear


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, scaled by weight and gated by SiLU(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    work = "delta_rule"  # the kind of work the kernel plan installs a kernel for
    # the delta rule's (chunked, step) pair (its step may answer None: not its inputs); PyTorch's
    # (kernels/delta_rule.py) else
    kernel = None

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim, self.conv_size = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        self.in_proj_qkv = Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.conv_size, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        batch: AttentionBatch,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
    ) -> torch.Tensor:
        mixed = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if batch.seqlens is None:
            window = torch.cat([conv_state[batch.slots], mixed.unsqueeze(-1)], dim=-1)
            conv_state[batch.slots] = window[..., 1:]
            mixed = F.silu((window * self.conv1d.weight[:, 0]).sum(-1))
            inputs = (*self._split(mixed), g, beta, recurrent_state, batch.slots)
            out = self.kernel[1](*inputs) if self.kernel else None
            if out is None:  # no kernel, or not these inputs: PyTorch's
                out = delta_rule.step(*inputs)
        else:
            out = self._prefill(mixed, g, beta, batch, conv_state, recurrent_state)
        z = self.in_proj_z(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))
        return self.out_proj(self.norm(out.to(x.dtype), z).flatten(-2))

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
        )

    def _prefill(self, mixed, g, beta, batch, conv_state, recurrent_state) -> torch.Tensor:
        """Each prompt from its row's states (zero for a new sequence, the prefix's after a
        shared prefix); a padded prompt (fixed shapes) keeps its state as of its last real
        token."""
        out, first = [], 0
        for i, n in enumerate(batch.seqlens):
            s, slot = slice(first, first + n), batch.slots[i : i + 1]
            first += n
            resumed = bool(batch.starts and batch.starts[i])
            history = self.conv_size - 1  # the conv's inputs before the first token
            before = conv_state[slot][0] if resumed else mixed.new_zeros(self.conv_dim, history)
            inputs = torch.cat([before, mixed[s].t()], dim=1)  # [conv_dim, kernel - 1 + n]
            conv = F.conv1d(inputs.unsqueeze(0), self.conv1d.weight, groups=self.conv_dim)
            last = (
                batch.last
                if batch.last is not None
                else torch.tensor([n - 1], device=inputs.device)
            )
            keep = last.to(inputs.device) + 1 + torch.arange(history, device=inputs.device)
            conv_state[slot] = inputs[:, keep].unsqueeze(0)
            g_s, beta_s = g[s], beta[s]
            if batch.last is not None:  # padding leaves the state as it is: no decay, no write
                real = (torch.arange(n, device=g.device) <= batch.last).unsqueeze(-1)
                g_s, beta_s = g_s * real, beta_s * real
            state = (
                recurrent_state[slot][0]
                if resumed
                else recurrent_state.new_zeros(recurrent_state.shape[1:])
            )
            chunked, _ = self.kernel or (delta_rule.chunked, delta_rule.step)
            o, state = chunked(*self._split(F.silu(conv[0].t())), g_s, beta_s, state)
            recurrent_state[slot] = state.unsqueeze(0)
            out.append(o)
        return torch.cat(out)
