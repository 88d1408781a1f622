"""Request inputs, checked in one place for every path (``LLM``, ``LLMEngine`` and the simple loops).

A prompt is a string (needs a tokenizer) or 1-d token ids: a list/tuple of ints, a numpy array or a torch tensor
(integer dtype).  Everything else — bytes, None, floats, a 0-d tensor — raises ``ValueError`` naming the argument
and what to pass instead, before anything is queued.  Iterables (a generator of prompts) are materialised first.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

from minillm.sampling.params import SamplingParams

Prompt = str | Sequence[int]  # also a 1-d numpy array or torch tensor of ints


def _is_array(x) -> bool:
    """A numpy array or a torch tensor (both have ``ndim`` and ``tolist``), without importing either."""
    return hasattr(x, "ndim") and hasattr(x, "tolist") and not isinstance(x, (str, bytes))


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def is_single_prompt(x) -> bool:
    """Whether ``x`` is one prompt (a string, ids, an array of ndim <= 1) rather than a batch of prompts.
    Bytes and None count as one (invalid) prompt, so the error names the prompt, not the batch."""
    if x is None or isinstance(x, (str, bytes, bytearray)):
        return True
    if _is_array(x):
        return x.ndim <= 1
    return isinstance(x, (list, tuple)) and len(x) > 0 and _is_token(x[0])


def prompt_list(prompts) -> list:
    """One prompt or an iterable of prompts -> a non-empty list of prompts."""
    if is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}")
    out = list(prompts)  # a generator is consumed once, here
    if not out:
        raise ValueError("no prompts given: pass a string, token ids, or a non-empty list of those")
    return out


def params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` for all ``n`` prompts (None: the defaults), or one each."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    out = list(params)
    if len(out) != n:
        raise ValueError(f"got {n} prompts but {len(out)} SamplingParams: pass one for all or one per prompt")
    for i, p in enumerate(out):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling params {i} is a {type(p).__name__}, not a SamplingParams")
    return out


def to_token_ids(prompt, tokenizer=None) -> list[int]:
    """A string (tokenized with special tokens, as the model was trained) or 1-d ids -> a list of Python ints."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is an empty string: pass at least one character or token id")
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer: LLMEngine(model, tokenizer), or pass token ids")
        utf8_bytes(prompt, "prompt")
        return list(tokenizer(prompt, add_special_tokens=True).input_ids)
    if prompt is None or isinstance(prompt, (bytes, bytearray)):
        raise ValueError(f"prompt must be a string or a sequence of int token ids, got {type(prompt).__name__}"
                         + (": decode the bytes to str first" if prompt is not None else ""))
    if _is_array(prompt):
        if prompt.ndim != 1:
            raise ValueError(f"a prompt array must be 1-d token ids, got {prompt.ndim}-d"
                             + (" (a single number: wrap it in a list)" if prompt.ndim == 0 else ""))
        prompt = prompt.tolist()
    if not isinstance(prompt, Iterable):
        raise ValueError(f"prompt must be a string or a sequence of int token ids, got {type(prompt).__name__}")
    ids = list(prompt)
    bad = [t for t in ids if not _is_token(t)]
    if bad:
        raise ValueError(f"prompt must be a string or a sequence of int token ids; found {bad[0]!r} "
                         f"({type(bad[0]).__name__})")
    return [int(t) for t in ids]


def validate_prompts(prompts: Sequence[Sequence[int]], max_len: int, vocab_size: int) -> None:
    """Reject empty prompts, prompts that leave no room in the context, and out-of-vocabulary ids."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: pass at least one token (or a non-empty string)")
        if len(p) >= max_len:
            raise ValueError(f"prompt {i} has {len(p)} tokens but the model's context is {max_len} tokens "
                             f"(room is needed for at least one output token): shorten the prompt")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:5]}")


def merge_eos_token_ids(model_eos: Iterable[int], tokenizer=None) -> tuple[int, ...]:
    """The model config's EOS ids plus the tokenizer's (they disagree in some checkpoints), sorted."""
    eos = set(model_eos)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


def validate_messages(messages) -> list[dict]:
    """Chat messages: a non-empty list of {"role": str, "content": str} dicts (materialised)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise ValueError('messages must be a list of {"role": ..., "content": ...} dicts')
    messages = list(messages)
    if not messages:
        raise ValueError('messages is empty: pass at least one {"role": ..., "content": ...} dict')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f'messages[{i}] must be a {{"role": ..., "content": ...}} dict, got {m!r}')
        for key in ("role", "content"):
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string, got {type(m[key]).__name__} "
                                 f"({m[key]!r})")
            utf8_bytes(m[key], f"messages[{i}][{key!r}]")
    return messages


