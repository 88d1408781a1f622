"""``serve --replicas 2``: real processes — a front (the router) and two ordinary servers — driven by ``openai``.

The model is a tiny random Llama saved to a directory (as the server tests build it), so each replica loads in a
moment; what is slow is three Python processes importing torch on a loaded host, so one front is started for the
whole module.  The tests that break it run last, in file order: a replica killed with requests in flight, then
SIGTERM on the front.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from minillm.entrypoints.cli import main as cli_main  # noqa: E402
from minillm.entrypoints.openai.router import Replica, ReplicaPool, relabel  # noqa: E402
from minillm.models.loader import load_tokenizer  # noqa: E402

CONTEXT = 2048  # a max-length request is still running whenever a test looks


class Front:
    """``python -m minillm serve DIR --replicas 2`` on a free port; its output (and its replicas') goes to a file."""

    def __init__(self, model_dir, log_path):
        self.model, self.log_path = str(model_dir), log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minillm", "serve", self.model, "--replicas", "2", "--port", "0", "--dtype",
             "float32", "--device", "cpu", "--shutdown-timeout", "0.5", "--max-num-seqs", "8"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
        try:
            self.url = self._wait_for_listen(time.monotonic() + 240)
        except BaseException:  # the fixture's teardown never runs for a front that failed here: end it (its
            self.proc.kill()   # replicas die with their parent), so a failed start leaves no servers behind
            self.proc.wait(30)
            self.log.close()
            raise

    def _wait_for_listen(self, deadline: float) -> str:
        while True:
            m = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", self.log_path.read_text())
            if m:
                return m.group(1)
            assert self.proc.poll() is None, f"the front exited:\n{self.log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the front never listened:\n{self.log_path.read_text()[-3000:]}"
            time.sleep(0.1)

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def replica_pids(self) -> dict[int, int]:
        return {int(i): int(pid) for pid, i in
                re.findall(r'^minillm_router_replica_info\{pid="(\d+)",replica="(\d)"', self.metrics(), re.M)}


def value(text: str, name: str, **labels) -> float:
    """The sample ``name`` whose labels include ``labels``."""
    for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == str(v) for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"{name}{labels} missing from /metrics")


