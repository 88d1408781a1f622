"""``python -m minillm generate | chat | serve | bench | eval | roofline | make-model``."""

from __future__ import annotations

import argparse
import sys
import time

from minillm.entrypoints.arg_utils import (
    Option,
    add_options,
    engine_kwargs,
    engine_options,
    given,
    model_options,
    sampling_options,
    to_argv,
)
from minillm.entrypoints.openai.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_STALL_TIMEOUT_S,
    DEFAULT_TIMEOUT_HEADERS_S,
    DEFAULT_TIMEOUT_KEEP_ALIVE_S,
)
from minillm.models.configs import SHAPES
from minillm.models.synthetic import GGUF_FORMATS, HF_DTYPES, LLAMA_QUANTIZED, VOCABS
from minillm.sampling.params import SamplingParams

# run_server's options that each ``serve --replicas`` replica gets too (the front's own: host, port, routing)
SERVER_OPTIONS = (
    Option("api_key", "require 'Authorization: Bearer KEY' on /v1 and every request with a body (visible in ps: "
                      "prefer --api-key-file or the MINILLM_API_KEY environment variable)"),
    Option("api_key_file", "as --api-key, the key read from this file (its first line)", metavar="PATH"),
    Option("max_body_bytes", "larger request bodies get 413, counted as they arrive (chunked too)", type=int,
           default=DEFAULT_MAX_BODY_BYTES),
    Option("timeout_keep_alive", "seconds an idle keep-alive connection stays open", type=float,
           default=DEFAULT_TIMEOUT_KEEP_ALIVE_S),
    Option("timeout_headers", "seconds a client has to send a request's headers (and the most a body may pause) "
                              "before it is dropped", type=float,
           default=DEFAULT_TIMEOUT_HEADERS_S),
    Option("max_header_bytes", "the most bytes of request line and headers (431 past it)", type=int,
           default=DEFAULT_MAX_HEADER_BYTES),
    Option("allowed_hosts", "answer only requests whose Host header names HOST (default: any) — a guard "
                            "against DNS rebinding for a server on loopback", action="append", metavar="HOST"),
    Option("stall_timeout", "/health answers 503 once the engine's current step has run this many seconds (a "
                            "liveness probe's signal to restart)", type=float, default=DEFAULT_STALL_TIMEOUT_S),
    Option("max_queue", "sequences (prompts × n) that may wait beyond --max-num-seqs; more get 429", type=int,
           default=64),
    Option("shutdown_timeout", "seconds in-flight requests may run on after SIGTERM before they are aborted",
           type=float, default=10.0),
    Option("ttft_slo_ms", "load shedding: answer 429 'overloaded' (with Retry-After) at once to a request whose "
                          "estimated time to first token — prompt tokens queued ahead + its own at the measured "
                          "prefill rate, plus a step — exceeds MS (default: off, admit by --max-queue only)",
           type=float, metavar="MS"),
)


def _engine_args(p: argparse.ArgumentParser, *, max_tokens: int | None = None) -> None:
    """The model and engine options (and with ``max_tokens``, the sampling ones), in their help sections."""
    add_options(p.add_argument_group("model"), model_options())
    add_options(p.add_argument_group("engine (EngineConfig)"), engine_options())
    if max_tokens is not None:  # the command line samples greedily unless told otherwise
        add_options(p.add_argument_group("sampling (SamplingParams)"), sampling_options(),
                    {"max_tokens": max_tokens, "temperature": 0.0})


def _params(a):
    return SamplingParams(**given(a, sampling_options()))


def _llm(a, model):
    from minillm.llm import LLM

    return LLM(model, dtype=a.dtype, device=a.device, kernels=a.kernels, quantization=a.quantization,
               **engine_kwargs(a))


def _stream_reply(llm, prompt, params, out=sys.stdout):
    """Stream one reply to ``out``; return (its text, its RequestMetrics from the last update)."""
    text, metrics = [], None
    for update in llm.stream([prompt], params):
        if update.finish_reason == "error":
            raise RuntimeError(f"generation failed: {update.error}")
        out.write(update.text)
        out.flush()
        text.append(update.text)
        if update.finished:
            metrics = update.metrics
    out.write("\n")
    return "".join(text), metrics


