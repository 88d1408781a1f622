"""The GGUF conversion cache: keyed by the file's bytes (copies share one conversion, a changed file gets a new one),
each path hashed once, and stale conversions removed when a new one is written."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from minillm.models import loader
from minillm.models.synthetic import make_model


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    make_model("tiny", out, gguf=("q8_0",), dtype="float32", seed=5)
    return out / "tiny-Q8_0.gguf"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One cache for the module: a conversion takes seconds, so the tests share the first one."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("MINILLM_CACHE", str(root))
        yield root / "models"


def _conversions(cache):
    return sorted(p.name for p in cache.iterdir() if p.name != "by-path")


def test_copies_of_one_file_share_one_conversion(gguf, cache, tmp_path, capsys):
    a, b = tmp_path / "venv-a" / gguf.name, tmp_path / "venv-b" / gguf.name
    for p in (a, b):
        p.parent.mkdir()
        shutil.copy(gguf, p)
    first, second = loader.resolve(a), loader.resolve(b)
    assert first.directory == second.directory and (first.directory / "complete").exists()
    assert capsys.readouterr().out.count("converting") == 1
    assert len([n for n in _conversions(cache) if n.startswith("tiny-")]) == 1


def test_a_path_is_hashed_once_while_its_size_and_mtime_stand(gguf, cache, tmp_path):
    p = tmp_path / gguf.name
    shutil.copy(gguf, p)
    first = loader.resolve(p).directory
    st = p.stat()
    with p.open("r+b") as f:  # bytes changed behind the same size and mtime: the remembered digest is used
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert loader.resolve(p).directory == first


def test_a_changed_file_gets_its_own_conversion_and_writing_it_removes_stale_ones(gguf, cache, tmp_path):
    p = tmp_path / gguf.name
    shutil.copy(gguf, p)
    old = loader.resolve(p).directory
    stale, recent = cache / "old-model-0123456789abcdef", cache / "other-model-fedcba9876543210"
    dead, live = cache / f"x-0000000000000000.tmp-{2**22 + 7}", cache / f"y-1111111111111111.tmp-{os.getpid()}"
    for d in (stale, recent, dead, live):
        d.mkdir()
        (d / "complete").write_text("ok\n")
    month_ago = time.time() - (loader.CACHE_UNUSED_DAYS + 1) * 86400
    os.utime(stale, (month_ago, month_ago))
    os.utime(dead, (month_ago, month_ago))
    with p.open("r+b") as f:  # a different file at the same path (new bytes, new mtime)
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    os.utime(p, ns=(time.time_ns(), p.stat().st_mtime_ns + 10**9))
    new = loader.resolve(p).directory
    assert new != old and (new / "complete").exists() and old.exists()
    assert not stale.exists() and not dead.exists()  # unused for a month; a half conversion whose writer is gone
    assert recent.exists() and live.exists()  # used lately; a half conversion still being written


def test_reading_a_gguf_s_own_blocks_writes_no_fp32_copy_until_the_float_path_asks(gguf, tmp_path, monkeypatch,
                                                                                   capsys):
    """``quantization="int4"`` and the tokenizer need the config and tokenizer only; the fp32 weights (7× a 4-bit
    file) are written the first time a float load asks for them, once."""
    import torch

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "own-cache"))
    packed = loader.load_model(gguf, dtype="float32", device="cpu", quantization="int4")
    loader.load_tokenizer(gguf)
    (conversion,) = (tmp_path / "own-cache" / "models").glob("tiny-*")
    assert (conversion / "complete").exists() and (conversion / "config.json").exists()
    assert not list(conversion.glob("*.safetensors*")) and "converting" not in capsys.readouterr().out
    full = loader.load_model(gguf, dtype="float32", device="cpu")
    assert (conversion / "model.safetensors").exists() and capsys.readouterr().out.count("converting") == 1
    loader.load_model(gguf, dtype="float32", device="cpu")
    assert "converting" not in capsys.readouterr().out
    ids = torch.tensor([[1, 2, 3, 400]])
    with torch.inference_mode():  # the same model both ways: Q8_0 blocks against their fp32 dequantization
        a, b = packed(ids, torch.arange(4)[None]), full(ids, torch.arange(4)[None])
    assert (a - b).abs().max() < 0.05 * b.abs().max()
