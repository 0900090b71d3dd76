"""Which parameter takes which path.

Spectral (NS5 family): hidden matrices — 2-D weights and conv kernels reshaped to (out, in·kh·kw), as
Keller's Muon and Moonlight recommend. Scalar ((SF-)AdamW): biases, norms, 0-/1-D tensors, and embeddings
and output heads, which Muon's authors exclude because their rows are lookups/logits, not linear maps
of a hidden state (FusionOpt routes a vocab×d embedding to the spectral path: ``Taikakim/fusion-optimiser``
fusion_optimiser/groups.py ``build_fusion_param_groups`` takes every 2-D weight with min(shape) ≥ 128).

Without a model or names, an embedding is indistinguishable from a hidden matrix: pass
``model.named_parameters()`` or use :func:`param_groups` (which also sees module types and tied weights).
"""
from __future__ import annotations

import math
import re

import torch
from torch import nn

__all__ = ["route", "param_groups", "SCALAR_NAME_PATTERN", "matrix_shape"]

# Names that mark embeddings and output heads in common model code (GPT-2 wte/wpe, HF lm_head, timm head,
# minGPT's tok_emb/pos_emb: any "<x>_emb" or "emb" module).
SCALAR_NAME_PATTERN = r"(embed|(^|\.)(wte|wpe|lm_head|head|classifier|fc_out|output_layer|emb|\w+_emb)(\.|$))"

_EMBEDDING_TYPES = (nn.Embedding, nn.EmbeddingBag)


def matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The 2-D view the spectral path works on: (out, in·kh·kw) for conv kernels (from the shape, not
    ``p[0]``, which does not exist for an empty ``out`` dimension)."""
    return (p.shape[0], math.prod(p.shape[1:])) if p.ndim >= 2 else (1, p.numel())


def route(p: torch.Tensor, name: str | None = None, *, pattern: str = SCALAR_NAME_PATTERN) -> str:
    """"spectral" or "scalar" for one parameter (see the module docstring)."""
    if p.ndim < 2 or min(matrix_shape(p)) < 2:
        return "scalar"
    if name is not None and re.search(pattern, name):
        return "scalar"
    return "spectral"


def param_groups(model: nn.Module, *, weight_decay: float | None = None, no_decay_1d: bool = True,
                 pattern: str = SCALAR_NAME_PATTERN) -> list[dict]:
    """Parameter groups with an explicit ``path`` for Fusion optimizers (and usable by any optimizer).

    Embedding weights (by module type), weights tied to them (an LM head sharing the embedding) and names
    matching ``pattern`` go to the scalar path; so do 0-/1-D parameters, which get ``weight_decay=0`` when
    ``no_decay_1d`` (decaying norm gains and biases is rarely wanted). Groups that would be empty are left out.
    """
    scalar_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, _EMBEDDING_TYPES):
            scalar_ids.add(id(module.weight))
    buckets: dict[str, tuple[list, list]] = {"spectral": ([], []), "scalar": ([], []), "scalar_1d": ([], [])}
    for name, p in model.named_parameters():  # shared (tied) parameters are yielded once
        if not p.requires_grad:
            continue
        path = "scalar" if id(p) in scalar_ids else route(p, name, pattern=pattern)
        key = "scalar_1d" if (path == "scalar" and p.ndim < 2 and no_decay_1d) else path
        buckets[key][0].append(p)
        buckets[key][1].append(name)
    groups = []
    for key, (params, names) in buckets.items():
        if not params:
            continue
        g = {"params": params, "param_names": names, "path": "spectral" if key == "spectral" else "scalar"}
        if key == "scalar_1d":
            g["weight_decay"] = 0.0
        elif weight_decay is not None:
            g["weight_decay"] = weight_decay
        groups.append(g)
    return groups