def _print_metrics(llm, m, out=sys.stderr) -> None:
    """TTFT, TPOT and decode rate of one reply, and the memory bandwidth its decode achieved (MBU): the bytes of one
    decode step with the weights as the model stores them (packed when quantized, ``weight_bytes_per_step``)."""
    from minillm.perf.bench.quant import weight_bytes_per_step
    from minillm.perf.machine import machine_spec
    from minillm.perf.roofline import decode_step_cost

    line = (f"[{m.prompt_tokens} prompt + {m.output_tokens} output tokens] TTFT {m.ttft_s * 1e3:.0f} ms | "
            f"TPOT {m.tpot_s * 1e3:.1f} ms | decode {m.decode_tokens_per_s:.1f} tok/s")
    if m.output_tokens > 1:
        spec = machine_spec(str(llm.model.device), quick=True)
        bw = spec.memory_bandwidth
        step = decode_step_cost(llm.model.config, batch=1, kv_len=m.prompt_tokens + m.output_tokens // 2,
                                dtype=llm.model.dtype)
        nbytes = step.bytes - step.breakdown["weights"] + weight_bytes_per_step(llm.model)
        achieved = nbytes * m.decode_tokens_per_s
        line += f" | {achieved / 1e9:.1f} GB/s = MBU {achieved / bw:.0%} of {bw / 1e9:.1f} GB/s measured"
    print(line, file=out)


