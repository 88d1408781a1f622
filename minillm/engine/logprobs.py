"""Which rows of a step carry logprobs, and the logprobs of those rows (``SamplingParams.logprobs`` /
``prompt_logprobs``).

A step's logits hold, per chunk, its ``ScheduledSeq.num_logit_rows`` last rows: first its prompt rows (a
``prompt_logprobs`` request's prefill positions whose next token is still a prompt token: row at position i scores
prompt token i + 1), then its sampling rows (the last row, or 1 + k rows of a draft chunk).  Only the requests that
asked get prompt rows, and only their rows go through ``log_softmax`` (``sampling.logprobs.token_logprobs``).
Logprobs are raw (before penalties and temperature), so a draft chunk's verified tokens are scored on the same
target rows a plain decode would use: speculative decoding and the fast runners return the same logprobs.
"""

from __future__ import annotations

from torch import Tensor

from minillm.engine.sequence import Sequence
from minillm.outputs import Logprob
from minillm.sampling.logprobs import TokenLogprobs, token_logprobs

# per sequence of the step: (its prompt positions' logprobs, its sampled tokens' logprobs), each in order
StepLogprobs = dict[Sequence, tuple[list[TokenLogprobs], list[TokenLogprobs]]]


def wants_prompt_rows(seq: Sequence) -> bool:
    """Whether ``seq`` still has prompt positions to score (then it must not skip them through prefix-cache hits)."""
    r = seq.request
    return (r.prompt_logprobs is not None and seq.index == 0
            and len(r.prompt_logprobs) < seq.num_prompt_tokens)  # [None] + one entry per later prompt token


def prompt_logit_rows(seq: Sequence, start: int, num_tokens: int) -> int:
    """Prompt rows of the chunk ``seq.token_ids[start : start + num_tokens]``: positions not yet scored whose next
    token is a prompt token.  They end at the chunk's end (or just before its sampling row), so with that row they
    are the chunk's last rows."""
    if not wants_prompt_rows(seq):
        return 0
    first = max(start, len(seq.request.prompt_logprobs) - 1)  # positions already scored are skipped
    return max(0, min(start + num_tokens, seq.num_prompt_tokens - 1) - first)


def step_logprobs(out, logits: Tensor, tokens: list[list[int]]) -> StepLogprobs:
    """The step's logprobs for the sequences that asked.  ``out``: the step's ``SchedulerOutput`` (not imported:
    the scheduler imports this module); ``logits`` [R, V] at ``logit_rows(out)``; ``tokens``:
    the sampled token lists, one per sampling chunk (``ModelRunner.sample``).  Empty (and free) when none asked."""
    rows, toks, ks, owners = [], [], [], []  # owners[i]: (seq, 0 prompt / 1 sampled)
    row, sampled = 0, iter(tokens)
    for s in out.scheduled:
        params, seq = s.seq.request.params, s.seq
        for j in range(s.prompt_logit_rows):  # prompt token at position p + 1, scored on row p
            p = s.start + s.num_tokens - s.prompt_logit_rows - (1 if s.samples else 0) + j
            rows.append(row + j)
            toks.append(seq.token_ids[p + 1])
            ks.append(params.prompt_logprobs)
            owners.append((seq, 0))
        if s.samples:
            drawn = next(sampled)
            if params.logprobs is not None:
                first = row + s.prompt_logit_rows
                for j, t in enumerate(drawn):  # a draft chunk: token j on row j; a forking parent: n from one row
                    rows.append(first + (j if s.drafts else 0))
                    toks.append(t)
                    ks.append(params.logprobs)
                    owners.append((seq, 1))
        row += s.num_logit_rows
    result: StepLogprobs = {}
    if not rows:
        return result
    for (seq, kind), entry in zip(owners, token_logprobs(logits[rows], toks, ks), strict=True):
        result.setdefault(seq, ([], []))[kind].append(entry)
    return result


def as_dict(entry: TokenLogprobs, decode) -> dict[int, Logprob]:
    """vLLM's per-position shape: ``{token_id: Logprob(logprob, rank, decoded_token)}``, the scored token first,
    then the top k by rank (the scored token once, when it is among them).  ``decode``: id -> text, or None."""
    d = {entry.token: Logprob(entry.logprob, entry.rank, decode(entry.token) if decode else None)}
    for rank, (tid, lp) in enumerate(entry.top, start=1):
        if tid not in d:
            d[tid] = Logprob(lp, rank, decode(tid) if decode else None)
    return d


def stop_token_text_dropped(params, token: int, eos_token_ids) -> bool:
    """Whether a token that stopped its sequence stays out of the text: an EOS (unless ``ignore_eos``), or one of
    ``stop_token_ids`` unless ``include_stop_str_in_output`` (vLLM's rule)."""
    return ((token in eos_token_ids and not params.ignore_eos)
            or (token in params.stop_token_ids and not params.include_stop_str_in_output))


def stop_reason(seq: Sequence) -> int | None:
    """The ``stop_token_ids`` entry that ended ``seq`` (vLLM's ``stop_reason`` for a stop token), else None."""
    out = seq.output
    if seq.finish_reason == "stop" and out and out[-1] in seq.request.params.stop_token_ids:
        return out[-1]
    return None
