"""Speculative decoding benchmark: acceptance α, tokens per target forward and tokens/s against γ, per proposer,
on copy-heavy prompts (repeat a passage, summarise it, edit code) and an open-ended one, greedy, up to EOS, with
plain decode measured in the same run — at batch 1 (every prompt alone) and at batch 8 under continuous batching
(eight requests of the same kind in one engine).  Each speculative row also shows the tokens per verify pass the
acceptance predicts for i.i.d. acceptance, (1 − α^(γ+1)) / (1 − α), beside the measured one; the tokens per target
call over every step (steps without a proposal included); where a speculative step's time goes (draft, verify,
the rest) in ms; and the speedup projected for a verify pass costing ``PROJECTED_VERIFY_RATIO`` × a plain step.

The peer is transformers' ``generate`` on the same chat prompts, batch 1, greedy: plain, with prompt lookup
(``prompt_lookup_num_tokens=γ``) and, when ``hf_assistant`` names a checkpoint, assisted generation with that
draft model.  A peer that fails to load or run is reported as an error row; the rest of the bench still runs.

Not a test: it times, it asserts nothing.  On a shared machine the numbers move with the neighbours' load; the
configurations take turns within every repeat and keep their best, so compare ratios within one run.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from minillm.config import EngineConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.perf.bench.decode import save_results
from minillm.sampling.params import SamplingParams
from minillm.spec.proposer import SpecStats

# Copy-heavy prompts are ones SmolLM2-135M-Instruct answers by copying (its greedy answers, checked by hand: the
# repeat is verbatim; the summary keeps whole sentences of the passage; the edit reprints the code with one line
# changed).  The passage and the code are long enough that the copy lasts past the default 64 tokens: with a
# shorter passage the model ends its answer early and everything after it measures what follows an answer, not a
# copy (a shorter repeat prompt used before scored α 0.34, though the copy itself was accepted at α ≈ 0.8).  An
# earlier "rename a variable" edit was not copy-heavy for this model: it rewrote the code instead (α 0.07).
PASSAGE = ("Lighthouses were once kept by families who lived at the foot of the tower. Every evening the keeper "
           "climbed the spiral stairs, trimmed the wick and wound the clockwork that turned the lens. Through the "
           "night he returned every few hours to refill the oil and clean the soot from the glass. In a storm nobody "
           "slept: the light had to burn until dawn, whatever the weather did to the house below.")
CODE = ('def greet(name, greeting="Hello"):\n    message = f"{greeting}, {name}!"\n    print(message)\n'
        '    return message\n\ndef farewell(name):\n    message = f"Goodbye, {name}. See you soon!"\n'
        '    print(message)\n    return message\n')
PROMPTS = {  # kind -> chat message
    "copy: repeat": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "copy: summarise": f"Summarise the following passage:\n\n{PASSAGE}",
    "copy: edit code": f'Change the default greeting to "Hi" and show the whole code:\n\n{CODE}',
    "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def predicted_tokens_per_call(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward when each draft is accepted independently with probability α:
    1 + α + α² + … + α^γ = (1 − α^(γ+1)) / (1 − α)  (Leviathan et al. 2023, eq. 1)."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _configs(num_layers: int, gammas: tuple[int, ...], proposers: tuple[str, ...]
             ) -> list[tuple[str, int, dict | None]]:
    """(name, γ, speculative_config) per configuration: plain decode first, then each proposer at each γ."""
    # n-gram lengths 2..4: a 1-token match is a weak guess (open-ended text: 23 verify passes for 64 tokens at
    # α 0.02 with n ≥ 1, 3 with n ≥ 2; the copy prompts keep their tokens per call), and each wasted verify costs
    # more than the plain step it replaces
    specs = {"ngram": ("ngram", {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}),
             "early_exit": (f"early_exit({num_layers})", {"method": "early_exit", "num_layers": num_layers}),
             "quantized": ("quantized(int4)", {"method": "quantized"})}
    unknown = set(proposers) - set(specs)
    if unknown:
        raise ValueError(f"unknown proposers {sorted(unknown)}; choose from {sorted(specs)}")
    out: list[tuple[str, int, dict | None]] = [("plain", 0, None)]
    for p in proposers:
        name, spec = specs[p]
        out += [(name, g, {**spec, "num_speculative_tokens": g}) for g in gammas]
    return out


def _run(llm, spec: dict | None, prompts: list[list[int]], n_tokens: int, stop_at_eos: bool = True) -> dict:
    """All ``prompts`` in one engine (continuous batching, max_num_seqs = their number), greedy, up to ``n_tokens``
    each (ending at EOS when ``stop_at_eos``: what a user gets; past EOS the model starts a new, made-up turn).
    -> tokens per request, decode tok/s (output tokens after each request's first, over the span from the first
    first-token to the last finish), engine-wide α, tokens per target call and ms per speculative step part."""
    eng = LLMEngine(llm.model, llm.tokenizer, EngineConfig(speculative_config=spec, max_num_seqs=len(prompts)))
    eng.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up: kernels, the drafter's first call
    before = None if eng.spec_stats is None else dataclasses.replace(eng.spec_stats)
    outs = eng.generate(prompts, SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=not stop_at_eos))
    ms = [o.metrics for o in outs]
    span = max(m.finish_s or 0 for m in ms) - min(m.first_token_s or 0 for m in ms)
    decoded = sum(m.output_tokens - 1 for m in ms)
    r = {"tokens": [o.token_ids for o in outs], "tok_s": decoded / span if span > 0 else 0.0,
         "out_tokens": decoded / len(outs) + 1, "alpha": None, "tokens_per_call": None, "accepted_per_verify": None}
    if before is not None:
        st = stats_since(eng.spec_stats, before)
        r.update(alpha=st.acceptance_rate if st.draft_tokens else None, tokens_per_call=st.tokens_per_call,
                 accepted_per_verify=st.mean_accepted_length if st.verify_steps else None,
                 verify_steps=st.verify_steps,
                 skipped_steps=st.skipped_steps, **st.per_step_ms())
    return r


def stats_since(now: SpecStats, before: SpecStats) -> SpecStats:
    """The counters ``now`` minus ``before`` (what one run added to an engine's life-long ``SpecStats``)."""
    diff = {f.name: getattr(now, f.name) - getattr(before, f.name) for f in dataclasses.fields(SpecStats)}
    shrunk = sorted(name for name, v in diff.items() if v < 0)
    if shrunk:
        raise ValueError(f"{shrunk} went down: pass an earlier snapshot of the same engine's spec_stats as `before`")
    return SpecStats(**diff)


def projected_speedup(row: dict, plain_ms: float, verify_ratio: float) -> float | None:
    """Batch-1 speedup over plain decode if verifying γ + 1 rows cost ``verify_ratio`` × a plain step of
    ``plain_ms`` (whole step, ms), keeping the row's measured draft and overhead ms per speculative step and its
    steps without a proposal (plain steps): tokens / time of (verify steps + skipped steps) over plain's 1 token per
    ``plain_ms``.  None for a row without speculation counters."""
    if not (plain_ms > 0 and verify_ratio > 0):
        raise ValueError(f"plain_ms and verify_ratio must be > 0 (a plain step's ms, verify ms over it), got "
                         f"{plain_ms!r} and {verify_ratio!r}")
    verify, skipped = row.get("verify_steps"), row.get("skipped_steps")
    if not verify or skipped is None:
        return None
    share = verify / (verify + skipped)  # target calls that verified; the rest were plain steps (no proposal)
    ms_per_call = share * (row["draft_ms"] + verify_ratio * plain_ms + row["overhead_ms"]) + (1 - share) * plain_ms
    return row["tokens_per_call"] * plain_ms / ms_per_call


def batch_prompts(llm, kind: str, batch: int) -> list[list[int]]:
    """``batch`` chat prompts of one kind; copies of the first vary its text (a rotated passage) so that no two
    requests share a whole prompt (prefix caching would otherwise skip their prefill)."""
    message = PROMPTS[kind]
    out = []
    for i in range(batch):
        head, _, body = message.partition("\n\n")
        words = body.split(" ")
        k = (3 * i) % max(len(words), 1)
        text = message if i == 0 or not body else head + "\n\n" + " ".join(words[k:] + words[:k])
        out.append(llm.apply_chat_template([{"role": "user", "content": text}]))
    return out


def hf_generate_rates(checkpoint, prompts: dict[str, list[int]], n_tokens: int, gammas: tuple[int, ...],
                      repeats: int, device, dtype, assistant=None, stop_at_eos: bool = True) -> list[dict]:
    """transformers ``generate`` at batch 1, greedy, on the same token ids: plain, prompt lookup per γ, and
    assisted generation with ``assistant`` (a checkpoint) when given.  -> rows with decode tok/s (the first
    token's time, measured as a 1-token generate, subtracted) or an ``error``."""
    from transformers import AutoModelForCausalLM

    rows = []
    try:
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
        draft = (AutoModelForCausalLM.from_pretrained(assistant, dtype=dtype).to(device).eval()
                 if assistant is not None else None)
    except Exception as e:  # noqa: BLE001 — a peer that cannot load must not stop the bench
        return [{"prompt": "-", "proposer": "transformers", "gamma": 0, "error": f"{type(e).__name__}: {e}"}]
    variants = [("hf plain", 0, {})] + [("hf prompt_lookup", g, {"prompt_lookup_num_tokens": g}) for g in gammas]
    if draft is not None:
        variants += [("hf assisted", g, {"assistant_model": draft, "num_assistant_tokens": g,
                                         "num_assistant_tokens_schedule": "constant"}) for g in gammas]
    for kind, ids in prompts.items():
        x = torch.tensor([ids], device=device)
        best: dict[int, dict] = {}
        for _ in range(repeats):
            for i, (_, _, kwargs) in enumerate(variants):
                try:
                    r = _hf_once(hf, x, n_tokens, kwargs, stop_at_eos)
                except Exception as e:  # noqa: BLE001 — one failing variant is one error row
                    best[i] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                if i not in best or r["tok_s"] > best[i].get("tok_s", -1):
                    best[i] = r
        for i, (name, g, _) in enumerate(variants):
            rows.append({"prompt": kind, "proposer": name, "gamma": g, **best[i]})
    plain = {r["prompt"]: r for r in rows if r["proposer"] == "hf plain" and "tok_s" in r}
    for r in rows:
        base = plain.get(r["prompt"])
        r["speedup"] = r["tok_s"] / base["tok_s"] if "tok_s" in r and base and base["tok_s"] else None
        if base is not None and "tokens" in r:
            r["same_tokens_as_plain"] = r["tokens"] == base["tokens"]
    return rows


@torch.inference_mode()
def _hf_once(hf, x, n_tokens: int, kwargs: dict, stop_at_eos: bool = True) -> dict:
    """One greedy generate of up to ``n_tokens`` (exactly ``n_tokens`` when not ``stop_at_eos``: min = max) and
    one of a single token."""
    common = {"do_sample": False, "pad_token_id": hf.config.eos_token_id}
    t = time.perf_counter()
    hf.generate(x, max_new_tokens=1, min_new_tokens=1, **common)
    first = time.perf_counter() - t
    t = time.perf_counter()
    least = 1 if stop_at_eos else n_tokens
    out = hf.generate(x, max_new_tokens=n_tokens, min_new_tokens=least, **common, **kwargs)
    total = time.perf_counter() - t
    new = out[0, x.shape[1]:].tolist()
    decode = max(total - first, 1e-9)
    return {"tokens": new, "tok_s": (len(new) - 1) / decode}


# the multi-row verify cost the projection assumes: a verify pass of γ + 1 rows at ~1.1× a 1-row decode step, as a
# bandwidth-bound GEMV that reads the weights once for all rows would cost (what the multi-row GEMV of
# kernels/cpu/csrc/native.c actually costs is in BENCHMARKS.md)
PROJECTED_VERIFY_RATIO = 1.1


def bench_spec(model: str | None = None, device: str | None = None, gammas: tuple[int, ...] = (2, 4),
               n_tokens: int = 64, repeats: int = 2, early_exit_layers: int | None = None,
               proposers: tuple[str, ...] = ("ngram", "early_exit", "quantized"), batch_sizes: tuple[int, ...] = (1, 8),
               hf: bool = True, hf_assistant: str | None = None, save: bool = True, stop_at_eos: bool = True,
               prompt_kinds: tuple[str, ...] | None = None) -> list[dict]:
    """Run every (prompt kind, batch size, configuration) ``repeats`` times, turns interleaved; keep each one's
    best decode tok/s.  Returns one row per (prompt kind, batch, configuration) — plus the transformers rows
    (``batch`` 1, ``peer`` True) when ``hf`` — and prints the table.

    A speculative row carries α (per proposed token), ``tokens_per_verify`` (beside ``predicted_tokens_per_call``
    from α), ``tokens_per_call`` (every step it could speculate in, the ones without a proposal included), the mean
    draft / verify / overhead ms per speculative step, ``verify_ratio`` (verify ms over a plain step's ms, the same
    run) and ``projected_speedup`` at ``PROJECTED_VERIFY_RATIO``.  ``prompt_kinds``: a subset of ``PROMPTS``."""
    from minillm.llm import LLM

    kinds = tuple(PROMPTS) if prompt_kinds is None else prompt_kinds
    unknown = set(kinds) - set(PROMPTS)
    if unknown:
        raise ValueError(f"unknown prompt kinds {sorted(unknown)}; choose from {sorted(PROMPTS)}")
    llm = LLM(model, device=device)
    layers = early_exit_layers or max(1, llm.model.config.num_layers // 4)
    configs = _configs(layers, gammas, proposers)
    rows = []
    for kind in kinds:
        for batch in batch_sizes:
            prompts = batch_prompts(llm, kind, batch)
            best: dict[int, dict] = {}
            for _ in range(repeats):
                for i, (_, _, spec) in enumerate(configs):
                    r = _run(llm, spec, prompts, n_tokens, stop_at_eos)
                    if i not in best or r["tok_s"] > best[i]["tok_s"]:
                        best[i] = r
            plain = best[0]
            plain_ms = 1e3 * batch / plain["tok_s"] if plain["tok_s"] else None  # one plain engine step
            for i, (name, gamma, _) in enumerate(configs):
                rows.append(_row(kind, batch, name, gamma, best[i], plain, plain_ms))
    if hf:
        from minillm.models.loader import resolve

        try:
            checkpoint = resolve(model).directory
        except Exception as e:  # noqa: BLE001
            peer = [{"prompt": "-", "proposer": "transformers", "gamma": 0, "error": f"{type(e).__name__}: {e}"}]
        else:
            prompts = {kind: batch_prompts(llm, kind, 1)[0] for kind in kinds}
            peer = hf_generate_rates(checkpoint, prompts, n_tokens, gammas, repeats, llm.model.device,
                                     llm.model.dtype, hf_assistant, stop_at_eos)
        rows += [{"batch": 1, "alpha": None, "tokens_per_call": None, "predicted_tokens_per_call": None,
                  "speedup": None, "same_tokens_as_plain": None, **r, "peer": True} for r in peer]
    for r in rows:
        r.pop("tokens", None)
    print_spec_table(rows)
    if save:
        payload = {"n_tokens": n_tokens, "gammas": list(gammas), "batch_sizes": list(batch_sizes),
                   "stop_at_eos": stop_at_eos, "projected_verify_ratio": PROJECTED_VERIFY_RATIO, "rows": rows}
        print(f"saved {save_results('spec-' + str(llm.model.device.type), payload)}")
    return rows


def _row(kind: str, batch: int, name: str, gamma: int, r: dict, plain: dict, plain_ms: float | None) -> dict:
    """One table row from a configuration's best run and plain decode's."""
    alpha = r["alpha"]
    row = {"prompt": kind, "batch": batch, "proposer": name, "gamma": gamma, "alpha": alpha,
           "tokens_per_verify": r["accepted_per_verify"], "tokens_per_call": r["tokens_per_call"],
           "predicted_tokens_per_call": None if alpha is None else predicted_tokens_per_call(alpha, gamma),
           "out_tokens": r["out_tokens"], "plain_step_ms": plain_ms, "tok_s": r["tok_s"],
           "speedup": r["tok_s"] / plain["tok_s"] if plain["tok_s"] else None,
           "same_tokens_as_plain": r["tokens"] == plain["tokens"], "peer": False}
    for key in ("draft_ms", "verify_ms", "overhead_ms", "step_ms", "verify_steps", "skipped_steps"):
        row[key] = r.get(key)
    if r.get("verify_ms") is not None and plain_ms:
        row["verify_ratio"] = r["verify_ms"] / plain_ms
        row["projected_speedup"] = projected_speedup(row, plain_ms, PROJECTED_VERIFY_RATIO)
    return row


def print_spec_table(rows: list[dict]) -> None:
    """One line per (prompt, batch, proposer, γ); transformers rows last, errors as text."""
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"{'prompt':<16} {'B':>2} {'proposer':<17} {'γ':>2} {'α':>5} {'tok/ver':>7} {'pred':>5} {'tok/call':>8} "
          f"{'draft':>6} {'verify':>6} {'ovh':>5} {'v/plain':>7} {'tok/s':>7} {'speedup':>7} {'proj':>6}  same")
    for r in rows:
        head = f"{r['prompt']:<16} {r.get('batch', 1):>2} {r['proposer']:<17} {r['gamma']:>2}"
        if "error" in r:
            print(f"{head}  error: {r['error'][:120]}")
            continue
        print(f"{head} {f(r.get('alpha'), '.2f'):>5} {f(r.get('tokens_per_verify'), '.2f'):>7} "
              f"{f(r.get('predicted_tokens_per_call'), '.2f'):>5} {f(r.get('tokens_per_call'), '.2f'):>8} "
              f"{f(r.get('draft_ms'), '.1f'):>6} {f(r.get('verify_ms'), '.1f'):>6} {f(r.get('overhead_ms'), '.1f'):>5} "
              f"{f(r.get('verify_ratio'), '.2f'):>7} {r['tok_s']:>7.1f} {f(r.get('speedup'), '.2f'):>6}x "
              f"{f(r.get('projected_speedup'), '.2f'):>5}x  {r.get('same_tokens_as_plain')}")