def cmd_generate(a) -> int:
    params = _params(a)  # a bad sampling value is reported before the model loads
    t0 = time.perf_counter()
    llm = _llm(a, a.model)
    print(f"[loaded in {time.perf_counter() - t0:.1f} s: {llm.model.config.model_type}, "
          f"{llm.model.config.num_parameters() / 1e6:.0f}M params, {llm.model.dtype}, {llm.model.device}]",
          file=sys.stderr)
    prompt = llm.apply_chat_template([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    _, metrics = _stream_reply(llm, prompt, params)
    _print_metrics(llm, metrics)
    return 0


def cmd_chat(a) -> int:
    params = _params(a)  # a bad sampling value is reported before the model loads
    llm = _llm(a, a.model)
    history: list[dict] = []
    if a.system:
        history.append({"role": "system", "content": a.system})
    print("minillm chat — type a message; /reset clears the history, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history = history[:1] if a.system else []
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        sys.stdout.write("assistant> ")
        try:
            reply, metrics = _stream_reply(llm, llm.apply_chat_template(history), params)
        except ValueError as e:  # e.g. the conversation outgrew the context: say so and keep chatting
            print(f"error: {e} (use /reset)", file=sys.stderr)
            history.pop()
            continue
        history.append({"role": "assistant", "content": reply})
        if a.metrics:
            _print_metrics(llm, metrics)


def _replica_args(a) -> list[str]:
    """The serve options each replica gets: every model, engine and server option given, not the front's host,
    port or routing, nor the API key (the front passes it in the environment)."""
    model = a.model_path or a.model
    options = [o for o in (*model_options(), *engine_options(), *SERVER_OPTIONS)
               if o.dest not in ("model", "api_key", "api_key_file", "allowed_hosts")]  # the front's
    return ([model] if model else []) + to_argv(a, options)


def api_key(a, environ=None) -> str | None:
    """The server's key: ``--api-key``, else the first line of ``--api-key-file``, else ``$MINILLM_API_KEY``,
    else None (no key required)."""
    import os

    from minillm.entrypoints.openai.replicas import API_KEY_ENV

    if a.api_key is not None:
        return a.api_key
    if a.api_key_file is not None:
        with open(a.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"--api-key-file {a.api_key_file} is empty: write the key on its first line")
        return key
    return (os.environ if environ is None else environ).get(API_KEY_ENV) or None


def _connection_limits(a):
    from minillm.entrypoints.openai.connections import ConnectionLimits

    return ConnectionLimits(timeout_keep_alive_s=a.timeout_keep_alive, timeout_headers_s=a.timeout_headers,
                            max_header_bytes=a.max_header_bytes)


def cmd_serve(a) -> int:
    if a.replicas is not None and a.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {a.replicas}")
    if a.replicas is not None and a.replicas > 1:  # a router in front of N single servers (openai/router.py)
        from minillm.entrypoints.openai.router import run_router

        run_router(_replica_args(a), replicas=a.replicas, routing=a.routing, host=a.host, port=a.port,
                   shutdown_timeout_s=a.shutdown_timeout, log_level=a.log_level, api_key=api_key(a),
                   max_body_bytes=a.max_body_bytes, uvicorn_options=_connection_limits(a).uvicorn_options(),
                   allowed_hosts=a.allowed_hosts)
        return 0
    from minillm.entrypoints.openai.server import DEFAULT_MODEL_NAME, run_server

    model = a.model_path or a.model
    key, limits = api_key(a), _connection_limits(a)  # bad values fail before the model loads
    llm = _llm(a, model)
    print(f"[serving {model or DEFAULT_MODEL_NAME} ({llm.model.dtype}, {llm.model.device}) on "
          f"http://{a.host}:{a.port}/v1]", file=sys.stderr)
    run_server(llm, host=a.host, port=a.port, api_key=key, max_queue=a.max_queue, max_body_bytes=a.max_body_bytes,
               connection_limits=limits, stall_timeout_s=a.stall_timeout, allowed_hosts=a.allowed_hosts,
               ttft_slo_s=None if a.ttft_slo_ms is None else a.ttft_slo_ms / 1e3, shutdown_timeout_s=a.shutdown_timeout,
               served_model_name=str(model) if model else DEFAULT_MODEL_NAME, log_level=a.log_level)
    return 0


def cmd_bench(a) -> int:
    if a.what == "decode":
        from minillm.perf.bench.decode import bench_decode

        bench_decode(a.model, dtypes=tuple(a.dtypes.split(",")) if a.dtypes else None, n_tokens=a.tokens,
                     repeats=a.repeats, device=a.device)
    elif a.what == "attention":
        from minillm.perf.bench.attention import bench_attention

        bench_attention(a.device)
    elif a.what == "serving":
        from minillm.perf.bench.serving import bench_serving

        bench_serving(a.model, device=a.device, threads=a.threads, quick=a.quick)
    elif a.what == "spec":
        from minillm.perf.bench.spec import bench_spec

        bench_spec(a.model, device=a.device, n_tokens=a.tokens, repeats=a.repeats)
    elif a.what == "tp":
        from minillm.perf.bench.tp import bench_tp

        bench_tp(n_tokens=a.tokens, repeats=a.repeats)
    elif a.what == "disagg":
        from minillm.perf.bench.disagg import bench_disagg

        bench_disagg(quick=a.quick)
    elif a.what == "guided":
        from minillm.perf.bench.guided import bench_guided

        bench_guided(tokens=a.tokens)
    elif a.what == "serve":  # main() hands "bench serve ..." to the load generator's own parser
        from minillm.entrypoints.bench_serve import bench_serve_main

        return bench_serve_main([])
    elif a.what == "cpu-peers":
        from minillm.perf.bench.cpu_peers import FORMATS, PROMPT_LENS, bench_cpu_peers

        bench_cpu_peers(shapes=_csv(a.shapes) or ("llama-3.2-1b",), formats=_csv(a.formats) or FORMATS,
                        prompt_lens=tuple(_ints(a.prompt_lens, "--prompt-lens")) or PROMPT_LENS, threads=a.threads,
                        repeats=a.repeats, n_tokens=a.tokens, models_dir=a.models_dir, out=a.out,
                        neighbour=a.neighbour, vocab=a.vocab)
    elif a.what == "quant":
        from minillm.perf.bench.quant import SCHEMES, bench_quant

        bench_quant(a.model, device=a.device, n_tokens=a.tokens, repeats=a.repeats, ppl_tokens=a.ppl_tokens,
                    schemes=tuple(a.schemes.split(",")) if a.schemes else SCHEMES, prefill_len=a.prefill_len,
                    batch=a.batch)
    return 0


# make-model's options (models.synthetic.make_model's arguments)
MAKE_MODEL_OPTIONS = (
    Option("shape", "the published model whose shape to copy (required)", choices=tuple(SHAPES)),
    Option("out", "directory to write (created): HF config.json + safetensors + tokenizer, and the GGUFs (required)"),
    Option("gguf", f"comma-separated GGUF formats to write too: {', '.join(GGUF_FORMATS)}, or "
                   f"{', '.join(LLAMA_QUANTIZED)} through llama.cpp's quantizer (llama-cpp-python) (default: none)"),
    Option("dtype", "the safetensors' dtype", choices=HF_DTYPES, default="bfloat16"),
    Option("seed", "seed of the random weights", type=int, default=0),
    Option("vocab", "the vocabulary's size: the default tokenizer's (49152) or the shape's own (Llama-3's 128256: "
                    "the default tokenizer padded with reserved special tokens)", choices=VOCABS, default="default"),
)


def cmd_make_model(a) -> int:
    from minillm.models.synthetic import make_model, print_report

    for o in MAKE_MODEL_OPTIONS[:2]:
        if getattr(a, o.dest) is None:
            raise ValueError(f"make-model needs {o.flag} (e.g. make-model --shape llama-3.2-1b --out DIR)")
    formats = tuple(f.strip().lower() for f in a.gguf.split(",") if f.strip()) if a.gguf else ()
    print_report(make_model(a.shape, a.out, gguf=formats, dtype=a.dtype, seed=a.seed, vocab=a.vocab))
    return 0


def _csv(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip()) if text else ()


def _ints(text: str | None, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in _csv(text))
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers (e.g. 128,512), got {text!r}") from None


def cmd_eval(a) -> int:
    from minillm.models.loader import load_model, load_tokenizer
    from minillm.perf.perplexity import heldout_token_ids, perplexity

    if a.what == "outliers":
        return _eval_outliers(a)
    if a.what == "long-context":
        return _eval_long_context(a)
    config = None if a.alpha is None else {"alpha": a.alpha}
    model = load_model(a.model, dtype=a.dtype, device=a.device, kernels=a.kernels, quantization=a.quantization,
                       quantization_config=config)
    ids = heldout_token_ids(load_tokenizer(a.model), "evaluation", a.max_tokens)
    t0 = time.perf_counter()
    r = perplexity(model, ids, window=a.window, stride=a.stride, kv_cache_dtype=a.kv_cache_dtype)
    print(f"perplexity {r.ppl:.4f} (nll {r.nll:.4f} nats/token) over {r.num_tokens} held-out tokens of "
          f"pydoc_data.topics; {a.quantization or 'no'} quantization{'' if config is None else ' ' + str(config)}"
          f", KV {a.kv_cache_dtype}, {model.dtype}, "
          f"{model.device}, "
          f"window {a.window} stride {a.stride}, {time.perf_counter() - t0:.1f} s")
    return 0


def _eval_long_context(a) -> int:
    """Perplexity of the first N held-out tokens through the engine per eviction policy (full, window, sinks +
    window, H2O), the KV bytes each holds and reads per decode token, and the decode rate after the long prompt."""
    import json

    from minillm.models import loader
    from minillm.perf import perplexity as ppl
    from minillm.perf.long_context import POLICIES, format_table, long_context_eval

    policies = POLICIES if a.policies is None else tuple(dict.fromkeys(x.strip() for x in a.policies.split(",")
                                                                        if x.strip()))
    if not policies or any(x not in POLICIES for x in policies):
        raise ValueError(f"--policies {a.policies!r}: each must be one of {', '.join(POLICIES)} "
                         f"(comma-separated, e.g. --policies full,sinks)")
    model = loader.load_model(a.model, dtype=a.dtype, device=a.device, kernels=a.kernels,
                              quantization=a.quantization)
    n = min(a.max_tokens or 8192, model.config.max_position_embeddings - a.decode_tokens)
    ids = ppl.heldout_token_ids(loader.load_tokenizer(a.model), "evaluation", n)
    rows = long_context_eval(model, ids, window_tokens=a.window_tokens, sink_tokens=a.sink_tokens,
                             heavy_tokens=a.heavy_tokens, policies=policies,
                             block_size=a.block_size, chunk_tokens=a.chunk_tokens, decode_tokens=a.decode_tokens,
                             engine_config={"kv_cache_dtype": a.kv_cache_dtype})
    print(f"long context: {ids.numel()} held-out tokens of pydoc_data.topics through the engine, {model.dtype}, "
          f"{model.device}, block {a.block_size}, then {a.decode_tokens} decode tokens")
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "device": str(model.device), "dtype": str(model.dtype),
                       "rows": [r.as_dict() for r in rows]}, f, indent=2)
    return 0


def _eval_outliers(a) -> int:
    """Per decoder linear: max / median over input channels of max|x_j| on the calibration split, before and after
    SmoothQuant's folding at ``--alpha`` (o_proj is left unsmoothed: its two columns match)."""
    from minillm.models.loader import load_model, load_tokenizer
    from minillm.quant.calibrate import calibration_token_ids
    from minillm.quant.smooth import DEFAULT_ALPHA, activation_absmax, outlier_ratios, smooth_model

    alpha = DEFAULT_ALPHA if a.alpha is None else a.alpha
    model = load_model(a.model, dtype=a.dtype, device=a.device, kernels=a.kernels)
    ids = calibration_token_ids(load_tokenizer(a.model)).to(model.device)
    before = activation_absmax(model, ids)
    after = outlier_ratios(smooth_model(model, before, alpha))
    print(f"input channel max|x| / median, calibration split, {ids.numel()} tokens; smoothed at alpha {alpha}")
    print(f"{'linear':<36}{'before':>10}{'after':>10}")
    for name, ratio in outlier_ratios(before).items():
        print(f"{name.removeprefix('model.'):<36}{ratio:>10.1f}{after[name]:>10.1f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minillm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a completion, then print TTFT, TPOT, tok/s and MBU")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _engine_args(g, max_tokens=128)
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="interactive chat with streaming replies")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--metrics", action="store_true", help="print TTFT/TPOT after each reply")
    _engine_args(c, max_tokens=256)
    c.set_defaults(fn=cmd_chat)
    _serve_parser(sub)
    _bench_parser(sub)
    e = sub.add_parser("eval", help="evaluate a model: perplexity on held-out text (pydoc_data.topics); outliers: "
                                    "activation outlier ratios per linear before/after SmoothQuant")
    e.add_argument("what", choices=["perplexity", "outliers", "long-context"])
    add_options(e.add_argument_group("model"), model_options())
    e.add_argument("--max-tokens", type=int, default=None, help="score only the first N held-out tokens "
                                                               "(long-context: default 8192, capped by the model)")
    lc = e.add_argument_group("long-context (perplexity through the engine per KV eviction policy)")
    lc.add_argument("--chunk-tokens", type=int, default=None, help="prefill chunk (default: window / 4, so blocks "
                                                                   "are evicted while the prompt is read)")
    lc.add_argument("--decode-tokens", type=int, default=32, help="greedy decode after the text: the tok/s row")
    lc.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    lc.add_argument("--policies", default=None, help="comma-separated eviction policies to run, of full, window, "
                                                      "sinks, h2o (default: all four)")
    e.add_argument("--window", type=int, default=512)
    e.add_argument("--stride", type=int, default=256)
    e.add_argument("--alpha", type=float, default=None, help="SmoothQuant's migration strength in [0, 1] for "
                                                             "--quantization w8a8-smooth and outliers (default 0.5)")
    add_options(lc, [o for o in engine_options()
                     if o.dest in ("block_size", "sink_tokens", "window_tokens", "heavy_tokens")],
                {"block_size": 16, "sink_tokens": 4, "window_tokens": 1024, "heavy_tokens": 1024})
    add_options(e, [o for o in engine_options() if o.dest == "kv_cache_dtype"], {"kv_cache_dtype": "auto"})
    e.set_defaults(fn=cmd_eval)
    m = sub.add_parser("make-model", help="write a checkpoint with a published model's shape and seeded random "
                                          "weights (HF directory + GGUF files; no download)")
    add_options(m, MAKE_MODEL_OPTIONS)
    m.set_defaults(fn=cmd_make_model)
    sub.add_parser("roofline", help="this machine's measured peaks (cached per machine; --remeasure to measure "
                                    "again) and the reference specs (options: --device, --quick, --remeasure, "
                                    "--runs N, --json PATH)")
    return p


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    s.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="as --model")
    _engine_args(s)
    server = s.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="0.0.0.0 to listen on every interface (default: loopback)")
    server.add_argument("--port", type=int, default=8000)
    add_options(server, SERVER_OPTIONS)
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    router = s.add_argument_group("replicas (a router in front of N servers)")
    router.add_argument("--replicas", type=int, default=None, help="N > 1: N server processes (a model each, the "
                                                                    "cores split among them) behind a router on --port")
    router.add_argument("--routing", default="least_loaded", choices=["least_loaded", "round_robin"],
                        help="with --replicas: least_loaded (fewest requests in flight) or round_robin")
    s.set_defaults(fn=cmd_serve)


