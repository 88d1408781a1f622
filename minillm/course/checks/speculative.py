"""Checkers of notebook 08: speculative decoding.

Every expected value comes from a reference written here, never from the library's solved function (a grader
hides that while a checker runs).  Inputs are fresh random draws on every call, so a hard-coded answer fails; the
statistical checks use a significance of 1e-5 per test, so a correct answer fails about once in 10^4 runs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from minillm.course.checks.registry import _passed, exercise
from minillm.sampling.params import SamplingParams
from minillm.sampling.sampler import probabilities

Z_CRITICAL = 4.26  # standard normal 1 - 1e-5 quantile: the z-tests' and the chi-square quantile's significance


# ------------------------------------------------------------------------------------------------ 8.1 the rule
def _chi_square_failure(counts: Sequence[int], probs: Sequence[float]) -> str | None:
    """Why ``counts`` are unlikely draws from ``probs`` (Pearson's chi-square at 1e-5, Wilson–Hilferty quantile;
    a count where the probability is 0 fails outright), or None when they fit."""
    n = sum(counts)
    bad = [y for y, (c, p) in enumerate(zip(counts, probs, strict=True)) if c > 0 and p <= 0]
    if bad:
        return f"token(s) {bad} were drawn although the target gives them probability 0"
    live = [(c, p * n) for c, p in zip(counts, probs, strict=True) if p > 0]
    stat = sum((c - e) ** 2 / e for c, e in live)
    df = max(len(live) - 1, 1)
    critical = df * (1 - 2 / (9 * df) + Z_CRITICAL * math.sqrt(2 / (9 * df))) ** 3
    if stat <= critical:
        return None
    return f"chi-square {stat:.0f} > {critical:.0f} (df {df})"


def _z_failure(successes: int, trials: int, p: float) -> str | None:
    """Why ``successes`` of ``trials`` are unlikely for a success probability ``p`` (a two-sided z-test)."""
    sd = math.sqrt(max(trials * p * (1 - p), 1e-12))
    z = (successes - trials * p) / sd
    return None if abs(z) <= Z_CRITICAL or (p in (0.0, 1.0) and successes == trials * p) else f"z = {z:.1f}"


def _table(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{x:.3f}" for x in xs) + "]"


def _greedy_reference(rows: torch.Tensor, drafts: list[int]) -> list[int]:
    best = [int(r) for r in rows.argmax(-1)]
    out = []
    for x, b in zip(drafts, best, strict=False):
        if x != b:
            break
        out.append(x)
    return out + [best[len(out)]]


def _check_greedy(rejection_sample: Callable, rng: random.Random, gen: torch.Generator) -> None:
    greedy = SamplingParams(temperature=0.0)
    for _ in range(30):
        V, gamma = rng.randint(3, 12), rng.randint(0, 5)
        rows = torch.randn(gamma + 1, V, generator=gen) * 3
        best = rows.argmax(-1).tolist()
        agree = rng.randint(0, gamma)  # drafts agree with the target's argmax for a prefix, then (maybe) not
        drafts = best[:agree] + [rng.randrange(V) for _ in range(gamma - agree)]
        expected = _greedy_reference(rows, drafts)
        got = rejection_sample(rows.clone(), list(drafts), None, greedy, None)
        what = (f"greedy (temperature 0), γ = {gamma}: target argmax per row {best}, drafts {drafts}"
                if gamma else "greedy with γ = 0 (no drafts: just the target's next token)")
        assert isinstance(got, list) and all(isinstance(t, int) for t in got), (
            f"{what}: returned {got!r}, expected a list of Python ints {expected}")
        assert got == expected, (
            f"{what}: returned {got}, expected {expected}: accept the longest prefix of drafts equal to the "
            "target's argmax rows, then append the argmax of the row after it (the correction, or the bonus token "
            "when every draft agrees).")


def _sample_calls(rejection_sample, rows, drafts_for, probs_for, params, n, gen):
    """``n`` verification calls, fresh drafts each; -> (first tokens, second tokens when emitted, lengths)."""
    first, second, lengths = [], [], []
    for _ in range(n):
        drafts, q = drafts_for(), probs_for
        out = rejection_sample(rows, list(drafts), q if q is None else q.clone(), params, gen)
        first.append(out[0])
        if len(out) > 1:
            second.append(out[1])
        lengths.append(len(out))
    return first, second, lengths


def _check_distribution(rejection_sample: Callable, rng: random.Random, gen: torch.Generator,
                        point_mass: bool) -> None:
    """One verification step with γ = 2 on fixed target rows p_0..p_2 and draft rows q_0, q_1: the first emitted
    token must follow p_0, the second (when emitted) p_1, and P(accept x_0) must be sum_y min(p_0, q_0)."""
    V, gamma = 6, 2
    params = SamplingParams(temperature=rng.uniform(0.7, 1.3), top_k=V - 1, top_p=0.97)
    for _ in range(100):  # redraw until the draft disagrees enough to test anything (acceptance 0.25 .. 0.75)
        rows = torch.randn(gamma + 1, V, generator=gen) * 1.5
        p = probabilities(rows, params)  # the target's filtered distributions: what the user asked to sample
        if point_mass:
            drafts = [int(torch.multinomial(p[0], 1, generator=gen)), rng.randrange(V)]
            q, alpha = None, float(p[0, drafts[0]])
        else:
            draft_logits = rows[:gamma] + torch.randn(gamma, V, generator=gen) * 2.0
            q = probabilities(draft_logits, params)
            alpha = float(torch.minimum(p[0], q[0]).sum())
        if 0.25 < alpha < 0.75:
            break
    n = 4000
    if point_mass:
        fixed = list(drafts)
        first, second, lengths = _sample_calls(rejection_sample, rows, lambda: fixed, None, params, n, gen)
        kind = f"n-gram proposal (draft_probs None: q = a point mass on each draft), drafts {fixed}"
    else:
        def draw() -> list[int]:
            return [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(gamma)]
        first, second, lengths = _sample_calls(rejection_sample, rows, draw, q, params, n, gen)
        kind = "draft-model proposal, drafts sampled from draft_probs q"
    where = (f"{kind}; {params}; target p_0 = {_table(p[0].tolist())}"
             + ("" if point_mass else f", draft q_0 = {_table(q[0].tolist())}"))
    bad_len = [ln for ln in lengths if not 1 <= ln <= gamma + 1]
    assert not bad_len, f"{where}: returned {bad_len[0]} tokens, expected between 1 and γ + 1 = {gamma + 1}"
    accepted = sum(1 for ln in lengths if ln >= 2)
    why = _z_failure(accepted, n, alpha)
    assert why is None, (
        f"{where}: the first draft was kept in {accepted / n:.3f} of {n} calls, expected its acceptance "
        f"probability sum_y min(p_0(y), q_0(y)) = {alpha:.3f} ({why}). Accept x with probability min(1, p(x)/q(x)) "
        "(u < p/q with u uniform), with p the FILTERED target row (probabilities(target_logits, params)).")
    counts = [first.count(y) for y in range(V)]
    why = _chi_square_failure(counts, p[0].tolist())
    assert why is None, (
        f"{where}: the first emitted token's frequencies {_table([c / n for c in counts])} differ from the target's "
        f"p_0 (expected {_table(p[0].tolist())}; {why}). After a rejection draw from norm(max(0, p - q)) "
        "(for a point mass: p with the draft token zeroed), not from p or q, and stop.")
    counts = [second.count(y) for y in range(V)]
    why = _chi_square_failure(counts, p[1].tolist())
    m = max(len(second), 1)
    assert why is None, (
        f"{where}: the second emitted token (in the {len(second)} calls that kept x_0) has frequencies "
        f"{_table([c / m for c in counts])}, expected the target's p_1 {_table(p[1].tolist())} ({why}). Row i of "
        "target_logits is the distribution after draft i-1; a rejection ends the call with one resampled token.")
    all_kept = sum(1 for ln in lengths if ln == gamma + 1)
    if point_mass:
        both = alpha * float(p[1, drafts[1]])
    else:
        both = float(torch.minimum(p[0], q[0]).sum() * torch.minimum(p[1], q[1]).sum())
    why = _z_failure(all_kept, n, both)
    assert why is None, (
        f"{where}: {all_kept} of {n} calls returned γ + 1 = {gamma + 1} tokens, expected about {both * n:.0f} "
        f"({why}): when every draft is accepted append a bonus token drawn from the last row p_γ.")


def _check_bonus(rejection_sample: Callable, gen: torch.Generator) -> None:
    """γ = 1 with a draft that is the target's own row 0 (q_0 = p_0: every draft accepted), and rows 0 and 1 far
    apart: the bonus token must follow the row after the last draft, p_γ = p_1 — not p_{γ-1}."""
    params, V, n = SamplingParams(temperature=1.0), 6, 2000
    rows = torch.tensor([[4.0, 2.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0, 4.0]])
    p = probabilities(rows, params)
    q = p[:1].clone()
    bonus = []
    for _ in range(n):
        draft = [int(torch.multinomial(q[0], 1, generator=gen))]
        out = rejection_sample(rows, list(draft), q.clone(), params, gen)
        assert isinstance(out, list) and len(out) == 2 and out[0] == draft[0], (
            f"γ = 1 with draft_probs equal to the target's filtered row 0 (p_0 = q_0 = {_table(p[0].tolist())}): "
            f"returned {out!r} for draft {draft}, expected the draft kept (p/q = 1 always accepts) plus one bonus "
            "token.")
        bonus.append(out[1])
    counts = [bonus.count(y) for y in range(V)]
    why = _chi_square_failure(counts, p[1].tolist())
    wrong_row = "" if _chi_square_failure(counts, p[0].tolist()) else " — they follow p_0: you drew from the last " \
        "draft's row p_{γ-1}"
    assert why is None, (
        f"every draft accepted (γ = 1, q_0 = p_0): the bonus tokens' frequencies {_table([c / n for c in counts])} "
        f"differ from p_γ = p_1 = {_table(p[1].tolist())} ({why}){wrong_row}. The bonus token is drawn from the row "
        "after the last draft: row γ of target_logits.")


def _check_seeded(rejection_sample: Callable, gen: torch.Generator) -> None:
    params = SamplingParams(temperature=1.0)
    rows = torch.randn(4, 8, generator=gen)
    q = probabilities(rows[:3] + torch.randn(3, 8, generator=gen) * 2, params)
    drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(3)]
    runs = [[rejection_sample(rows, list(drafts), q.clone(), params, torch.Generator().manual_seed(s))
             for s in range(30)] for _ in range(2)]
    assert runs[0] == runs[1], (
        "two runs with the same seeded generators returned different tokens, expected the same: draw every "
        "uniform and every resample from `generator` (torch.rand(..., generator=generator), "
        "torch.multinomial(..., generator=generator)) so that seeded requests are reproducible.")


@exercise("8.1", "minillm.sampling.rejection.rejection_sample", "the speculative accept/resample rule",
          "greedy: the longest prefix agreeing with the target's argmax, then one argmax; otherwise filter the "
          "target with probabilities(), accept each guess with probability min(1, p/q), at the first rejection "
          "draw one token from norm(max(0, p − q)) and stop; all accepted: a bonus token from the last row")
def check_rejection_sample(rejection_sample: Callable) -> None:
    """``rejection_sample(target_logits, draft_tokens, draft_probs, params, generator)``: greedy on random rows
    (γ = 0 included), then 4000 seeded verification steps with a disagreeing draft model and with a point-mass
    (n-gram) proposal, whose emitted tokens must follow the target's filtered rows (chi-square), whose acceptance
    must be sum_y min(p, q), 2000 all-accepted steps whose bonus token must follow p_γ (not p_{γ-1}), and
    reproducibility from the generator."""
    seed = random.SystemRandom().randrange(2**31)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: thread wake-ups would cost more than the work
    try:
        _check_greedy(rejection_sample, rng, gen)
        _check_distribution(rejection_sample, rng, gen, point_mass=False)
        _check_distribution(rejection_sample, rng, gen, point_mass=True)
        _check_bonus(rejection_sample, gen)
        _check_seeded(rejection_sample, gen)
    finally:
        torch.set_num_threads(threads)
    _passed("8.1")


# ------------------------------------------------------------------------------------------------ 8.2 n-gram
def _ngram_reference(tokens: list[int], k: int, n_min: int, n_max: int) -> tuple[list[int], int | None, int]:
    """(proposal, matched n, start of the match): all earlier occurrences of each suffix, the latest taken."""
    L = len(tokens)
    if k >= 1:
        for n in range(n_max, n_min - 1, -1):
            if n > L - 1:
                continue
            starts = [s for s in range(L - n) if tokens[s : s + n] == tokens[L - n :]]
            if starts:
                return tokens[max(starts) + n : max(starts) + n + k], n, max(starts)
    return [], None, 0


def _ngram_hint(tokens, k, n_min, n_max, got) -> str:
    expected, n, start = _ngram_reference(tokens, k, n_min, n_max)
    if n is None:
        return "no n-gram of the allowed lengths occurs earlier, so there is nothing to propose: return []"
    why = (f"the longest suffix that occurred before has n = {n} (try n = n_max down to n_min), its most recent "
           f"earlier occurrence starts at {start}; propose what followed it, tokens[{start + n}:{start + n + k}]")
    for s in range(len(tokens)):
        if s != start and got == tokens[s + n : s + n + k] and tokens[s : s + n] == tokens[len(tokens) - n :]:
            return why + f" — you took the occurrence at {s}"
    return why


@exercise("8.2", "minillm.spec.ngram.ngram_lookup", "the n-gram prompt-lookup proposer",
          "longest n first; find the most recent earlier start of the last n tokens (it may overlap them) and "
          "propose up to k of the tokens that followed it; nothing found for any n: []")
def check_ngram_lookup(ngram_lookup: Callable) -> None:
    """``ngram_lookup(tokens, k, n_min, n_max)`` on hand-made contexts (the most recent copy, the longest n, an
    overlapping match, a continuation cut by the context's end, k = 0, one token) and on random contexts over
    small vocabularies; the context must not be modified."""
    cases = [
        ("the most recent of two earlier copies", [1, 2, 3, 9, 1, 2, 4, 7, 1, 2], 2, 1, 3),
        ("a longer match wins over a more recent shorter one", [5, 6, 7, 8, 0, 7, 9, 5, 6, 7], 2, 1, 3),
        ("a match overlapping the suffix", [4, 4, 4, 4], 3, 1, 3),
        ("the continuation runs into the end of the context", [3, 1, 2, 3], 5, 1, 2),
        ("k = 0 proposes nothing", [1, 2, 1, 2], 0, 1, 2),
        ("a one-token context", [7], 3, 1, 4),
        ("only a 1-gram matches, below n_min", [5, 1, 8, 1], 3, 2, 3),
        ("n_max longer than the context", [2, 3, 2], 4, 1, 9),
        ("the last token never occurred before", [1, 2, 3, 4], 3, 1, 3),
    ]
    rng = random.Random(random.SystemRandom().randrange(2**31))
    for i in range(300):
        L, vocab = rng.randint(1, 40), rng.randint(2, 6)
        n_min = rng.randint(1, 3)
        cases.append((f"random context {i}", [rng.randrange(vocab) for _ in range(L)], rng.randint(0, 6), n_min,
                      n_min + rng.randint(0, 3)))
    for what, tokens, k, n_min, n_max in cases:
        context = list(tokens)
        got = ngram_lookup(context, k, n_min, n_max)
        expected = _ngram_reference(list(tokens), k, n_min, n_max)[0]
        call = f"{what}: ngram_lookup({tokens}, k={k}, n_min={n_min}, n_max={n_max})"
        assert context == tokens, f"{call} modified the context to {context}, expected it unchanged"
        assert isinstance(got, list) and list(got) == expected, (
            f"{call} returned {got!r}, expected {expected}: {_ngram_hint(tokens, k, n_min, n_max, got)}.")
    _passed("8.2")


# ------------------------------------------------------------------------------------------------ 8.3 rollback
def _truncate_reference(bm, seq_id, num_tokens: int) -> None:
    """Roll ``seq_id`` back to ``num_tokens`` tokens: written from the contract, on the manager's own tables."""
    table, bs = bm.sequence(seq_id), bm.block_size
    live = bm._seqs[seq_id]  # the manager's own table (``sequence`` returns a copy)
    keep_blocks = (num_tokens + bs - 1) // bs
    for block_id in table.block_ids[keep_blocks:][::-1]:  # tail first
        bm.device.free(block_id)
    live.block_ids = table.block_ids[:keep_blocks]
    live.token_ids = table.token_ids[:num_tokens]
    live.block_hashes = table.block_hashes[: min(len(table.block_hashes), num_tokens // bs)]
    live.num_computed = min(table.num_computed, num_tokens)


def _state(bm, seq_ids) -> dict:
    a = bm.device
    state = {}
    for s in seq_ids:
        if s in bm:
            t = bm.sequence(s)
            state[f"{s!r} block_ids"] = t.block_ids
            state[f"{s!r} token_ids"] = t.token_ids
            state[f"{s!r} block_hashes (how many)"] = len(t.block_hashes)
            state[f"{s!r} num_computed"] = t.num_computed
    state["ref counts"] = [a.ref_count(b) for b in range(a.num_blocks)]
    state["free list"] = list(a._free)
    state["evictable (LRU order)"] = a.evictable_blocks()
    state["cache entries"] = sorted(a.cached_blocks())
    return state


_HINTS = {
    "block_ids": "keep just the blocks the kept tokens need, ceil(num_tokens / block_size) (self._blocks_for): a "
                 "partly filled last block stays, an emptied one goes",
    "token_ids": "keep exactly the first num_tokens tokens",
    "block_hashes (how many)": "keep only the hashes of blocks full of kept tokens, num_tokens // block_size at "
                               "most: a prefix-cache hash must never cover a rolled-back token",
    "num_computed": "num_computed becomes min(num_computed, num_tokens): rolled-back tokens were never computed",
    "ref counts": "release every dropped block with self.device.free(block_id) (a block shared with a fork only "
                  "loses this sequence's reference)",
    "free list": "release every dropped block with self.device.free(block_id), tail first",
    "evictable (LRU order)": "free the dropped blocks tail first (reversed): a cached chain's tail must be evicted "
                             "before its head",
    "cache entries": "use self.device.free: it keeps a cached block's entry for later prefix hits",
}


def _hint(key: str) -> str:
    return next(hint for name, hint in _HINTS.items() if key.endswith(name))


@exercise("8.3", "minillm.kv.block_manager.BlockManager.truncate", "roll back rejected tokens' KV slots",
          "release the blocks the kept tokens no longer need with self.device.free, tail first; then cut the "
          "table's tokens, blocks and hashes (full blocks of kept tokens only) and its num_computed")
def check_truncate(manager_class: type) -> None:
    """A ``BlockManager`` subclass with the student's ``truncate`` against a reference written from the contract,
    on the same scripted and random histories: rejected drafts in a partial block, at a block boundary, into a
    fresh block, nothing rejected, below the computed (and prefix-cached) tokens, a forked sequence's shared
    blocks; then decoding goes on, and the states must still agree (new blocks registered from the right hash)."""
    from minillm.kv.block_manager import BlockManager

    def run(what, build, seq_id, num_tokens, bs=4, caching=True, blocks=24):
        mine = manager_class(blocks, bs, enable_prefix_caching=caching)
        ref = BlockManager(blocks, bs, enable_prefix_caching=caching)
        ids = build(mine), build(ref)
        call = f"{what} (block_size {bs}): truncate({seq_id!r}, {num_tokens}) of {ref.num_tokens(seq_id)} tokens"
        assert mine.truncate(seq_id, num_tokens) is None, f"{call} returned a value, expected None"
        _truncate_reference(ref, seq_id, num_tokens)
        got, expected = _state(mine, ids[1]), _state(ref, ids[1])
        for key, value in expected.items():
            assert got.get(key) == value, (
                f"{call}: {key} is {got.get(key)}, expected {value}. {_hint(key)}.")
        for m in (mine, ref):  # decoding goes on: new tokens, written and registered in the prefix cache
            m.append_slots(seq_id, list(range(200, 205)))
            m.mark_computed(seq_id, m.num_tokens(seq_id))
        got, expected = _state(mine, ids[1]), _state(ref, ids[1])
        for key, value in expected.items():
            assert got.get(key) == value, (
                f"{call}, then 5 new tokens appended and computed: {key} is {got.get(key)}, expected {value}. "
                f"{_hint(key)}.")

    def drafts(prompt: int, num_drafts: int):
        def build(m):
            m.allocate("s", list(range(1, prompt + 1)))
            m.mark_computed("s", prompt)
            m.append_slots("s", list(range(100, 100 + num_drafts)))  # drafts: slots, never marked computed
            return ["s"]
        return build

    run("6 committed + 4 drafts, 1 accepted", drafts(6, 4), "s", 7)
    run("6 committed + 4 drafts, all rejected", drafts(6, 4), "s", 6)
    run("7 committed + 5 drafts, 1 accepted: the kept tokens end on a block boundary", drafts(7, 5), "s", 8)
    run("8 committed + 3 drafts, none accepted: the drafts' fresh block goes", drafts(8, 3), "s", 8)
    run("5 committed + 3 drafts, all accepted: nothing to roll back", drafts(5, 3), "s", 8)
    run("3 committed + 9 drafts with block_size 2", drafts(3, 9), "s", 4, bs=2)

    def computed(m):
        m.allocate("s", list(range(1, 14)))
        m.mark_computed("s", 13)  # three full blocks registered in the prefix cache
        return ["s"]

    run("13 computed tokens, prefix caching on: back to 6 (below the computed, cached blocks)", computed, "s", 6)
    run("13 computed tokens, no prefix caching: back to 9", computed, "s", 9, caching=False)

    def forked(m):
        m.allocate("p", list(range(1, 11)))
        m.mark_computed("p", 10)
        m.fork("p", "c")  # the child shares all three blocks
        m.append_slots("c", [50, 51, 52])
        return ["p", "c"]

    run("a forked child with 3 drafts, back into the blocks it shares with its parent", forked, "c", 6)
    rng = random.Random(random.SystemRandom().randrange(2**31))
    for trial in range(40):
        bs, prompt, num_drafts = rng.choice([1, 2, 4, 8]), rng.randint(1, 20), rng.randint(0, 9)
        cut = rng.randint(1, prompt + num_drafts) if rng.random() < 0.3 else rng.randint(prompt, prompt + num_drafts)
        run(f"random history {trial}: {prompt} computed + {num_drafts} drafts", drafts(prompt, num_drafts), "s",
            max(cut, 1), bs=bs, caching=rng.random() < 0.7, blocks=64)
    _passed("8.3")
