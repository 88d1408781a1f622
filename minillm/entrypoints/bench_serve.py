"""``python -m minillm bench serve``: the load generator's command line (``perf/bench/serve.py``) and, with
``--peers``, the servers started in turn and loaded on the same trace (``perf/bench/peers.py``).  It sits above both
modules, so neither imports the other's caller."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path


def _rates(text: str) -> list[float]:
    return [math.inf if r.strip() in ("inf", "infinity") else float(r) for r in text.split(",")]


def _slo(items: Sequence[str]) -> tuple[float, float]:
    """``["ttft:500", "tpot:100"]`` (milliseconds) -> (ttft_s, tpot_s)."""
    slo = {"ttft": 1000.0, "tpot": 200.0}
    for item in items:
        name, _, value = item.partition(":")
        if name not in slo or not value:
            raise ValueError(f"--goodput takes ttft:MS and/or tpot:MS, got {item!r}")
        slo[name] = float(value)
    return slo["ttft"] / 1e3, slo["tpot"] / 1e3


def bench_serve_parser() -> argparse.ArgumentParser:
    """``bench serve``'s own parser (its options are the load generator's, not the engine's)."""
    from minillm.perf.bench import serve

    p = argparse.ArgumentParser(prog="python -m minillm bench serve", description=serve.__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--request-rate", default="4", help="requests/s; a comma list sweeps rates; inf = all at once")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson; < 1 burstier (gamma gaps)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension): fixed lengths")
    p.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=None, help="every request's top_p (default: not sent)")
    p.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                   help="SLO for goodput, e.g. ttft:500 tpot:100 (default ttft:1000 tpot:200)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (client side)")
    p.add_argument("--overload", type=float, default=None, metavar="FACTOR",
                   help="after the sweep, run at FACTOR x the capacity (the highest swept rate that completed "
                        "every request with p99 TTFT within the --goodput ttft SLO) and report lost requests and "
                        "the admitted requests' p99 TTFT; e.g. --request-rate 0.5,1,1.5,2 --overload 2")
    p.add_argument("--api-key", default=None)
    p.add_argument("--result-dir", default=None, help="where the JSON goes (default benchmarks/results)")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--peers", default=None, metavar="NAMES",
                   help="start these servers in turn and measure each on the same trace instead of --base-url: "
                        "a comma list of minillm, transformers, llamacpp, vllm (perf/bench/peers.py; vllm runs "
                        "$VLLM_VENV/bin/vllm)")
    p.add_argument("--device", default="cpu", help="with --peers: the device every server runs on")
    p.add_argument("--dtype", default=None, help="with --peers: minillm's and vLLM's --dtype (default: minillm's "
                                                 "own; vLLM float32 on CPU, where it would run fp32 weights in bf16)")
    p.add_argument("--minillm-args", default="", metavar="ARGS",
                   help="with --peers: more options for minillm's server, one quoted string, e.g. "
                        "'--ttft-slo-ms 2000' (its SLO admission)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also run the same trace with every answer constrained to this JSON schema "
                        "(response_format json_schema) and report the cost two ways: as served (natural answer "
                        "lengths) and on equal work (ignore_eos, and an array of >= max-tokens items of the "
                        "schema: every answer max-tokens long)")
    return p


def _json_schema(path: str | None) -> dict | None:
    """``--json-schema FILE`` -> the schema (a JSON object); ValueError naming the file otherwise."""
    if path is None:
        return None
    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: cannot read a JSON schema ({e})") from e
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object, got {type(schema).__name__}")
    return schema


def bench_serve_main(argv: Sequence[str]) -> int:
    """``python -m minillm bench serve``: load the server at ``--base-url``; with ``--peers``, start each of those
    servers in turn and load them on the same trace (``peers.compare_servers``)."""
    from minillm.perf.bench.serve import bench_serve

    a = bench_serve_parser().parse_args(argv)
    try:
        ttft, tpot = _slo(a.goodput)
        schema = _json_schema(a.json_schema)
        if a.peers and schema is not None:
            raise ValueError("--json-schema measures one server (--base-url); drop --peers")
        if a.minillm_args and not a.peers:
            raise ValueError("--minillm-args are options for the minillm server --peers starts; with --base-url, "
                             "pass them to that server yourself")
        if a.peers:
            _bench_serve_peers(a, ttft, tpot)
            return 0
        bench_serve(a.base_url, _rates(a.request_rate), a.num_prompts, model=a.model, seed=a.seed,
                    max_tokens=a.max_tokens, endpoint=a.endpoint, burstiness=a.burstiness, ignore_eos=a.ignore_eos,
                    ttft_slo_s=ttft, tpot_slo_s=tpot, api_key=a.api_key, max_concurrency=a.max_concurrency,
                    overload=a.overload, progress=not a.no_progress, save=not a.no_save,
                    out_dir=Path(a.result_dir) if a.result_dir else None, json_schema=schema,
                    temperature=a.temperature, top_p=a.top_p)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _bench_serve_peers(a: argparse.Namespace, ttft_slo_s: float, tpot_slo_s: float) -> None:
    from minillm.perf.bench import peers  # starts server processes: imported only for --peers

    peers.compare_servers([p.strip() for p in a.peers.split(",") if p.strip()], _rates(a.request_rate),
                          a.num_prompts, device=a.device, dtype=a.dtype, minillm_args=shlex.split(a.minillm_args),
                          save=not a.no_save,
                          out_dir=Path(a.result_dir) if a.result_dir else None, seed=a.seed, max_tokens=a.max_tokens,
                          endpoint=a.endpoint, burstiness=a.burstiness, ignore_eos=a.ignore_eos,
                          ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, max_concurrency=a.max_concurrency,
                          overload=a.overload, progress=not a.no_progress, temperature=a.temperature, top_p=a.top_p)
