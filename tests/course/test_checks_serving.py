"""Notebook 09's SSE chunking exercise (9.3): the library's solution passes its checker, the stub fails with its own
NotImplementedError, and the mistakes a student plausibly makes fail with a message that names them.
``WRONG_09`` also feeds ``test_checks.WRONG``."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from minillm.course import checks
from minillm.course.checks import EXERCISES
from minillm.entrypoints.openai.sse import StreamMeta, chunk, event
from minillm.outputs import StepOutput


def _role_chunks(meta):
    return [chunk(meta, [{"index": i, "delta": {"role": "assistant", "content": ""}}])
            for i in range(meta.num_choices)] if meta.chat else []


def _piece(meta, u, text, finish=True):
    body = {"delta": {"content": text}} if meta.chat else {"text": text}
    return chunk(meta, [{"index": u.index, **body, "finish_reason": u.finish_reason if finish else None}])


def _usage(meta, tokens):
    return chunk(meta, [], {"prompt_tokens": meta.prompt_tokens, "completion_tokens": tokens,
                            "total_tokens": meta.prompt_tokens + tokens})


async def _no_done(updates, meta):
    """Everything right but the closing [DONE]."""
    for e in _role_chunks(meta):
        yield e
    tokens = 0
    async for u in updates:
        tokens += len(u.token_ids)
        if u.text or u.finished:
            yield _piece(meta, u, u.text)
    if meta.include_usage:
        yield _usage(meta, tokens)


async def _cumulative_text(updates, meta):
    """Sends each choice's text so far instead of the step's new text."""
    for e in _role_chunks(meta):
        yield e
    so_far, tokens = {}, 0
    async for u in updates:
        tokens += len(u.token_ids)
        so_far[u.index] = so_far.get(u.index, "") + u.text
        if u.text or u.finished:
            yield _piece(meta, u, so_far[u.index])
    if meta.include_usage:
        yield _usage(meta, tokens)
    yield event("[DONE]")


async def _no_finish_reason(updates, meta):
    """Sends only the text; the finish reason never reaches the client."""
    for e in _role_chunks(meta):
        yield e
    tokens = 0
    async for u in updates:
        tokens += len(u.token_ids)
        if u.text:
            yield _piece(meta, u, u.text, finish=False)
    if meta.include_usage:
        yield _usage(meta, tokens)
    yield event("[DONE]")


async def _usage_always(updates, meta):
    """Ends with a usage chunk whether or not the client asked for one."""
    for e in _role_chunks(meta):
        yield e
    tokens = 0
    async for u in updates:
        tokens += len(u.token_ids)
        if u.text or u.finished:
            yield _piece(meta, u, u.text)
    yield _usage(meta, tokens)
    yield event("[DONE]")


async def _no_role_chunk(updates, meta):
    """Chat without the opening role delta."""
    tokens = 0
    async for u in updates:
        tokens += len(u.token_ids)
        if u.text or u.finished:
            yield _piece(meta, u, u.text)
    if meta.include_usage:
        yield _usage(meta, tokens)
    yield event("[DONE]")


async def _chunk_per_update(updates, meta):
    """One chunk for every update, held-back (empty) ones included."""
    for e in _role_chunks(meta):
        yield e
    tokens = 0
    async for u in updates:
        tokens += len(u.token_ids)
        yield _piece(meta, u, u.text)
    if meta.include_usage:
        yield _usage(meta, tokens)
    yield event("[DONE]")


async def _usage_counts_updates(updates, meta):
    """Counts one completion token per update (multi-token steps and held-back tokens miscounted)."""
    for e in _role_chunks(meta):
        yield e
    count = 0
    async for u in updates:
        count += 1
        if u.text or u.finished:
            yield _piece(meta, u, u.text)
    if meta.include_usage:
        yield _usage(meta, count)
    yield event("[DONE]")


def _sync_generator(updates, meta):
    """A plain generator: cannot read the server's async stream."""
    yield event("[DONE]")


def _vllm_flag_name():
    return {"max_num_seqs": 8, "enable_chunked_prefill": True}  # vLLM's name; minillm's field is chunked_prefill


WRONG_09 = {"9.3": _cumulative_text, "9.4": _vllm_flag_name}
MISTAKES = {
    _no_done: "[DONE]", _cumulative_text: "repeats earlier text", _no_finish_reason: "finish_reason",
    _usage_always: "did not ask", _no_role_chunk: "role chunk", _chunk_per_update: "no text and no finish_reason",
    _usage_counts_updates: "completion tokens", _sync_generator: "async generator",
}


def test_the_library_solution_passes(capsys, solution_copy):
    ex = EXERCISES["9.3"]
    ex.check(solution_copy(ex))
    assert "✓ Exercise 9.3 passed" in capsys.readouterr().out


