"""The fused native decode step as an engine runner: the whole decoder stack in one native call per step, on CPU.

Why: at batch 1 a decode token of a small model with int4 weights spends about as long in the layer-by-layer
Python around its GEMVs (~120 ATen ops per layer: views, transposes, empty, ctypes wrappers and their ``supports()``
checks, module calls) as in the GEMVs themselves.  ``NativeDecodeStack`` builds a C table of every layer's weight
pointers once and runs every layer in one call of ``kernels/cpu/decode.py``'s library: (add +) RMSNorm, qkv, RoPE,
K/V to their paged slots, paged attention, o_proj, add + RMSNorm, gate_up, SiLU·mul, down, the final norm — the
per-layer native path's own kernels in its own order, so the hidden states equal ``model.hidden_states`` on the
model's native kernels bit for bit.  The embedding lookup and (when it is not a linear the table holds) the LM head
stay in Python.  Rows are general: several rows of one sequence each attend up to their own position, so a
speculative draft chunk [last, x_1..x_k] runs as k + 1 rows for about the cost of one decode step.

``NativeRunner`` is the engine's runner on this path (``engine/runners.py`` picks it): steps whose every chunk is a
decode or a draft chunk and whose rows fit go through the stack; prefill and mixed steps through the eager forward.

What it runs (``unsupported_reason`` says why not, and the engine then keeps the per-layer path): a ``Transformer`` of
the plain Llama modules on CPU whose kernel choice allows native code ("auto"/"native"), no sliding window, a
``PagedKVCache`` of the model's dtype (not a quantized one), the native libraries built here, and either
fp32 activations with every linear fp32 (``Linear``), int8 / Q4_1 int4 (``QuantLinear``) or W8A8 (``W8A8Linear``:
int8 × int8 GEMMs, dynamic or static activation scales), or bf16 activations with every linear a bf16 ``Linear``
(quantized linears under bf16 activations keep the per-layer path).  A bf16 step takes at most
``native.native_rows(bfloat16)`` rows (all decode batches where the CPU multiplies bf16 pairs, the smallest
elsewhere): past it the per-layer path's linears are a GEMM the fused step does not run, so larger steps take that
path. The C table holds raw pointers: if the model's tensors are replaced afterwards
(``.to()``, ``quantize_model``, a module swap), the next call notices (the ids of every layer's modules and the
addresses of the outer layers' tensors are compared each call) and rebuilds the table, or raises when the model is no
longer one it can run.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from minillm import openmp
from minillm.engine.model_runner import ModelRunner, logit_rows
from minillm.engine.scheduler import SchedulerOutput
from minillm.kernels.cpu import decode, native
from minillm.kernels.cpu import quant as native_quant

NATIVE_CHOICES = ("auto", "native")  # the model kernel choices under which the fused step may run
# The linear kinds (``_linear_kind``) the C table runs for each activation dtype, and its entry point for that dtype.
TABLE_KINDS = {torch.float32: ("fp32", "int8", "int4", "w8a8", "q6k"), torch.bfloat16: ("bf16",)}
_STEP = {torch.float32: "decode_stack", torch.bfloat16: "decode_stack_bf16"}


def _linear_kind(module) -> str | None:
    """"fp32" / "bf16" / "int8" / "int4" / "q6k" / "w8a8" for a plain ``Linear`` (fp32 or bf16, its bias of its
    dtype), ``QuantLinear`` or ``W8A8Linear`` on CPU the C table can point at (which activations run it:
    ``TABLE_KINDS``)."""
    from minillm.layers.linear import Linear, QuantLinear, W8A8Linear
    from minillm.quant.weight import Int4Weight, Q6KWeight

    if type(module) is W8A8Linear:
        pw, b, s = module.packed_weight, module.bias, module.input_scale
        ok = all(t.device.type == "cpu" and t.is_contiguous() for t in (pw.qweight, pw.scales)) \
            and (b is None or (b.dtype == torch.float32 and b.device.type == "cpu")) \
            and (s is None or (s.dtype == torch.float32 and s.device.type == "cpu"))
        return "w8a8" if ok else None
    if type(module) is Linear:
        w, b = module.weight, module.bias
        ok = w.dtype in TABLE_KINDS and w.device.type == "cpu" and w.is_contiguous() \
            and (b is None or b.dtype == w.dtype)
        return ("fp32" if w.dtype == torch.float32 else "bf16") if ok else None
    if type(module) is QuantLinear:
        pw = module.packed_weight
        tensors = [getattr(pw, f) for f in ("packed", "scales", "mins", "qweight", "blocks")
                   if getattr(pw, f, None) is not None]
        b = module.bias
        ok = all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) \
            and (b is None or (b.dtype == torch.float32 and b.device.type == "cpu"))
        kind = "int4" if isinstance(pw, Int4Weight) else "q6k" if isinstance(pw, Q6KWeight) else "int8"
        return kind if ok else None
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
    if model.device.type != "cpu" or model.dtype not in TABLE_KINDS:
        return f"needs fp32 or bf16 activations on CPU, the model is {model.dtype} on {model.device}"
    if type(kv) is not PagedKVCache or kv.dtype != model.dtype or kv.k.device.type != "cpu":
        return (f"needs a PagedKVCache of the model's dtype ({model.dtype}) on CPU (kv_cache_dtype='auto'; not a "
                "quantized cache)")
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
            if norm.eps != body.norm.eps or norm.weight.dtype != model.dtype:
                return f"layer {i}'s norms differ from the final norm's eps or dtype"
        for name, lin in _linears(layer):
            kind = _linear_kind(lin)
            if kind is None:
                return (f"layer {i}'s {name} is not an fp32/bf16 Linear, an int8/int4 QuantLinear or a W8A8Linear "
                        "on CPU")
            if kind not in TABLE_KINDS[model.dtype]:
                return (f"layer {i}'s {name} has {kind} weights under {model.dtype} activations: the fused step runs "
                        + ("only bf16 Linears with bf16 activations (quantized weights keep the per-layer path)"
                           if model.dtype == torch.bfloat16 else "fp32, int8, int4 and W8A8 linears with fp32 ones"))
    if not (native.available() and native_quant.available() and decode.available()):
        return "the native libraries did not build here (no C compiler, or MINILLM_DISABLE_NATIVE)"
    return None


def supports(model, kv) -> bool:
    """Whether the fused decode step can run ``model`` over ``kv`` (see ``unsupported_reason``)."""
    return unsupported_reason(model, kv) is None


def _linears(layer) -> list[tuple[str, object]]:
    a, m = layer.self_attn, layer.mlp
    return [("qkv_proj", a.qkv_proj), ("o_proj", a.o_proj), ("gate_up_proj", m.gate_up_proj),
            ("down_proj", m.down_proj)]


def _watched(model) -> tuple[list[dict], list[Tensor]]:
    """What a swap or a move changes: the child-module dicts of the model, its body, the layer list and every
    layer, attention and MLP (a swapped module anywhere, a middle layer's included, changes an id in one of them),
    and the first tensors of the final norm, the LM head and the first and last layers' modules (``.to()`` moves
    every tensor, so these show it)."""
    body = model.model
    dicts = [model._modules, body._modules, body.layers._modules]
    for layer in body.layers:
        dicts += [layer._modules, layer.self_attn._modules, layer.mlp._modules]
    ends = [body.norm, model.lm_head]
    for layer in (body.layers[0], body.layers[-1]) if len(body.layers) else ():
        ends += [layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.qkv_proj,
                 layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    return dicts, [t for t in map(_first_tensor, ends) if t is not None]


def _first_tensor(module) -> Tensor | None:
    """The tensor whose address identifies a module's weight (its weight, or a packed linear's codes)."""
    w = module._parameters.get("weight")
    if w is None:
        w = next(iter(module._buffers.values()), None)  # QuantLinear: packed / qweight first
    return w


def _linear_struct(lin, keep: list[Tensor]) -> decode.LinearT:
    """The ``linear_t`` of one layer; the tensors it points at are appended to ``keep`` (they must outlive it)."""
    kind = _linear_kind(lin)
    if kind == "w8a8":
        return decode.weight_struct(lin.packed_weight, lin.bias, keep, w8a8=True, input_scale=lin.input_scale)
    return decode.weight_struct(lin.weight if kind in ("fp32", "bf16") else lin.packed_weight, lin.bias, keep)


class NativeDecodeStack:
    """The whole decoder stack of ``model`` as one native call per step over the paged cache ``kv``.

    ``max_rows`` (≤ ``decode.MAX_ROWS``): the most rows one call takes (the engine's runner passes its rows per step),
    lowered to ``native.native_rows(model.dtype)``, where the per-layer path's dense linears leave the native GEMV
    (bf16 without AVX512-BF16: a few rows); ``max_positions``: the RoPE table's length (grown when a later position
    needs more).  Scratch (~100 KB for
    SmolLM2 at 32 rows) and the RoPE tables are allocated here, once.  Raises ``ValueError`` naming the reason when
    ``unsupported_reason(model, kv)`` is not None.
    """

    def __init__(self, model, kv, *, max_rows: int = decode.MAX_ROWS, max_positions: int | None = None):
        reason = unsupported_reason(model, kv)
        if reason is not None:
            raise ValueError(f"the fused native decode step cannot run this model: {reason}")
        if not 1 <= max_rows <= decode.MAX_ROWS:
            raise ValueError(f"max_rows must be in [1, {decode.MAX_ROWS}], got {max_rows}")
        self.model, self.kv, self.max_rows = model, kv, min(max_rows, native.native_rows(model.dtype))
        c = model.config
        self._dims = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)
        self._scratch = torch.empty(decode.library().decode_scratch_floats(max_rows, *self._dims), dtype=torch.float32)
        self._tables(max_positions or c.max_position_embeddings)
        self._build()
        self.calls = 0  # steps run (tests and benchmarks read it)
        self._threads = openmp.DecodeThreads()  # the step's thread count beside busy neighbours

    def _tables(self, n: int) -> None:
        """RoPE's cos/sin for positions 0..n-1, [n, D] each, in the model's dtype: the model's own rotary module on
        every position at once gives the rows its per-step call gives (the same fp32 products and cos/sin, the same
        rounding to the dtype)."""
        cos, sin = self.model.model.rotary_emb(torch.arange(n)[None], self.model.dtype)  # (1, n, 1, D)
        self._cos, self._sin = cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous()

    def _probe(self) -> tuple[int, ...]:
        """Ids and addresses that change when the model's modules are swapped or its tensors moved (``_watched``),
        the layer count, the KV cache: checked every call, a few C-level loops (3 dicts per layer)."""
        ids = [tuple(map(id, d.values())) for d in self._watched_dicts]  # C loops over the dicts, no Python per entry
        ptrs = [t.data_ptr() for t in self._watched_tensors]
        return (len(self.model.model.layers), self.kv.k.data_ptr(), self.kv.v.data_ptr(), *ids, *ptrs)

    def _build(self) -> None:
        """The C layer table, pointing at the model's tensors as they are now (kept alive in ``_keep``)."""
        body, keep = self.model.model, []
        if self._cos.dtype != self.model.dtype:  # the model changed dtype (with a new cache of it)
            self._tables(self._cos.shape[0])
        layers = (decode.LayerT * max(len(body.layers), 1))()
        for i, layer in enumerate(body.layers):
            norms = (layer.input_layernorm.weight.detach().contiguous(),
                     layer.post_attention_layernorm.weight.detach().contiguous())
            keep += norms
            lins = [_linear_struct(lin, keep) for _, lin in _linears(layer)]
            layers[i] = decode.LayerT(norms[0].data_ptr(), norms[1].data_ptr(), *lins,
                               self.kv.layer_k[i].data_ptr(), self.kv.layer_v[i].data_ptr())
        final = body.norm.weight.detach().contiguous()
        # the LM head too when it is a linear the table can hold (else decode() runs the model's module)
        head = self.model.lm_head
        self._head = ctypes.pointer(_linear_struct(head, keep)) \
            if _linear_kind(head) in TABLE_KINDS[self.model.dtype] else None
        self._vocab = self._head.contents.N if self._head is not None else 0
        self._layers, self._keep, self._final = layers, keep + [self.kv.k, self.kv.v], final
        self._eps, self._scale = float(body.norm.eps), self.model.config.head_dim**-0.5
        self._watched_dicts, self._watched_tensors = _watched(self.model)
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
        a linear the table runs (the usual case), else by the model's own module."""
        hidden, logits = self.run_rows(batch, with_head=self._head is not None)
        return logits if logits is not None else self.model.compute_logits(hidden)

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
        dtype = self.model.dtype
        out = torch.empty(B, H, dtype=dtype)
        lg = torch.empty(B, self._vocab, dtype=dtype) if with_head else None
        step = getattr(decode.library(), _STEP[dtype])  # decode_stack (fp32) or decode_stack_bf16: one C body
        with openmp.num_threads(self._threads.threads(torch.get_num_threads())):  # fewer beside busy neighbours
            step(self._layers, len(self.model.model.layers), x.data_ptr(), self._final.data_ptr(),
                 self._cos.data_ptr(), self._sin.data_ptr(), (ctypes.c_int64 * B)(*batch.positions),
                 (ctypes.c_int64 * B)(*batch.slot_mapping), (ctypes.c_int32 * (B * W))(*flat),
                 (ctypes.c_int32 * B)(*batch.seq_lens), B, W, H, Hq, Hkv, D, F, self.kv.block_size, self._eps,
                 self._scale, self._head if with_head else None, self._scratch.data_ptr(), out.data_ptr(),
                 None if lg is None else lg.data_ptr())
        self.calls += 1
        return out, lg


