"""Speculative decoding benchmark: acceptance α, tokens per target forward and tokens/s against γ, per proposer,
on copy-heavy prompts (repeat a passage, edit code) and an open-ended one, at batch 1, greedy, with plain decode
measured in the same run.  Each speculative row also shows the tokens per target call the acceptance predicts for
i.i.d. acceptance, (1 − α^(γ+1)) / (1 − α), beside the measured mean accepted length.

Not a test: it times, it asserts nothing.  On a shared machine the numbers move with the neighbours' load; the
configurations take turns within every repeat and keep their best, so compare ratios within one run.
"""

from __future__ import annotations

import time

from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.perf.bench.decode import save_results
from minillm.sampling.params import SamplingParams

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
           "All that glitters is not gold. Where there is a will, there is a way.")
CODE = ("def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n"
        "def variance(xs):\n    m = mean(xs)\n    total = 0\n    for x in xs:\n        total += (x - m) ** 2\n"
        "    return total / len(xs)\n")
PROMPTS = {  # kind -> chat message
    "copy: repeat": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "copy: edit code": f"Rename the variable `total` to `acc` in this code and print the whole code:\n\n{CODE}",
    "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def predicted_tokens_per_call(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward when each draft is accepted independently with probability α:
    1 + α + α² + … + α^γ = (1 − α^(γ+1)) / (1 − α)  (Leviathan et al. 2023, eq. 1)."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _configs(num_layers: int, gammas: tuple[int, ...]) -> list[tuple[str, int, dict | None]]:
    out: list[tuple[str, int, dict | None]] = [("plain", 0, None)]
    for g in gammas:
        out.append(("ngram", g, {"method": "ngram", "num_speculative_tokens": g, "prompt_lookup_max": 4}))
    for g in gammas:
        out.append((f"early_exit({num_layers})", g,
                    {"method": "early_exit", "num_layers": num_layers, "num_speculative_tokens": g}))
    return out


def _run(llm, spec: dict | None, prompt: list[int], n_tokens: int) -> dict:
    eng = LLMEngine(llm.model, llm.tokenizer, EngineConfig(speculative_config=spec, max_num_seqs=1))
    t0 = time.perf_counter()
    out = eng.generate([prompt], SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True))[0]
    wall = time.perf_counter() - t0
    m = out.metrics
    decode_s = (m.finish_s or 0) - (m.first_token_s or 0)
    return {"tokens": out.token_ids, "tok_s": (m.output_tokens - 1) / decode_s if decode_s > 0 else 0.0,
            "wall_s": wall, "alpha": m.acceptance_rate, "tokens_per_call": m.mean_accepted_length}


def bench_spec(model: str | None = None, device: str | None = None, gammas: tuple[int, ...] = (2, 4),
               n_tokens: int = 64, repeats: int = 2, early_exit_layers: int | None = None,
               save: bool = True) -> list[dict]:
    """Run every (prompt, configuration) ``repeats`` times, turns interleaved; keep each one's best decode tok/s.
    Returns one row per (prompt kind, configuration) and prints the table."""
    from minillm.llm import LLM

    llm = LLM(model, device=device)
    layers = early_exit_layers or max(1, llm.model.config.num_layers // 4)
    configs = _configs(layers, gammas)
    rows = []
    for kind, message in PROMPTS.items():
        prompt = llm.apply_chat_template([{"role": "user", "content": message}])
        best: dict[int, dict] = {}
        for _ in range(repeats):
            for i, (_, _, spec) in enumerate(configs):
                r = _run(llm, spec, prompt, n_tokens)
                if i not in best or r["tok_s"] > best[i]["tok_s"]:
                    best[i] = r
        plain = best[0]
        for i, (name, gamma, _) in enumerate(configs):
            r = best[i]
            alpha = r["alpha"]
            rows.append({"prompt": kind, "proposer": name, "gamma": gamma, "alpha": alpha,
                         "tokens_per_call": r["tokens_per_call"],
                         "predicted_tokens_per_call": None if alpha is None else predicted_tokens_per_call(alpha,
                                                                                                           gamma),
                         "tok_s": r["tok_s"], "speedup": r["tok_s"] / plain["tok_s"] if plain["tok_s"] else None,
                         "same_tokens_as_plain": r["tokens"] == plain["tokens"]})
    print_spec_table(rows)
    if save:
        print(f"saved {save_results('spec-' + str(llm.model.device.type), {'n_tokens': n_tokens, 'rows': rows})}")
    return rows


def print_spec_table(rows: list[dict]) -> None:
    """One line per (prompt, proposer, γ)."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"{'prompt':<16} {'proposer':<14} {'γ':>2} {'α':>5} {'tok/call':>8} {'pred':>5} {'tok/s':>7} "
          f"{'speedup':>7}  same")
    for r in rows:
        print(f"{r['prompt']:<16} {r['proposer']:<14} {r['gamma']:>2} {f(r['alpha'], '.2f'):>5} "
              f"{f(r['tokens_per_call'], '.2f'):>8} {f(r['predicted_tokens_per_call'], '.2f'):>5} "
              f"{r['tok_s']:>7.1f} {f(r['speedup'], '.2f'):>6}x  {r['same_tokens_as_plain']}")