def test_the_stub_fails_with_its_own_message():
    ex = EXERCISES["9.3"]
    with pytest.raises(NotImplementedError, match=r"^Exercise 9\.3: "):
        ex.check(ex.stub())


def test_an_answer_that_calls_the_library_fails():
    ex = EXERCISES["9.3"]
    with pytest.raises(checks.registry.LibrarySolutionCalled):
        ex.check(ex.delegate())


@pytest.mark.parametrize("wrong", list(MISTAKES), ids=[f.__name__ for f in MISTAKES])
def test_a_plausible_mistake_fails_with_a_message_naming_it(wrong, capsys):
    with pytest.raises(AssertionError) as info:
        checks.check_sse_stream(wrong)
    assert MISTAKES[wrong] in str(info.value) and "expected" in str(info.value), str(info.value)
    assert "passed" not in capsys.readouterr().out


def test_chat_stream_matches_openai_chunk_shapes_and_joins_to_the_text():
    """The library's events for a two-choice chat: role chunks, text pieces, finish, usage, [DONE] — parsed with
    the openai package's own types."""
    from openai.types.chat import ChatCompletionChunk

    meta = StreamMeta(id="chatcmpl-1", model="m", created=7, chat=True, num_choices=2, include_usage=True,
                      prompt_tokens=5)
    updates = [StepOutput("r", 0, [1], "Hel", None), StepOutput("r", 1, [2], "", None),
               StepOutput("r", 0, [3, 4], "lo", "stop"), StepOutput("r", 1, [5], "Yo", "length")]

    async def feed():
        for u in updates:
            yield u

    async def run():
        return [e async for e in EXERCISES["9.3"].answer()(feed(), meta)]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[len("data: "):])) for e in events[:-1]]
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts == {0: "Hello", 1: "Yo"}
    assert [c.choices[0].finish_reason for c in chunks[2:-1]] == [None, "stop", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.total_tokens == 10
    assert {(c.id, c.model, c.created) for c in chunks} == {("chatcmpl-1", "m", 7)}


def test_stream_meta_rejects_no_choices_and_negative_prompt_tokens():
    with pytest.raises(ValueError, match="num_choices"):
        StreamMeta(id="x", model="m", created=0, chat=True, num_choices=0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        StreamMeta(id="x", model="m", created=0, chat=False, prompt_tokens=-1)


# ---------------------------------------------------------------------------------------------- 9.4
def _report(label: str, ttfts: list[float], tpot: float):
    from minillm.perf.simulate import RequestRecord, build_report

    records = [RequestRecord(str(i), float(i), 10, 8, 0, 0.0, ttft, tpot, ttft + 7 * tpot, (tpot,) * 7)
               for i, ttft in enumerate(ttfts)]
    return build_report(label, records, ttft_slo_s=1.0, tpot_slo_s=0.1)


@pytest.mark.parametrize("knobs, says", [
    ([("max_num_seqs", 8)], "expected a dict"),
    ({"max_num_seqs": 8, "dtype": "float16"}, "unknown engine option(s) ['dtype']"),
    ({"max_num_seqs": 0}, "EngineConfig refuses"),
    ({"policy": "fifo"}, "EngineConfig refuses"),
])
def test_serving_knobs_fails_only_an_invalid_configuration(knobs, says):
    with pytest.raises(AssertionError, match=re.escape(says)):
        checks.check_serving_knobs(lambda: knobs)


def test_serving_knobs_reports_the_goodput_of_both_runs_and_never_fails_a_low_one(capsys):
    from minillm.course.conclusions import parse_conclusion

    seen = []

    def measure(options):
        seen.append(options)
        # the defaults: 3 of 4 requests within the SLO; the student's options: only 1 (a worse choice)
        return _report("x", [0.5, 0.5, 0.5, 3.0] if not options else [0.5, 3.0, 3.0, 3.0], 0.05)

    result = checks.check_serving_knobs(lambda: {"max_num_seqs": 64}, measure=measure)
    assert seen == [{}, {"max_num_seqs": 64}]
    assert result["default"].slo_attainment == 0.75 and result["tuned"].slo_attainment == 0.25
    out = capsys.readouterr().out
    line = next(c for c in map(parse_conclusion, out.splitlines()) if c is not None)  # a falsy one: not held
    assert not line.holds and line.value < line.reference  # stated from the values, not failed
    assert "✓ Exercise 9.4 passed" in out and "75% of requests within the SLO" in out


def test_serving_knobs_fails_options_under_which_the_trace_cannot_be_served():
    def measure(options):
        if options:
            raise ValueError("prompt of 300 tokens exceeds max_num_batched_tokens=64 with chunked_prefill=False")
        return _report("x", [0.5], 0.05)

    with pytest.raises(AssertionError, match="could not be served"):
        checks.check_serving_knobs(lambda: {"chunked_prefill": False, "max_num_batched_tokens": 64}, measure=measure)
