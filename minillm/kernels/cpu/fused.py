"""One native call per decode step for the whole decoder stack (``csrc/decode.c``), on CPU, fp32 activations.

Why: at batch 1 a decode token of SmolLM2-135M with int4 weights spends ~9 ms in its GEMVs and about as long in the
layer-by-layer Python around them (~120 ATen ops per layer: views, transposes, empty, ctypes wrappers and their
``supports()`` checks, module calls).  ``NativeDecodeRunner`` builds a C table of every layer's weight pointers once
and runs every layer in one call: (add +) RMSNorm, qkv, RoPE, K/V to their paged slots, paged attention, o_proj,
add + RMSNorm, gate_up, SiLU·mul, down, the final norm — the per-layer native path's own kernels in its own order,
so the hidden states equal ``model.hidden_states`` on the model's native kernels bit for bit.  The embedding
lookup and the LM head stay in Python (a handful of ops each, through the model's own modules).

It has the protocol of ``engine.cuda_graph.DecodeGraphRunner`` (``buckets``, ``decode(batch, num_padding)``), so
``ModelRunner`` runs decode-only steps through whichever the engine made; ``hidden(batch)`` is the general form
(several rows per sequence, each attending up to its own context length: speculative decoding's verify pass).

What it runs (``unsupported_reason`` says why not, and the engine then keeps the per-layer path): a ``Transformer``
of the plain Llama modules on CPU in fp32 whose kernel choice allows native code ("auto"/"native"), no sliding
window, every linear fp32 (``Linear``) or int8 / Q4_1 int4 (``QuantLinear``), an fp32 ``PagedKVCache`` (not a
quantized one), and the native libraries built here.  The C table holds raw pointers: if the model's tensors are
replaced afterwards (``.to()``, ``quantize_model``, a module swap), the next call notices (the ids and first
tensors' addresses of the final norm, the LM head and the first and last layers' modules are compared each call:
~20 attribute reads, a few µs — a swap of a middle layer alone is not seen) and rebuilds the table, or raises when
the model is no longer one it can run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from minillm.kernels.cpu import native
from minillm.kernels.cpu import quant as native_quant
from minillm.kernels.cpu.native import _cpu_key, cache_dir

MAX_ROWS = 32  # rows per call: native.c's GEMV tiles and the engine's decode batches (max_num_seqs default 32)
_CSRC = Path(__file__).parent / "csrc"
_SRC = _CSRC / "decode.c"
_INCLUDED = ("quant.c", "native.c")  # decode.c #includes these: part of the cache key
_KINDS = {"fp32": 0, "int8": 1, "int4": 2}
NATIVE_CHOICES = ("auto", "native")  # the model kernel choices under which the fused step may run

i64, vp = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):
    """csrc/decode.c ``linear_t``: kind, scale_f16, N, K, G, then weight, scales, mins, bias pointers."""

    _fields_ = [("kind", i64), ("scale_f16", i64), ("N", i64), ("K", i64), ("G", i64),
                ("w", vp), ("scales", vp), ("mins", vp), ("bias", vp)]


class _Layer(ctypes.Structure):
    """csrc/decode.c ``layer_t``: two norm weights, four linears, the layer's K and V caches."""

    _fields_ = [("input_norm", vp), ("post_norm", vp), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("k_cache", vp), ("v_cache", vp)]


def _source_digest() -> str:
    """decode.c and the files it includes: a change to any of them is a new library."""
    h = hashlib.sha256(_SRC.read_bytes())
    for name in _INCLUDED:
        h.update((_CSRC / name).read_bytes())
    return h.hexdigest()[:12]


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if os.environ.get("MINILLM_DISABLE_NATIVE"):
        return None
    path = cache_dir() / f"decode-{_source_digest()}-{_cpu_key()}.so"
    try:
        if not path.exists():
            native._compile(path, _SRC)  # native.c's compiler, flags and OpenMP fallback
        lib = ctypes.CDLL(str(path))  # after torch: its libgomp is the one torch loaded
    except (OSError, RuntimeError) as e:
        import warnings

        warnings.warn(f"minillm: fused native decode unavailable ({e}); using the per-layer path", stacklevel=2)
        return None
    p64, p32 = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int32)
    lib.decode_scratch_floats.argtypes = [i64] * 6
    lib.decode_scratch_floats.restype = i64
    lib.decode_stack.argtypes = [ctypes.POINTER(_Layer), i64, vp, vp, vp, vp, p64, p64, p32, p32] + [i64] * 8 \
        + [ctypes.c_float, ctypes.c_float, ctypes.POINTER(_Linear), vp, vp, vp]
    lib.decode_stack.restype = None
    lib.linear_stack.argtypes = [ctypes.POINTER(_Linear), i64, ctypes.POINTER(vp), ctypes.POINTER(vp), i64, i64]
    lib.linear_stack.restype = None
    lib.stack_read.argtypes = [ctypes.POINTER(_Linear), i64]
    lib.stack_read.restype = ctypes.c_uint64
    return lib


