"""`edgefinfer chat` through the real CLI entry point on the shipped SmolLM2 GGUF (llama.cpp): a
scripted conversation reuses its cache, a saved session continues with the reply the live one gives,
Ctrl-C stops a reply and not the program, bad input ends in one line with exit code 2."""

import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("llama_cpp")

ARGS = ["--threads", "1", "-n", "12"]


@pytest.fixture(scope="module")
def gguf():
    from edgefinfer.model import reference

    return str(reference.gguf_path("smollm2-135m"))


def chat(*args, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "edgefinfer", "chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=600)


def test_a_scripted_conversation_reuses_its_cache_and_a_saved_session_continues_it(gguf, tmp_path):
    script = tmp_path / "messages.txt"
    saved = tmp_path / "chat.efs"
    script.write_text(f"What is the capital of France?\n\nAnd of Italy?\n/stats\n/save {saved}\nAnd of Spain?\n")
    live = chat(gguf, *ARGS, "--messages", str(script))
    assert live.returncode == 0, live.stderr
    turns = [line for line in live.stderr.splitlines() if line.startswith("[")]
    assert len(turns) == 3 and "(0 reused" in turns[0]
    assert all("(0 reused" not in t for t in turns[1:])  # turns 2 and 3 prefill only what is new
    assert all("reply prefilled again in" in t for t in turns)  # llama.cpp: each reply settled (runtime.session)
    assert f"cached tokens to {saved}" in live.stderr and saved.is_file()

    restored = chat(gguf, *ARGS, "--session", str(saved), "--messages", "-", stdin="And of Spain?\n")
    assert restored.returncode == 0, restored.stderr
    assert "loaded 4 messages" in restored.stderr
    assert restored.stdout.strip() and live.stdout.endswith(restored.stdout)  # the live run's third reply
    assert "(0 reused" not in restored.stderr


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(gguf):
    proc = subprocess.Popen([sys.executable, "-m", "edgefinfer", "chat", gguf, "--threads", "1", "-n", "400"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdin.write("Write a very long story about a dragon.\n")
        proc.stdin.flush()
        assert proc.stdout.read(1)  # the reply is streaming
        os.kill(proc.pid, signal.SIGINT)
        proc.stdin.write("/stats\n/exit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "[stopped]" in out
    assert "tokens in cache" in err.splitlines()[-1]  # /stats answered after the stop


@pytest.mark.parametrize("case", ["missing messages", "missing session", "truncated session", "no bundle"])
def test_bad_input_exits_2_in_one_line(gguf, tmp_path, case):
    truncated = tmp_path / "cut.efs"
    truncated.write_bytes(b"EDGEFINFER-SESSION\n\x00\x01")
    args = {"missing messages": [gguf, "--messages", str(tmp_path / "none.txt")],
            "missing session": [gguf, "--messages", "-"],
            "truncated session": [gguf, "--session", str(truncated), "--messages", "-"],
            "no bundle": [str(tmp_path / "nothing"), "--messages", "-"]}[case]
    stdin = f"/load {tmp_path / 'none.efs'}\nHello\n" if case == "missing session" else "Hello\n"
    proc = chat(*args, *ARGS, stdin=stdin)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    want = {"missing messages": "no messages file at", "missing session": "no session file at",
            "truncated session": "is truncated", "no bundle": "does not exist"}[case]
    assert want in lines[0] and proc.stdout == ""
