"""The trunk's joint attention through one ``scaled_dot_product_attention`` call, and no mask when
nothing is masked.

The ``mmdit`` package's ``JointAttention`` always builds a key mask (all true when no modality has
one) and hands it to ``x_transformers``' ``Attend``, which expands it to [B, H, N, N], checks for
fully masked rows and masks the output again. With a mask, SDPA cannot take its flash kernel (the
memory-efficient one runs instead), and the mask's ops are host work in every block. ``SDPAJointAttention``
computes the same formula with the same parameters (names unchanged: checkpoints load either way):
per modality its own QKV projection, one attention over the joint sequence (softmax scale
``dim_head ** -0.5``, as ``Attend``), per modality its own output projection; a key mask only where
a modality has one (text padding), as a [B, 1, 1, N] boolean mask.

Which kernel SDPA picks is the run's kernel mode (``dist.set_deterministic``): flash or cuDNN in
the fast mode, the math backend in the deterministic one. The package's own path (einsum and
softmax, ``model.flash_attn: false``) stays for deterministic runs that never asked for SDPA, so
their arithmetic is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SDPAJointAttention", "use_sdpa_attention"]


def _joint_attention_class() -> type[nn.Module]:
    from mmdit.mmdit_pytorch import JointAttention

    return JointAttention


class SDPAJointAttention(nn.Module):
    """Mixed into the package's ``JointAttention`` by ``use_sdpa_attention`` (its forward only)."""

    to_qkv: nn.ModuleList
    to_out: nn.ModuleList
    split_heads: nn.Module
    merge_heads: nn.Module

    def forward(
        self, inputs: tuple[Tensor, ...], masks: tuple[Tensor | None, ...] | None = None
    ) -> tuple[Tensor, ...]:
        qkvs = [self.split_heads(to_qkv(x)) for x, to_qkv in zip(inputs, self.to_qkv, strict=True)]
        q, k, v = torch.cat(qkvs, dim=3).unbind(0)  # each [B, H, N, D] over the joint sequence
        attn_mask = None
        if masks is not None and any(m is not None for m in masks):
            keys = [
                m if m is not None else torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
                for x, m in zip(inputs, masks, strict=True)
            ]
            attn_mask = torch.cat(keys, dim=1)[:, None, None, :]
        out = self.merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask))
        parts = out.split([x.shape[1] for x in inputs], dim=1)
        return tuple(to_out(o) for o, to_out in zip(parts, self.to_out, strict=True))


_MIXED: dict[type, type] = {}


def use_sdpa_attention(model: nn.Module) -> int:
    """Give every ``JointAttention`` of ``model`` the SDPA forward, in place (before compiling or
    wrapping it); returns how many were changed. Unsupported variants (query/key RMS norms, logit
    soft-clamping) keep the package's forward."""
    joint = _joint_attention_class()
    changed = 0
    for module in model.modules():
        if (
            type(module) is joint
            and not module.qk_rmsnorm
            and not getattr(module.attend, "softclamp_logits", False)
        ):
            cls = type(module)
            mixed = _MIXED.get(cls)
            if mixed is None:
                mixed = _MIXED[cls] = type(f"SDPA{cls.__name__}", (SDPAJointAttention, cls), {})
            module.__class__ = mixed
            changed += 1
    return changed