def gone(pid: int) -> bool:
    """The process has exited and been reaped (a zombie still counts as a leftover)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "X"
    except FileNotFoundError:
        return True


def wait_for(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    d = tmp_path_factory.mktemp("replicas")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                      eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(cfg).eval().save_pretrained(d / "tiny")
    load_tokenizer(None).save_pretrained(d / "tiny")
    f = Front(d / "tiny", d / "front.log")
    f.pids = f.replica_pids()
    yield f
    for pid in [f.proc.pid, *f.pids.values()]:  # whatever a failed test left behind
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
    f.proc.wait(30)
    f.log.close()


# ---- without processes ----------------------------------------------------------------------------------------------
def test_least_loaded_picks_the_replica_with_fewest_in_flight_and_breaks_ties_in_turn():
    a, b, c = Replica(0, "http://a"), Replica(1, "http://b"), Replica(2, "http://c")
    pool = ReplicaPool([a, b, c])
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 1
    assert [pool.pick() for _ in range(3)] == [b, b, b]
    b.in_flight = 2
    assert {pool.pick().index for _ in range(6)} == {2}
    c.in_flight = 2
    assert {pool.pick().index for _ in range(6)} == {0, 1, 2}  # all equal: each in turn


def test_round_robin_skips_replicas_out_of_rotation_and_none_left_is_none():
    reps = [Replica(i, f"http://{i}") for i in range(3)]
    pool = ReplicaPool(reps, "round_robin")
    assert [pool.pick().index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    reps[1].healthy = False
    assert {pool.pick().index for _ in range(4)} == {0, 2}
    reps[0].exited = reps[2].exited = True
    assert pool.pick() is None


def test_bad_routing_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="routing must be one of least_loaded, round_robin"):
        ReplicaPool([Replica(0, "http://a")], "random")


def test_relabel_merges_replica_metrics_under_one_help_line_each():
    text = ("# HELP minillm_kv_blocks_used KV blocks\n# TYPE minillm_kv_blocks_used gauge\n"
            "minillm_kv_blocks_used 3.0\n")
    out = relabel({0: text, 1: text.replace("3.0", "5.0")})
    assert out.count("# HELP minillm_kv_blocks_used") == 1
    assert 'minillm_kv_blocks_used{replica="0"} 3.0' in out and 'minillm_kv_blocks_used{replica="1"} 5.0' in out


def test_unreachable_replicas_leave_the_rotation_and_none_left_is_a_503():
    from fastapi.testclient import TestClient

    from minillm.entrypoints.openai.replicas import free_port
    from minillm.entrypoints.openai.router import build_router_app

    pool = ReplicaPool([Replica(i, f"http://127.0.0.1:{free_port()}") for i in range(2)])  # nothing listens
    with TestClient(build_router_app(pool)) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"  # both tried, both refused
        assert [rep.healthy for rep in pool.replicas] == [False, False]
        assert client.get("/health").status_code == 503
        text = client.get("/metrics").text
        assert value(text, "minillm_router_replica_failures_total", replica=0) == 1
        assert value(text, "minillm_router_replica_failures_total", replica=1) == 1


@pytest.mark.parametrize("n", ["0", "-2"])
def test_serve_with_zero_or_negative_replicas_is_a_clear_error_before_loading(n, capsys):
    assert cli_main(["serve", "--replicas", n]) == 2
    assert f"--replicas must be >= 1, got {n}" in capsys.readouterr().err


# ---- two replicas behind the front ---------------------------------------------------------------------------------
def test_two_replicas_answer_completions_and_chat_through_the_openai_client(front):
    client = front.client()
    assert client.models.list().data[0].id == front.model
    r = client.completions.create(model=front.model, prompt="The capital of France is", max_tokens=5,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text and r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    c = client.chat.completions.create(model=front.model, messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert c.choices[0].message.role == "assistant" and c.usage.completion_tokens == 4
    assert httpx.get(front.url + "/health").json() == {"status": "ok", "replicas_healthy": 2, "replicas": 2}


def test_replica_errors_come_back_with_their_status_and_openai_body(front):
    with pytest.raises(openai.NotFoundError) as e:
        front.client().completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        front.client().completions.create(model=front.model, prompt="x", max_tokens=1, temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_streamed_text_equals_the_non_streamed_text_at_temperature_0(front):
    client = front.client()
    kw = dict(model=front.model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
              temperature=0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 3  # relayed event by event, not as one blob
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 12
    kw = dict(model=front.model, prompt="Once upon a time", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == text


def test_sequential_requests_spread_over_both_replicas(front):
    before = front.metrics()
    seen = set()
    for _ in range(4):
        r = httpx.post(front.url + "/v1/completions", timeout=60, json={
            "model": front.model, "prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200
        seen.add(r.headers["x-minillm-replica"])
    after = front.metrics()
    assert seen == {"0", "1"}
    for i in (0, 1):
        sent = value(after, "minillm_router_requests_total", replica=i) - value(
            before, "minillm_router_requests_total", replica=i)
        assert sent == 2  # idle replicas are taken in turn
        # and each replica's own metrics, relabelled, saw them
        assert value(after, "minillm_http_requests_total", replica=i, path="/v1/completions", status=200) >= 2


def test_a_client_that_hangs_up_mid_stream_aborts_the_request_on_its_replica(front):
    body = {"model": front.model, "prompt": "A long story:", "max_tokens": CONTEXT - 10, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=front.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            replica = r.headers["x-minillm-replica"]
            events = (line for line in r.iter_lines() if line.startswith("data:"))
            for _ in range(3):
                next(events)
            text = front.metrics()
            assert value(text, "minillm_num_requests_in_flight", replica=replica) == 1
            tokens_before = value(text, "minillm_generation_tokens_total", replica=replica)
    # the router closed its upstream connection, so the replica aborted and freed the request's KV blocks
    def idle():
        text = front.metrics()
        return (value(text, "minillm_num_requests_in_flight", replica=replica) == 0
                and value(text, "minillm_kv_blocks_used", replica=replica) == 0
                and value(text, "minillm_router_requests_in_flight", replica=replica) == 0)

    wait_for(idle, what="the replica to abort the abandoned stream")
    # a request left to run on would have been counted with its ~2000 tokens when it finished
    assert value(front.metrics(), "minillm_generation_tokens_total", replica=replica) - tokens_before < 100


def test_a_non_streaming_client_that_hangs_up_aborts_the_request_on_its_replica(front):
    body = {"model": front.model, "prompt": "A long story:", "max_tokens": CONTEXT - 10, "ignore_eos": True}
    before = front.metrics()
    with pytest.raises(httpx.ReadTimeout):  # the answer sends nothing until it is done: the client gives up
        httpx.post(front.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))

    def idle():
        text = front.metrics()
        return all(value(text, "minillm_num_requests_in_flight", replica=i) == 0
                   and value(text, "minillm_router_requests_in_flight", replica=i) == 0 for i in (0, 1))

    wait_for(idle, what="the replica to abort the abandoned request")
    after = front.metrics()
    sent = sum(value(after, "minillm_router_requests_total", replica=i)
               - value(before, "minillm_router_requests_total", replica=i) for i in (0, 1))
    tokens = sum(value(after, "minillm_generation_tokens_total", replica=i)
                 - value(before, "minillm_generation_tokens_total", replica=i) for i in (0, 1))
    assert sent == 1 and tokens < 100  # forwarded, then stopped: its ~2000 tokens were never counted


# ---- breaking it (these run last) ----------------------------------------------------------------------------------
def test_killing_a_replica_fails_its_in_flight_requests_and_the_other_keeps_serving(front):
    long = {"model": front.model, "prompt": "A long story:", "max_tokens": CONTEXT - 10, "ignore_eos": True}
    with httpx.Client(base_url=front.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as s1, \
                client.stream("POST", "/v1/completions", json={**long, "stream": True}) as s2:
            assert {s1.headers["x-minillm-replica"], s2.headers["x-minillm-replica"]} == {"0", "1"}  # least loaded
            # a non-streamed request joins one of them; find which from the router's in-flight counts
            answer = {}
            t = threading.Thread(target=lambda: answer.update(r=httpx.post(front.url + "/v1/completions",
                                                                           json=long, timeout=60)))
            t.start()
            wait_for(lambda: sum(value(front.metrics(), "minillm_router_requests_in_flight", replica=i)
                                 for i in (0, 1)) == 3, what="three requests in flight")
            text = front.metrics()
            victim = max((0, 1), key=lambda i: value(text, "minillm_router_requests_in_flight", replica=i))
            dead, alive = (s1, s2) if s1.headers["x-minillm-replica"] == str(victim) else (s2, s1)
            os.kill(front.pids[victim], signal.SIGKILL)

            t.join(30)
            assert not t.is_alive(), "the non-streamed request on the killed replica hung"
            assert answer["r"].status_code == 502 and answer["r"].json()["error"]["type"] == "server_error"
            events = [line for line in dead.iter_lines() if line.startswith("data:")]  # ends, does not hang
            assert events[-1] == "data: [DONE]" and "error" in json.loads(events[-2][5:])
            # the survivor's stream goes on, and new requests all land on the survivor
            live_events = (line for line in alive.iter_lines() if line.startswith("data:"))
            for _ in range(3):
                assert json.loads(next(live_events)[5:])["choices"][0]["finish_reason"] is None
            for _ in range(4):
                r = front.client().completions.create(model=front.model, prompt="Still there?", max_tokens=3,
                                                      extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 3
    text = front.metrics()
    assert value(text, "minillm_router_replica_failures_total", replica=victim) >= 1
    assert value(text, "minillm_router_replica_healthy", replica=victim) == 0
    assert value(text, "minillm_router_replica_healthy", replica=1 - victim) == 1
    assert httpx.get(front.url + "/health").json()["replicas_healthy"] == 1
    front.victim = victim


def test_sigterm_on_the_front_ends_streams_stops_the_replicas_and_leaves_no_process(front):
    survivor = 1 - front.victim
    long = {"model": front.model, "prompt": "Go", "max_tokens": CONTEXT - 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", front.url + "/v1/completions", json=long, timeout=60) as r:
        lines = r.iter_lines()  # keep it: a dropped iterator closes the connection, which aborts
        next(lines)
        front.proc.send_signal(signal.SIGTERM)  # forwarded: the replica aborts the stream after 0.5 s and exits
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][5:])["choices"][0]["finish_reason"] == "abort"
    assert front.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    assert gone(front.pids[survivor]) and gone(front.pids[front.victim])
