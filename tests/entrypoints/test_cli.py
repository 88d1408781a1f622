"""The command line: streaming generation with metrics, interactive chat, clear errors."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, input=stdin,
                          timeout=300)


def test_generate_streams_text_then_prints_ttft_tpot_and_mbu():
    r = run("generate", "The capital of France is", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "TTFT" in r.stderr and "TPOT" in r.stderr and "tok/s" in r.stderr and "MBU" in r.stderr


def test_chat_answers_and_exits():
    r = run("chat", "--max-tokens", "12", stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "assistant>" in r.stdout and "Paris" in r.stdout


def test_bad_sampling_value_is_a_clear_error():
    r = run("generate", "hi", "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature must be" in r.stderr
