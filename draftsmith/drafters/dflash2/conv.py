"""DFlash2's grouped two-tap dynamic depthwise convolution, and the decoder layer it wraps.

What vLLM 0.32 computes (``qwen3_dflash2.py``: ``DFlashGroupedConv``, ``_grouped_conv``,
``DFlash2Qwen3DecoderLayer``), for one side ``s`` (0: before the sublayer, 1: after it)::

    out[q, c] = sum_t (base_kernel[s, t, c] + delta[q, t, g(c)]) * x[q - t, c]

over the taps ``t = 0 .. kernel - 1``, where ``g(c) = c // group_size`` (channels in groups of
``group_size`` share one dynamic coefficient) and ``x[q - t]`` counts as zero when it lies in
an earlier block (the slot ``q % block_size`` is below ``t``): taps never cross the block
boundary. One projection of the sublayer's (normed) input gives both sides' deltas,
``kernel_projection: H -> 2 * kernel * G``, viewed ``[2, kernel, G]``.

Identity start (speculators #1006, Model-Optimizer #2216): ``base_kernel[:, 0] = 1``, the
other taps 0, ``kernel_projection`` 0, so a new DFlash2 layer computes exactly what its DFlash
layer does and a DFlash drafter's weights can start it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from draftsmith.drafters.attention.block_layers import BlockLayer
from draftsmith.drafters.attention.layers import RotaryEmbedding


class GroupedConv(nn.Module):
    """One sublayer's pair of convolutions (vLLM's ``DFlashGroupedConv``).

    Args:
        hidden_size: H, a multiple of ``group_size``.
        kernel_size: taps per convolution (``dflash_config.conv_kernel_size``).
        group_size: channels sharing one dynamic coefficient (``conv_group_size``).
        block_size: the period of the query rows: blocks of this many slots back to back.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        if hidden_size % group_size or not 1 <= kernel_size <= block_size:
            raise ValueError(
                f"conv_group_size {group_size} must divide hidden size {hidden_size} and "
                f"conv_kernel_size {kernel_size} lie in 1..block_size {block_size}"
            )
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups,
                                           bias=False)  # fmt: skip
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 weighs 1, the other taps 0, no dynamic part."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def convolve(self, x: Tensor, delta: Tensor, side: int) -> Tensor:
        """x [B, Q, H], delta [B, Q, kernel, G] -> [B, Q, H] (module docstring)."""
        b, q, h = x.shape
        groups = x.view(b, q, self.num_groups, self.group_size)  # [B, Q, G, gs]
        coef = self.base_kernel[side].view(1, 1, self.kernel_size, self.num_groups,
                                           self.group_size) + delta[..., None]  # fmt: skip
        slot = torch.arange(q, device=x.device) % self.block_size  # [Q]
        out = coef[:, :, 0] * groups
        for t in range(1, self.kernel_size):
            shifted = torch.zeros_like(groups)
            shifted[:, t:] = groups[:, :-t]  # x[q - t]
            inside = (slot >= t).view(1, q, 1, 1).to(x.dtype)  # zero across block boundaries
            out = out + coef[:, :, t] * shifted * inside
        return out.reshape(b, q, h)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Sublayer input [B, Q, H] -> (its convolution [B, Q, H], the output side's delta
        [B, Q, kernel, G])."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size,
                                               self.num_groups)  # fmt: skip
        return self.convolve(x, delta[:, :, 0], 0), delta[:, :, 1]

    def finish(self, x: Tensor, delta: Tensor) -> Tensor:
        """Sublayer output [B, Q, H] and ``prepare``'s delta -> [B, Q, H]."""
        return self.convolve(x, delta, 1)


class ConvBlockLayer(BlockLayer):
    """vLLM's ``DFlash2Qwen3DecoderLayer``: DFlash's layer (``BlockLayer``) with a convolution
    pair around attention (``attention_conv``) and around the MLP (``mlp_conv``). The
    context's keys and values (``BlockAttention.context_kv``) pass no convolution."""

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float, *,
                 block_size: int, conv_kernel_size: int, conv_group_size: int,
                 **attn: int) -> None:  # fmt: skip
        super().__init__(hidden_size, intermediate_size, eps, **attn)
        conv = (hidden_size, conv_kernel_size, conv_group_size, block_size)
        self.attention_conv = GroupedConv(*conv)
        self.mlp_conv = GroupedConv(*conv)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        rope: RotaryEmbedding,
        context_kv: tuple[Tensor, Tensor],
        mask: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """x, residual [B, Q, H] (blocks of ``block_size`` slots back to back) ->
        (mlp_out, residual) [B, Q, H]."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x, delta = self.attention_conv.prepare(x)
        x = self.attention_conv.finish(self.self_attn(x, positions, rope, context_kv, mask), delta)
        x, residual = self.post_attention_layernorm(x, residual)
        x, delta = self.mlp_conv.prepare(x)
        return self.mlp_conv.finish(self.mlp(x), delta), residual
