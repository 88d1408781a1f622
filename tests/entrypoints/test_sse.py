"""The server's SSE path without a network: ``sse_stream`` over made-up updates, and ``Server.events`` over fake
request streams (several prompts, a sample the server aborted, an engine that fails mid-stream)."""

import asyncio
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from minillm.entrypoints.openai.engine_loop import EngineFailed  # noqa: E402
from minillm.entrypoints.openai.metrics import ServerMetrics  # noqa: E402
from minillm.entrypoints.openai.server import Server  # noqa: E402
from minillm.entrypoints.openai.sse import StreamMeta, sse_stream  # noqa: E402
from minillm.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepOutput  # noqa: E402


class FakeStream:
    """A ``RequestStream``'s surface: yields ``updates``, then raises ``fail`` if given, else ends with ``output``."""

    def __init__(self, request_id, updates, output, fail=None):
        self.request_id, self.prompt_token_ids, self._updates = request_id, [1, 2, 3], updates
        self._output, self._fail, self.output, self.closed = output, fail, None, False

    async def __aiter__(self):
        for u in self._updates:
            await asyncio.sleep(0)
            yield u
        if self._fail is not None:
            raise self._fail
        self.output = self._output

    def close(self):
        self.closed = True


def _output(request_id, text, finish):
    sample = CompletionOutput(0, text, [7] * len(text), finish, RequestMetrics())
    return RequestOutput(request_id, [1, 2, 3], text, sample.token_ids, finish, RequestMetrics(), [sample])


def _events(agen) -> list:
    async def run():
        return [e async for e in agen]

    out = asyncio.run(run())
    return [e[len("data: "):-2] if e.endswith("[DONE]\n\n") else json.loads(e[len("data: "):]) for e in out]


def _server() -> Server:
    return Server(engine_loop=None, metrics=ServerMetrics(), model_names=["m"])


def test_a_batch_of_prompts_numbers_choices_prompt_major_and_ends_a_server_aborted_sample_with_abort():
    a = FakeStream("r-0", [StepOutput("r-0", 0, [7], "a", None), StepOutput("r-0", 0, [7], "b", "stop")],
                   _output("r-0", "ab", "stop"))
    b = FakeStream("r-1", [StepOutput("r-1", 0, [7], "x", None)], _output("r-1", "x", "abort"))  # no last update
    meta = StreamMeta(id="r", model="m", created=1, chat=False, num_choices=2, include_usage=True, prompt_tokens=6)
    events = _events(_server().events([a, b], meta, n=1))
    pieces = {(c["index"], c["text"], c["finish_reason"]) for e in events[:-2] for c in e["choices"]}
    assert pieces == {(0, "a", None), (0, "b", "stop"), (1, "x", None), (1, "", "abort")}
    assert events[-2]["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    assert events[-1] == "[DONE]" and a.closed and b.closed


def test_an_engine_failure_mid_stream_becomes_an_error_event_then_done():
    st = FakeStream("r", [StepOutput("r", 0, [7], "a", None)], None, fail=EngineFailed("the engine failed: boom"))
    meta = StreamMeta(id="r", model="m", created=1, chat=True, include_usage=True, prompt_tokens=3)
    events = _events(_server().events([st], meta, n=1))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[1]["choices"][0]["delta"]["content"] == "a"
    assert events[2]["error"]["message"] == "the engine failed: boom" and events[2]["error"]["type"] == "server_error"
    assert events[3:] == ["[DONE]"] and st.closed


def test_sse_stream_lets_an_exception_from_its_updates_through_without_done():
    async def updates():
        yield StepOutput("r", 0, [7], "a", None)
        raise EngineFailed("gone")

    meta = StreamMeta(id="r", model="m", created=1, chat=False)
    seen = []

    async def run():
        async for e in sse_stream(updates(), meta):
            seen.append(e)

    with pytest.raises(EngineFailed, match="gone"):
        asyncio.run(run())
    assert len(seen) == 1 and '"text":"a"' in seen[0]
