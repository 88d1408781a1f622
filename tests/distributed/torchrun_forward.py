"""Run under ``torchrun --standalone --nproc-per-node 2``: each process joins the group from torchrun's environment
(``parallel_state.init_from_env``), keeps its shard of a seeded tiny model (``executor.rank_model``) and runs the
forward; rank 0 compares the logits with the unsharded model's and prints ``max_abs_diff <value>``.  Used by
``test_torchrun.py``; not a test module itself."""

import sys

import torch

from minillm import ModelConfig
from minillm.distributed.executor import rank_model
from minillm.distributed.parallel_state import init_from_env
from minillm.models.llama import Transformer


def seeded_model(cfg: ModelConfig) -> Transformer:
    """The same weights in every process: norms near 1, the rest small (a Transformer starts uninitialised)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model.requires_grad_(False)


def main() -> int:
    ctx = init_from_env(backend="gloo")
    cfg = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5)
    full = seeded_model(cfg)  # every rank builds the same full model, then keeps its shard
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(7).expand(2, 7)
    shard = rank_model(ctx, full)
    with torch.inference_mode():
        got = shard(ids, positions)
    if ctx.rank == 0:
        want = seeded_model(cfg)(ids, positions)
        print(f"world_size {ctx.world_size} max_abs_diff {(got - want).abs().max().item():.3e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
