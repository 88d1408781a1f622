"""Megatron tensor parallelism by module swap: column- and row-parallel linears, and ``shard_model``.

A transformer block has two matmul pairs, attention (qkv → o) and MLP (gate_up → down).  Megatron splits the first
of each pair by output features (column-parallel: each rank computes some heads / some of the F hidden units, no
communication) and the second by input features (row-parallel: each rank multiplies its slice of the activations
by its slice of the weight, giving a partial sum of the full output).  One all-reduce per pair sums the partials:
two all-reduces of [B, L, hidden] per layer, and nothing else moves inside the stack.

Per rank, a layer then looks exactly like a smaller model's layer: H_q/tp query heads, H_kv/tp K/V heads,
F/tp MLP units.  So ``shard_model`` builds the rank's model from a per-rank ``ModelConfig`` (``rank_config``) —
attention, MLP and the KV caches size themselves from it unchanged — and swaps in the parallel linears.

The embedding and the LM head are split by vocabulary (Megatron's vocab-parallel layers): V is padded up to a
multiple of tp (``padded_vocab``) and each rank holds V_p/tp consecutive rows of the table — SmolLM2-135M's tied
49152 × 576 table is 28 M of its 135 M parameters (113 MB in fp32); at tp=2 each rank holds 14 M.
- ``VocabParallelEmbedding``: a rank looks up the ids that fall in its rows and writes zeros for the rest; an
  all-reduce of [B, L, hidden] sums the one non-zero contribution per token (exact: the other terms are 0).
- ``VocabParallelLMHead``: each rank computes its [..., V_p/tp] slice of the logits, an all-gather concatenates
  them in rank order and the padding columns are cut off: [..., V] on every rank.  The gather moves
  (tp − 1)/tp × B_s × V_p × bytes per rank — for one decode token of SmolLM2 in fp32, 98 KB at tp=2, about 70 %
  of what all 60 of its layers' all-reduces move (60 × 2.3 KB).  Gathering to the sampling rank only, or sampling
  on the shards and gathering (value, index) pairs, would cut that; minillm keeps the plain gather, which leaves
  identical logits on every rank.
Tied embeddings stay tied: the head's shard is the embedding's shard (one parameter).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from minillm.config import ModelConfig
from minillm.distributed.comm import all_gather, all_reduce
from minillm.distributed.parallel_state import ParallelContext
from minillm.kernels.select import KernelOps
from minillm.layers.linear import Linear
from minillm.models.llama import Transformer


def shard_linear(weight: Tensor, bias: Tensor | None, style: str, rank: int, world_size: int,
                 parts: tuple[int, ...] | None = None) -> tuple[Tensor, Tensor | None]:
    """Rank ``rank``'s share of a linear layer y = x W^T + b, W [N, K] (N output, K input features), b [N] or None.

    style "column": the rank computes its own output features — W's rows.  A stacked projection (``parts``: the row
    counts stacked in W, e.g. (q_size, kv_size, kv_size)) is split part by part, so the rank holds its 1/tp of
    *each* part, stacked in the same order.  -> (W_r [N/tp, K], b_r [N/tp] or None); no communication afterwards.
    style "row": the rank multiplies its 1/tp of the input features — W's columns — by its slice of x, giving a
    partial sum of y; the all-reduce then adds the partials.  The bias must enter that sum once: rank 0 keeps it,
    the others get None.  -> (W_r [N, K/tp], b on rank 0 else None).
    Shards are contiguous copies in rank order; the inputs are not modified.
    """
    ### BEGIN SOLUTION
    if style == "column":
        parts = parts or (weight.shape[0],)

        def split(t: Tensor) -> Tensor:  # this rank's 1/tp of every stacked part, stacked again
            return torch.cat([c.chunk(world_size, dim=0)[rank] for c in t.split(list(parts), dim=0)]).contiguous()

        return split(weight), None if bias is None else split(bias)
    if style == "row":
        shard = weight.chunk(world_size, dim=1)[rank].contiguous()  # (N, K/tp)
        return shard, (bias.clone() if bias is not None and rank == 0 else None)
    raise ValueError(f"style must be 'column' or 'row', got {style!r}")
    ### END SOLUTION


class ColumnParallelLinear(nn.Module):
    """A linear layer holding 1/tp of the output features: x [..., K] -> [..., N/tp], no communication.

    A stacked projection (``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up]) is split part by part
    (``parts``: the stacked row counts), so each rank holds whole q, k and v heads (or matching gate/up halves)
    and its output is laid out as the per-rank model expects ([q_r; k_r; v_r]).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, ctx: ParallelContext, parts: tuple[int, ...] | None = None):
        super().__init__()
        parts = parts or (weight.shape[0],)
        if sum(parts) != weight.shape[0] or any(p % ctx.world_size for p in parts):
            raise ValueError(f"column-parallel parts {parts} must sum to the {weight.shape[0]} output features and "
                             f"each be divisible by tensor_parallel_size={ctx.world_size}")
        w, b = shard_linear(weight.detach(), None if bias is None else bias.detach(), "column", ctx.rank,
                            ctx.world_size, parts)
        self.weight = nn.Parameter(w, requires_grad=False)  # (N/tp, K)
        self.bias = None if b is None else nn.Parameter(b, requires_grad=False)
        self.ctx = ctx

    @classmethod
    def from_linear(cls, linear: Linear, ctx: ParallelContext, parts: tuple[int, ...] | None = None):
        """The rank's shard of a whole ``Linear``."""
        return cls(linear.weight.detach(), None if linear.bias is None else linear.bias.detach(), ctx, parts)

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [..., K] (replicated) -> [..., N/tp] (this rank's features)."""
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """A linear layer holding 1/tp of the input features: x [..., K/tp] -> [..., N], all-reduced inside the layer.

    Each rank's ``x_r @ W_r.T`` is a partial sum of the full ``x @ W.T``; the all-reduce adds them (2 (tp − 1)/tp ×
    N × elements bytes per rank per row).  Rank 0 adds the bias to its partial, so the sum holds it once.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, ctx: ParallelContext):
        super().__init__()
        if weight.shape[1] % ctx.world_size:
            raise ValueError(f"row-parallel input features {weight.shape[1]} must be divisible by "
                             f"tensor_parallel_size={ctx.world_size}")
        w, b = shard_linear(weight.detach(), None if bias is None else bias.detach(), "row", ctx.rank,
                            ctx.world_size)
        self.weight = nn.Parameter(w, requires_grad=False)  # (N, K/tp)
        self.bias = None if b is None else nn.Parameter(b, requires_grad=False)  # rank 0 only
        self.ctx = ctx

    @classmethod
    def from_linear(cls, linear: Linear, ctx: ParallelContext):
        """The rank's shard of a whole ``Linear``."""
        return cls(linear.weight.detach(), linear.bias, ctx)

    def forward(self, x: Tensor, ops: KernelOps) -> Tensor:
        """x [..., K/tp] (this rank's features) -> [..., N] (the full output, on every rank)."""
        return all_reduce(ops.linear(x, self.weight, self.bias), self.ctx)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """V rounded up to a multiple of ``tp``: every rank holds the same number of vocabulary rows (the padding
    rows are zeros, their logits are cut off after the gather)."""
    return -(-vocab_size // tp) * tp


def vocab_shard(weight: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s rows of a [V, hidden] table: rows [rank·V_p/tp, (rank + 1)·V_p/tp) of the table padded
    with zero rows to ``padded_vocab`` -> [V_p/tp, hidden], a contiguous copy (``weight`` is not modified)."""
    vocab, per = weight.shape[0], padded_vocab(weight.shape[0], world_size) // world_size
    shard = weight.new_zeros(per, weight.shape[1])
    start = rank * per
    rows = weight[start : min(start + per, vocab)]  # (≤ V_p/tp, hidden); the last rank may hold padding only
    shard[: rows.shape[0]] = rows
    return shard


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: ids [...] -> [..., hidden], all-reduced inside the layer.

    The rank holds rows [start, start + V_p/tp) of the padded table; ids outside them look up row 0 and are
    zeroed, so the all-reduce (2 (tp − 1)/tp × tokens × hidden × bytes per rank) adds exactly one row per token.
    """

    def __init__(self, weight: Tensor, ctx: ParallelContext):
        super().__init__()
        self.weight = nn.Parameter(vocab_shard(weight.detach(), ctx.rank, ctx.world_size), requires_grad=False)
        self.vocab_size = weight.shape[0]
        self.start = ctx.rank * self.weight.shape[0]  # the first vocabulary id this rank holds
        self.ctx = ctx

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [...] (any id in [0, V)) -> embeddings [..., hidden], identical on every rank."""
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = nn.functional.embedding(local.where(mine, 0), self.weight)  # (..., hidden)
        return all_reduce(x * mine.unsqueeze(-1).to(x.dtype), self.ctx)


class VocabParallelLMHead(nn.Module):
    """The LM head split by vocabulary rows: hidden [..., hidden] -> logits [..., V], all-gathered inside the layer.

    ``weight``: the whole [V, hidden] head, or (tied embeddings) the rank's ``VocabParallelEmbedding`` whose shard
    it then shares.  Each rank computes its [..., V_p/tp] logits; the all-gather concatenates them in rank order.
    """

    def __init__(self, weight: Tensor | VocabParallelEmbedding, ctx: ParallelContext):
        super().__init__()
        if isinstance(weight, VocabParallelEmbedding):
            self.weight, self.vocab_size = weight.weight, weight.vocab_size  # tied: one shard, two uses
        else:
            self.weight = nn.Parameter(vocab_shard(weight.detach(), ctx.rank, ctx.world_size), requires_grad=False)
            self.vocab_size = weight.shape[0]
        self.bias = None
        self.ctx = ctx

    def forward(self, hidden: Tensor, ops: KernelOps) -> Tensor:
        """hidden [..., hidden] -> logits [..., V] (the padding columns cut off), identical on every rank."""
        local = ops.linear(hidden, self.weight, None)  # (..., V_p/tp)
        return all_gather(local, self.ctx, dim=-1)[..., : self.vocab_size]


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """The tensor-parallel sizes that give every rank whole heads: the common divisors of H_q, H_kv and F."""
    return [n for n in range(1, config.num_kv_heads + 1)
            if not (config.num_heads % n or config.num_kv_heads % n or config.intermediate_size % n)]


def rank_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The model one rank runs: H_q/tp, H_kv/tp heads and F/tp MLP units (hidden, D, V, layers unchanged).

    ValueError when ``tp`` < 1 or does not divide H_q, H_kv and F, naming the sizes that do.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
    if tp not in valid_tp_sizes(config):
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's heads and MLP (num_heads="
                         f"{config.num_heads}, num_kv_heads={config.num_kv_heads}, intermediate_size="
                         f"{config.intermediate_size}); each rank needs whole heads: use one of "
                         f"{valid_tp_sizes(config)}")
    return dataclasses.replace(config, num_heads=config.num_heads // tp, num_kv_heads=config.num_kv_heads // tp,
                               intermediate_size=config.intermediate_size // tp)


def check_shardable(model: Transformer, tp: int) -> ModelConfig:
    """``rank_config(model.config, tp)`` (ValueError naming the valid sizes), and ValueError if the model's linears
    are not float ``Linear`` layers (weight-quantized ones have no rows to cut here).  -> the rank's config."""
    cfg = rank_config(model.config, tp)
    linears = [model.lm_head, *(m for layer in model.model.layers for m in (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))]
    if tp > 1 and any(type(m) is not Linear for m in linears):
        raise ValueError("tensor parallelism splits float Linear weights: load the model without quantization "
                         "to shard it (tensor_parallel_size > 1 with a quantized model is not supported)")
    return cfg


def shard_model(model: Transformer, ctx: ParallelContext) -> Transformer:
    """This rank's share of a loaded ``model``: a ``Transformer`` of ``rank_config`` whose qkv/gate_up are
    ``ColumnParallelLinear``, o/down ``RowParallelLinear``, embedding and LM head ``VocabParallelEmbedding`` /
    ``VocabParallelLMHead`` (one shared shard when tied); norms and rotary tables shared with ``model``
    (replicated).  ``model(input_ids, positions)`` on every rank then gives the whole model's logits [B, L, V].
    ``model`` is left as it was.  ValueError for a ``ctx.world_size`` that does not divide the heads, or for
    weight-quantized linears (the split cuts float ``Linear`` weights).
    """
    full = model.config
    cfg = check_shardable(model, ctx.world_size)
    with torch.device("meta"):  # every weight below is assigned: no allocation for the placeholders
        out = Transformer(cfg)
    split = ("qkv_proj.weight", "qkv_proj.bias", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight",
             "embed_tokens.weight", "lm_head.weight")
    shared = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith(split)}
    out.load_state_dict(shared, strict=False, assign=True)
    out.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens.weight, ctx)
    out.lm_head = VocabParallelLMHead(out.model.embed_tokens if full.tie_word_embeddings else model.lm_head.weight,
                                      ctx)
    out.model.rotary_emb = model.model.rotary_emb  # depends on D and RoPE settings only, not on the heads
    for mine, theirs in zip(out.model.layers, model.model.layers, strict=True):
        attn, mlp = mine.self_attn, mine.mlp
        attn.qkv_proj = ColumnParallelLinear.from_linear(theirs.self_attn.qkv_proj, ctx,
                                                         (full.q_size, full.kv_size, full.kv_size))
        attn.o_proj = RowParallelLinear.from_linear(theirs.self_attn.o_proj, ctx)
        mlp.gate_up_proj = ColumnParallelLinear.from_linear(theirs.mlp.gate_up_proj, ctx,
                                                            (full.intermediate_size, full.intermediate_size))
        mlp.down_proj = RowParallelLinear.from_linear(theirs.mlp.down_proj, ctx)
    left = [n for n, t in [*out.named_parameters(), *out.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"shard_model left unassigned weights {left[:6]}: the model has parts it does not know")
    return out.eval().set_kernels(model.kernels)


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds tensor-parallel layers of a group of more than one rank (its forward then runs
    collectives, which a CUDA graph or the fused native step does not capture)."""
    kinds = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead)
    return any(isinstance(m, kinds) and m.ctx.world_size > 1 for m in model.modules())


def valid_pp_sizes(config: ModelConfig) -> list[int]:
    """Pipeline sizes that give every stage the same whole number of layers: the divisors of ``num_layers``."""
    return [p for p in range(1, config.num_layers + 1) if config.num_layers % p == 0]


def stage_layers(config: ModelConfig, pp: int, rank: int) -> range:
    """The decoder layers stage ``rank`` of ``pp`` holds.  ValueError for a ``pp`` that does not divide the layers
    (naming the sizes that do) or is below 1."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline_parallel_size must be an int >= 1, got {pp!r}")
    if config.num_layers % pp:
        raise ValueError(f"pipeline_parallel_size={pp} does not divide the model's {config.num_layers} layers "
                         f"into equal stages: use one of {valid_pp_sizes(config)}")
    n = config.num_layers // pp
    return range(rank * n, (rank + 1) * n)
