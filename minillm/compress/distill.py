"""Distillation: heal a smaller student by teaching it the teacher's whole next-token distribution.

The student here is the teacher with some decoder layers dropped (``drop_layers``) — "The Unreasonable
Ineffectiveness of the Deeper Layers" (Gromov et al., 2024) drops late-middle layers of Llama models and heals them
with a short fine-tune.  ``distill`` minimises KL(teacher ‖ student) over the vocabulary at every position
(Hinton et al., 2015): a soft target carries far more signal per token than the one-hot next token, which is why
minutes of healing recover much of what dropping cost.  Cost per step: a teacher forward and a student forward +
backward over ``batch × seq_len`` tokens; AdamW keeps two fp32 states per trained parameter (the embeddings stay
frozen: they are a third of SmolLM2-135M and tied to the LM head).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from minillm.models.llama import Transformer


def drop_layers(model: Transformer, drop: Sequence[int]) -> Transformer:
    """A copy of ``model`` without the decoder layers whose indices are in ``drop`` (``model`` is unchanged)."""
    n = model.config.num_layers
    drop = sorted(set(drop))
    if not drop or drop[0] < 0 or drop[-1] >= n or len(drop) >= n:
        raise ValueError(f"drop must name some but not all of the layers 0..{n - 1}, got {drop}")
    student = copy.deepcopy(model)
    student.model.layers = torch.nn.ModuleList(m for i, m in enumerate(student.model.layers) if i not in drop)
    student.config = dataclasses.replace(model.config, num_layers=n - len(drop))
    return student


def kl_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Mean over positions of KL(softmax(teacher / T) ‖ softmax(student / T)) × T², logits [..., V] (fp32)."""
    s = F.log_softmax(student_logits.float() / temperature, dim=-1).flatten(0, -2)
    t = F.log_softmax(teacher_logits.float() / temperature, dim=-1).flatten(0, -2)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2


def distill(student: Transformer, teacher: Transformer, token_ids: Tensor, *, steps: int = 100, batch: int = 2,
            seq_len: int = 128, lr: float = 5e-5, temperature: float = 1.0, max_seconds: float | None = None,
            seed: int = 0) -> list[float]:
    """Train ``student``'s decoder layers and norms in place towards ``teacher``'s logits on random windows of
    ``token_ids`` [T] (calibration text, never the evaluation split).  Stops after ``steps`` or ``max_seconds``.
    -> the KL loss of each step.  Runs the torch kernels (autograd); the student is left in eval mode."""
    if token_ids.numel() <= seq_len:
        raise ValueError(f"need more than seq_len={seq_len} tokens, got {token_ids.numel()}")
    g = torch.Generator().manual_seed(seed)
    kernels = student.kernels
    student.set_kernels("torch").train()
    params = [p for n, p in student.named_parameters() if not n.startswith(("model.embed_tokens", "lm_head"))]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    pos = torch.arange(seq_len, device=student.device).expand(batch, seq_len)
    losses, start = [], time.perf_counter()
    try:
        for _ in range(steps):
            if max_seconds is not None and losses and time.perf_counter() - start > max_seconds:
                break
            starts = torch.randint(0, token_ids.numel() - seq_len, (batch,), generator=g)
            ids = torch.stack([token_ids[s : s + seq_len] for s in starts.tolist()]).to(student.device)
            with torch.inference_mode():
                target = teacher(ids, pos).float()
            loss = kl_loss(student(ids, pos), target.clone(), temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        for p in params:
            p.requires_grad_(False)
        student.set_kernels(kernels).eval()
    return losses