def available() -> bool:
    """Whether the fused decode library is built and loadable here (it needs a C compiler)."""
    return _lib() is not None


# ---------------------------------------------------------------------------------------------- what it can run
def _linear_kind(module) -> str | None:
    """"fp32" / "int8" / "int4" for a plain ``Linear`` or ``QuantLinear`` on CPU the C table can point at."""
    from minillm.layers.linear import Linear, QuantLinear
    from minillm.quant.weight import Int4Weight

    if type(module) is Linear:
        w, b = module.weight, module.bias
        ok = w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous()
        return "fp32" if ok and (b is None or b.dtype == torch.float32) else None
    if type(module) is QuantLinear:
        pw = module.packed_weight
        tensors = [getattr(pw, f) for f in ("packed", "scales", "mins", "qweight") if hasattr(pw, f)]
        b = module.bias
        ok = all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) \
            and (b is None or (b.dtype == torch.float32 and b.device.type == "cpu"))
        return ("int4" if isinstance(pw, Int4Weight) else "int8") if ok else None
    return None


def unsupported_reason(model, kv) -> str | None:
    """None when ``NativeDecodeRunner(model, kv)`` can run this model and cache; else why not (one sentence)."""
    from minillm.kv.paged_cache import PagedKVCache
    from minillm.layers.attention import Attention
    from minillm.layers.norm import RMSNorm
    from minillm.layers.rotary import RotaryEmbedding
    from minillm.models.llama import MLP, DecoderLayer, Transformer

    if not isinstance(model, Transformer):
        return f"not a minillm Transformer ({type(model).__name__})"
    if model.kernels not in NATIVE_CHOICES:
        return f"the model's kernels are {model.kernels!r} (the fused step is native code: 'auto' or 'native')"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"needs fp32 activations on CPU, the model is {model.dtype} on {model.device}"
    if type(kv) is not PagedKVCache or kv.dtype != torch.float32 or kv.k.device.type != "cpu":
        return "needs an fp32 PagedKVCache on CPU (kv_cache_dtype='auto'; not a quantized cache)"
    c = model.config
    if c.sliding_window is not None:
        return "sliding-window attention is not fused"
    if kv.k.shape[0] != c.num_layers or kv.k.shape[3:] != (c.num_kv_heads, c.head_dim):
        return "the KV cache's shape does not match the model"
    body = model.model
    if type(body.norm) is not RMSNorm or type(body.rotary_emb) is not RotaryEmbedding:
        return "the final norm or the rotary embedding is not the plain module"
    for i, layer in enumerate(body.layers):
        if type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention or type(layer.mlp) is not MLP \
                or type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return f"layer {i} is not the plain DecoderLayer (a swapped or parallel module)"
        if layer.self_attn.scale != c.head_dim**-0.5:
            return f"layer {i}'s attention scale is not head_dim**-0.5"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.eps != body.norm.eps or norm.weight.dtype != torch.float32:
                return f"layer {i}'s norms differ from the final norm's eps or dtype"
        for name, lin in _linears(layer):
            if _linear_kind(lin) is None:
                return f"layer {i}'s {name} is not an fp32 Linear or an int8/int4 QuantLinear on CPU"
    if not (native.available() and native_quant.available() and available()):
        return "the native libraries did not build here (no C compiler, or MINILLM_DISABLE_NATIVE)"
    return None


def supports(model, kv) -> bool:
    """Whether the fused decode step can run ``model`` over ``kv`` (see ``unsupported_reason``)."""
    return unsupported_reason(model, kv) is None


def _linears(layer) -> list[tuple[str, object]]:
    a, m = layer.self_attn, layer.mlp
    return [("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up_proj", m.gate_up_proj),
            ("down_proj", m.down_proj)]