class NativeRunner(ModelRunner):
    """The engine's runner on CPU when the fused step can run the model: every step whose chunks are all decodes
    or draft chunks, ``max_rows`` rows at most (padding included), is one ``NativeDecodeStack`` call; other steps
    run the eager packed forward.  ``set_kernels("torch")`` after the engine was built takes effect: the stack runs
    only while the model's kernel choice allows native code."""

    def __init__(self, model, kv, block_manager, *, max_rows: int, max_positions: int):
        super().__init__(model, kv, block_manager)
        self.stack = NativeDecodeStack(model, kv, max_rows=max_rows, max_positions=max_positions)

    @property
    def active(self) -> bool:
        """Whether the stack runs steps now (the model's kernel choice allows native code)."""
        return self.model.kernels in NATIVE_CHOICES

    def fast_forward(self, out: SchedulerOutput) -> Tensor | None:
        """Every chunk a decode or a draft chunk and every row within ``max_rows`` -> the logits [R, V] of the rows
        asked for, from one native call (pad rows are not computed: nobody samples them); else None."""
        if not self.active or any(s.num_tokens != 1 and not s.drafts for s in out.scheduled) \
                or out.num_tokens + out.num_padding > self.stack.max_rows:
            return None
        return self.stack.logits(self.rows(out))[logit_rows(out)]  # (R, V)