def _bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="side-by-side benchmarks (decode | attention | serving | quant | spec | tp | "
                                     "disagg | cpu-peers | guided: the structured-output mask per step | serve: a "
                                     "load generator for any OpenAI server, 'bench serve --help')")
    b.add_argument("what", choices=["decode", "attention", "serving", "quant", "spec", "serve", "tp", "disagg",
                                    "cpu-peers", "guided"])
    add_options(b, [o for o in model_options() if o.dest in ("model", "device")])
    b.add_argument("--dtypes", default=None, help="decode: comma-separated (default bfloat16 on CUDA, float32 on CPU)")
    b.add_argument("--tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--threads", type=int, default=None, help="torch threads (serving, cpu-peers: llama.cpp's too; "
                                                              "default: torch's)")
    b.add_argument("--quick", action="store_true", help="serving: a small trace (~1 min); disagg: N = 4 only")
    b.add_argument("--ppl-tokens", type=int, default=2048, help="quant: held-out tokens for perplexity (0: skip)")
    b.add_argument("--schemes", default=None, help="quant: comma-separated weight schemes (default: all of "
                                                   "perf.bench.quant.SCHEMES)")
    b.add_argument("--prefill-len", type=int, default=256, help="quant: prompt tokens of the prefill row")
    b.add_argument("--batch", type=int, default=8, help="quant: sequences of the batched decode row")
    peers = b.add_argument_group("cpu-peers (minillm beside llama.cpp and transformers at published shapes)")
    peers.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: "
                                                      "llama-3.2-1b); made once by make-model under --models-dir")
    peers.add_argument("--formats", default=None, help="comma-separated, of fp32, bf16, q8_0, q4_1, q4_0, q4_k_m "
                                                       "(default: all)")
    peers.add_argument("--prompt-lens", default=None, help="prefill prompt lengths (default: 128,512,2048)")
    peers.add_argument("--vocab", default="default", choices=VOCABS,
                       help="the checkpoints' vocabulary: the default tokenizer's 49152 tokens or each shape's own "
                            "(Llama-3's 128256, kept in SHAPE-vocabN/ beside the default ones) (default: default)")
    peers.add_argument("--models-dir", default=None, help="where the shapes' checkpoints are made and kept "
                                                          "(default: the minillm cache's shapes/)")
    peers.add_argument("--out", default=None, help="the JSON file to write (default: "
                                                   "benchmarks/results/cpu-peers.json)")
    peers.add_argument("--neighbour", default="none",
                       help="none | copy | compute: a separate process on the same cores during the measurement, "
                            "copy a STREAM-like loop over 2 x 256 MB, compute a busy loop (default: none)")
    b.set_defaults(fn=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["roofline"]:  # its options belong to roofline.main (argparse REMAINDER would eat them)
        from minillm.perf.roofline import main as roofline_main

        return roofline_main(argv[1:]) or 0
    if argv[:2] == ["bench", "serve"]:  # its options belong to the load generator
        from minillm.entrypoints.bench_serve import bench_serve_main

        return bench_serve_main(argv[2:])
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