def _watch_list(model) -> list[tuple[object, str]]:
    """(parent module, attribute) pairs whose value a swap replaces and whose tensors a move re-allocates: the final
    norm, the LM head, the first and last layers' norms and linears."""
    body = model.model
    n = len(body.layers)
    out = [(model, "model"), (body, "norm"), (model, "lm_head"), (body, "layers")]
    out += [(body.layers, str(i)) for i in sorted({0, n - 1}) if n]
    for layer in (body.layers[0], body.layers[-1]) if n else ():
        out += [(layer, "input_layernorm"), (layer, "post_attention_layernorm"), (layer.self_attn, "qkv_proj"),
                (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
    return out


def _first_tensor(module) -> Tensor | None:
    """The tensor whose address identifies a module's weight (its weight, or a packed linear's codes)."""
    w = module._parameters.get("weight")
    if w is None:
        w = next(iter(module._buffers.values()), None)  # QuantLinear: packed / qweight first
    return w


def _linear_struct(lin, keep: list[Tensor]) -> _Linear:
    """The ``linear_t`` of one layer; the tensors it points at are appended to ``keep`` (they must outlive it)."""
    kind = _linear_kind(lin)
    return _weight_struct(lin.weight if kind == "fp32" else lin.packed_weight, lin.bias, keep)


def _weight_struct(w, bias: Tensor | None, keep: list[Tensor]) -> _Linear:
    """The ``linear_t`` of a weight: an fp32 [N, K] tensor, an ``Int8Weight`` or an ``Int4Weight`` (contiguous, on
    CPU), and an optional fp32 bias [N]; the tensors it points at are appended to ``keep``."""
    from minillm.quant.weight import Int4Weight, Int8Weight

    if isinstance(w, Tensor):
        kind, (N, K) = "fp32", w.shape
        tensors, G, f16 = (w.detach(), None, None), K, 0
    else:
        kind = "int4" if isinstance(w, Int4Weight) else "int8" if isinstance(w, Int8Weight) else None
        if kind is None:
            raise ValueError(f"not an fp32 tensor, Int8Weight or Int4Weight: {type(w).__name__}")
        N, K = w.shape
        tensors = (w.packed, w.scales, w.mins) if kind == "int4" else (w.qweight, w.scales, None)
        G, f16 = w.group_size, int(w.scales.dtype == torch.float16)
    bias = None if bias is None else bias.detach().contiguous()
    keep += [t for t in (*tensors, bias) if t is not None]
    ptr = [None if t is None else t.data_ptr() for t in (*tensors, bias)]
    return _Linear(_KINDS[kind], f16, N, K, G, *ptr)


class NativeDecodeRunner:
    """The whole decoder stack of ``model`` as one native call per step over the paged cache ``kv``.

    ``max_rows`` (≤ ``MAX_ROWS``): the most rows one call takes (the engine passes its ``max_num_seqs``, capped);
    ``max_positions``: the RoPE table's length (grown when a later position needs more).  Scratch (~100 KB for
    SmolLM2 at 32 rows) and the RoPE tables are allocated here, once.  Raises ``ValueError`` naming the reason when
    ``unsupported_reason(model, kv)`` is not None.
    """

    def __init__(self, model, kv, *, max_rows: int = MAX_ROWS, max_positions: int | None = None):
        reason = unsupported_reason(model, kv)
        if reason is not None:
            raise ValueError(f"the fused native decode step cannot run this model: {reason}")
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows must be in [1, {MAX_ROWS}], got {max_rows}")
        self.model, self.kv, self.max_rows = model, kv, max_rows
        c = model.config
        self._dims = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)
        self._scratch = torch.empty(_lib().decode_scratch_floats(max_rows, *self._dims), dtype=torch.float32)
        self._tables(max_positions or c.max_position_embeddings)
        self._build()
        self.calls = 0  # steps run (tests and benchmarks read it)

    @property
    def buckets(self) -> tuple[int, ...]:
        """(max_rows,) while the model's kernel choice allows native code, else () — ``ModelRunner`` then runs
        every step on the per-layer path (``set_kernels("torch")`` after the engine was built takes effect)."""
        return (self.max_rows,) if self.model.kernels in NATIVE_CHOICES else ()

    def _tables(self, n: int) -> None:
        """RoPE's cos/sin for positions 0..n-1, [n, D] each: the model's own rotary module on every position at
        once gives the rows its per-step call gives (the same fp32 products and cos/sin)."""
        cos, sin = self.model.model.rotary_emb(torch.arange(n)[None], torch.float32)  # (1, n, 1, D)
        self._cos, self._sin = cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()

    def _probe(self) -> tuple[int, ...]:
        """Addresses that change when the model's tensors are moved or its modules swapped (a check per call of
        ~18 attribute reads, not every layer): the watched modules' ids and first tensors, the layer count, the KV
        cache."""
        ids = [id(getattr(parent, name)) for parent, name in self._watch]
        ptrs = [t.data_ptr() for t in self._watched_tensors]
        return (len(self.model.model.layers), self.kv.k.data_ptr(), self.kv.v.data_ptr(), *ids, *ptrs)

    def _build(self) -> None:
        """The C layer table, pointing at the model's tensors as they are now (kept alive in ``_keep``)."""
        body, keep = self.model.model, []
        layers = (_Layer * max(len(body.layers), 1))()
        for i, layer in enumerate(body.layers):
            norms = (layer.input_layernorm.weight.detach().contiguous(),
                     layer.post_attention_layernorm.weight.detach().contiguous())
            keep += norms
            lins = [_linear_struct(lin, keep) for _, lin in _linears(layer)]
            layers[i] = _Layer(norms[0].data_ptr(), norms[1].data_ptr(), *lins,
                               self.kv.layer_k[i].data_ptr(), self.kv.layer_v[i].data_ptr())
        final = body.norm.weight.detach().contiguous()
        # the LM head too when it is a linear the table can hold (else decode() runs the model's module)
        head = self.model.lm_head
        self._head = ctypes.pointer(_linear_struct(head, keep)) if _linear_kind(head) is not None else None
        self._vocab = self._head.contents.N if self._head is not None else 0
        self._layers, self._keep, self._final = layers, keep + [self.kv.k, self.kv.v], final
        self._eps, self._scale = float(body.norm.eps), self.model.config.head_dim**-0.5
        self._watch = _watch_list(self.model)
        self._watched_tensors = [t for t in (_first_tensor(getattr(p, n)) for p, n in self._watch) if t is not None]
        self._probed = self._probe()

    def _refresh(self) -> None:
        """Rebuild the table when the model's tensors changed since it was built; raise if it cannot run now."""
        if self._probe() == self._probed:
            return
        reason = unsupported_reason(self.model, self.kv)
        if reason is not None:
            raise RuntimeError(f"the model changed after the fused decode step was built and it cannot run it now: "
                               f"{reason}; build the engine again")
        self._build()

    def hidden(self, batch) -> Tensor:
        """Rows (``DecodeBatch``: token ids, positions, KV slots, block tables, context lengths; B ≤ max_rows) ->
        final-normed hidden states [B, hidden] (fresh).  Writes each row's K/V to its slot, then row i attends to
        the first ``seq_lens[i]`` positions of its table: consecutive rows of one sequence are causal."""
        return self.run_rows(batch, with_head=False)[0]

    @torch.inference_mode()
    def logits(self, batch) -> Tensor:
        """``hidden``'s rows through the LM head as well -> logits [B, V] (fresh), in the same call when the head is
        an fp32 or int8/int4 linear (the usual case), else by the model's own module."""
        hidden, logits = self.run_rows(batch, with_head=self._head is not None)
        return logits if logits is not None else self.model.compute_logits(hidden)

    def decode(self, batch, num_padding: int = 0) -> Tensor:
        """One decode step -> logits [B, V] of the batch's rows (``logits``).  ``num_padding`` rows (a static
        batch's finished members) are not computed: the caller drops their logits anyway."""
        return self.logits(batch)

    @torch.inference_mode()
    def run_rows(self, batch, with_head: bool) -> tuple[Tensor, Tensor | None]:
        """The one native call: rows -> (hidden [B, hidden], logits [B, V] when ``with_head`` else None).  Only the
        embedding lookup runs in Python (``perf.profile`` times this as the step's forward).  As for the per-layer
        native kernels, the caller guarantees valid slots, tables and lengths (the engine's block manager does):
        checking them would cost what this call saves."""
        B = len(batch)
        if not 1 <= B <= self.max_rows:
            raise ValueError(f"the fused decode step takes 1..{self.max_rows} rows, got {B}")
        if min(batch.positions) < 0:
            raise ValueError(f"positions must be >= 0, got {batch.positions}")
        self._refresh()
        top = max(batch.positions)
        if top >= self._cos.shape[0]:
            self._tables(max(2 * self._cos.shape[0], top + 1))
        W = max(len(t) for t in batch.block_tables)
        flat = [b for t in batch.block_tables for b in (*t, *[0] * (W - len(t)))]  # (B, W), padded with block 0
        x = self.model.model.embed_tokens(torch.tensor(batch.input_ids)).contiguous()  # (B, hidden)
        H, Hq, Hkv, D, F = self._dims
        out = torch.empty(B, H)
        lg = torch.empty(B, self._vocab) if with_head else None
        _lib().decode_stack(self._layers, len(self.model.model.layers), x.data_ptr(), self._final.data_ptr(),
                            self._cos.data_ptr(), self._sin.data_ptr(), (ctypes.c_int64 * B)(*batch.positions),
                            (ctypes.c_int64 * B)(*batch.slot_mapping), (ctypes.c_int32 * (B * W))(*flat),
                            (ctypes.c_int32 * B)(*batch.seq_lens), B, W, H, Hq, Hkv, D, F, self.kv.block_size,
                            self._eps, self._scale, self._head if with_head else None, self._scratch.data_ptr(),
                            out.data_ptr(), None if lg is None else lg.data_ptr())
        self.calls += 1
        return out, lg


class LinearStack:
    """A list of linear weights run as one native loop (``csrc/decode.c`` ``linear_stack``): the GEMVs of a decode
    step with no Python between them, for benchmarks that time the kernels alone (``perf.bench.quant``).

    ``weights``: fp32 [N, K] tensors, ``Int8Weight`` or ``Int4Weight`` (contiguous, CPU) — the kinds the fused step
    runs, through the same kernels (quantized ones with int8 activations, as ``decode_stack`` does); ``rows``: M
    (1..``MAX_ROWS``).  ``inputs[i]`` [M, K_i] (zeros; one tensor per distinct K, shared by the weights of that K:
    fill it in place) and ``outputs[i]`` [M, N_i] are allocated once here, and their addresses passed to C once, so
    a call costs one ctypes dispatch.
    """

    def __init__(self, weights: list, rows: int = 1):
        if not available():
            raise ValueError("the fused native decode library did not build here")
        if not 1 <= rows <= MAX_ROWS:
            raise ValueError(f"rows must be in [1, {MAX_ROWS}], got {rows}")
        keep: list[Tensor] = []
        self._table = (_Linear * max(len(weights), 1))(*[_weight_struct(w, None, keep) for w in weights])
        for t in keep:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("LinearStack needs contiguous CPU weights")
        self._keep, self.rows = keep, rows
        self.shapes = [(int(s.N), int(s.K)) for s in self._table[:len(weights)]]
        by_k = {K: torch.zeros(rows, K) for _, K in self.shapes}
        self.inputs = [by_k[K] for _, K in self.shapes]
        self.outputs = [torch.empty(rows, N) for N, _ in self.shapes]
        n = max(len(weights), 1)
        self._xs = (vp * n)(*[x.data_ptr() for x in self.inputs])
        self._ys = (vp * n)(*[y.data_ptr() for y in self.outputs])

    def __len__(self) -> int:
        return len(self.shapes)

    def run(self, one_region: bool = False) -> list[Tensor]:
        """outputs[i] = inputs[i] @ W_i^T for every weight, in order, in one native call.  ``one_region``: all the
        GEMVs inside one OpenMP region with a barrier around each (else one region per GEMV, as the fused decode step
        runs them); the results are the same.  Returns ``outputs`` (overwritten by the next call)."""
        _lib().linear_stack(self._table, len(self), self._xs, self._ys, self.rows, int(one_region))
        return self.outputs

    def read_only(self) -> int:
        """Read every stored byte of the weights (codes, scales, mins) once, in ``run``'s order and thread split, with
        no arithmetic (``csrc/decode.c`` ``stack_read``): the memory roof of that access pattern, which ``run`` can
        approach but not beat.  Returns the OR of the bytes' 64-bit words."""
        return int(_lib().stack_read(self._table, len(self)))