def utf8_bytes(text: str, name: str) -> int:
    """``len(text.encode())``; ``ValueError`` naming ``name`` when ``text`` is not valid Unicode (a lone surrogate,
    half of a UTF-16 pair, as JSON's ``"\\ud800"`` escape can carry), which no tokenizer can encode."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} must be valid Unicode text: the character at index {e.start} "
                         f"({text[e.start:e.end]!r}) is a lone surrogate, half of a UTF-16 pair; send both halves "
                         "or drop it") from None


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of UTF-8 text one token can cover: the longest token string of the vocabulary
    in UTF-8 (byte-level BPE stores one character per byte, SentencePiece '▁' for a space and ``<0x..>`` for a
    fallback byte — each at least as long as the bytes it stands for), times 4 when the tokenizer normalizes its
    input (a normalizer may shrink text, by at most the 4 bytes of a UTF-8 character per character it keeps).

    Every byte of a prompt lands in some token, so a prompt of B bytes has at least B / max_token_bytes tokens: a
    cheap check that refuses a megabyte prompt before it is tokenized.  O(V) once per tokenizer."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    longest = max((len(t.encode("utf-8", errors="replace")) for t in tokens if t is not None), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (1 if backend is not None and backend.normalizer is None else 4)


def prompt_text_bytes(prompt) -> int:
    """The UTF-8 bytes of a prompt's text (a string, or chat messages' contents); 0 for token ids."""
    if isinstance(prompt, str):
        return utf8_bytes(prompt, "prompt")
    if isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
        return sum(utf8_bytes(str(m.get("content", "")), f"messages[{i}]['content']") for i, m in enumerate(prompt))
    return 0


def chat_prompt_ids(tokenizer, messages, tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
    """Chat messages -> prompt ids ending with the assistant's turn (the tokenizer's chat template).  The one place
    every front end (``LLM.chat``, the CLI, the OpenAI server) turns a conversation into a prompt.  ``tools``
    (OpenAI's ``[{"type": "function", "function": {...}}]``) are rendered by templates that support them (others
    ignore them).  Raises ``ValueError`` for bad messages, a tokenizer without a template, or a conversation the
    template rejects.  ``add_generation_prompt`` False: without the assistant's opening; ``add_special_tokens``:
    also the tokens the tokenizer adds to any text (e.g. a BOS the template does not write itself) — both for
    ``/tokenize``."""
    messages = validate_messages(messages)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt (generate(), or "
                         "/v1/completions on the server) instead")
    try:
        extra = {} if tools is None else {"tools": tools}
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            tokenize=not add_special_tokens, **extra)
    except Exception as e:  # jinja raises TemplateError for e.g. an unsupported role: the caller's mistake
        raise ValueError(f"messages: the chat template rejected them ({e})") from e
    if add_special_tokens:  # out is the rendered text
        return list(tokenizer(out, add_special_tokens=True)["input_ids"])
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def request_id_str(request_id) -> str:
    """Ids are strings; an int (``5``) is accepted and becomes ``"5"`` everywhere (add, abort, pop_output)."""
    if isinstance(request_id, str):
        if not request_id:
            raise ValueError("request_id is an empty string: pass a non-empty id or None to let the engine pick")
        return request_id
    if _is_token(request_id):
        return str(int(request_id))
    raise ValueError(f"request_id must be a string or an int, got {type(request_id).__name__} ({request_id!r})")
