"""`edgefinfer chat BUNDLE`: a terminal conversation over a session that keeps its KV cache.

Each reply streams as it is generated; turn N prefills only what turn N-1 left out of the cache
(`edgefinfer.runtime.session`). Commands: /reset, /save FILE, /load FILE, /stats, /help, /exit.
Ctrl-C stops the reply being generated (the partial reply stays in the history), not the program;
Ctrl-D or /exit ends it.

Non-interactive (`--messages FILE`, `-` for stdin): one user message or command per line, replies on
stdout, a statistics line per turn on stderr; a bad input (a missing file, a session file that does
not load, a turn past the context) ends the run with one line and exit code 2.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, TextIO

import click

from edgefinfer.app.cli import prefill_grid_option
from edgefinfer.errors import UserError

if TYPE_CHECKING:
    from edgefinfer.runtime.engine import Engine
    from edgefinfer.runtime.session import Session

HELP = ("/reset  forget the conversation    /save FILE  save it (history and KV cache)\n"
        "/load FILE  continue a saved one   /stats  cache and speed    /exit  quit (or Ctrl-D)")


class Chat:
    """The conversation state of one `edgefinfer chat` run: the session (replaced by /load)."""

    def __init__(self, engine: Engine, max_tokens: int, params, out: TextIO = sys.stdout):
        self.engine = engine
        self.session: Session = engine.session()
        self.max_tokens = max_tokens
        self.params = params
        self.out = out

    def handle(self, line: str) -> bool:
        """Run one input line (a message or a command); False when the user asked to quit."""
        if not line.startswith("/"):
            self.reply(line)
            return True
        command, _, arg = line[1:].strip().partition(" ")
        arg = arg.strip()
        if command in ("exit", "quit"):
            return False
        if command == "reset":
            self.session.reset()
            say("conversation reset")
        elif command == "save":
            file = self.session.save(_file_arg(arg, "/save"))
            say(f"saved {len(self.session.messages)} messages, {self.session.cached_tokens} cached tokens to {file}")
        elif command == "load":
            self.session = self.engine.load_session(_file_arg(arg, "/load"))  # a refusal keeps the old one
            say(f"loaded {len(self.session.messages)} messages, {self.session.cached_tokens} cached tokens")
        elif command == "stats":
            say(self.stats())
        elif command == "help":
            say(HELP)
        else:
            raise UserError(f"unknown command /{command}; type /help for the list")
        return True

    def reply(self, message: str) -> None:
        stream = self.session.chat(message, self.max_tokens, params=self.params)
        # Ctrl-C sets a flag read between tokens: raised as KeyboardInterrupt it can land inside a ctypes
        # callback of llama.cpp's, where Python prints and drops it, and the reply would run on.
        stopped = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: stopped.set())
        try:
            for delta in stream:
                self.out.write(delta)
                self.out.flush()
                if stopped.is_set():
                    break
            if stopped.is_set():
                self.out.write(" [stopped]")
        finally:
            signal.signal(signal.SIGINT, previous)
            stream.close()  # a clean stop: the session keeps the partial reply and its cache
            self.out.write("\n")
            self.out.flush()
        say(f"[{self.stats()}]")

    def stats(self) -> str:
        s = self.session.last
        return (f"{self.session.cached_tokens} tokens in cache, last turn: {s.prompt_tokens} prompt tokens "
                f"({s.reused_tokens} reused, {s.prefilled_tokens} prefilled), ttft {s.ttft_s * 1000:.0f} ms, "
                f"{s.generated_tokens} generated at {s.decode_tok_s:.1f} tok/s"
                + (f", reply prefilled again in {s.settle_s * 1000:.0f} ms" if s.settle_s else ""))


def say(text: str) -> None:
    click.echo(text, err=True)


def _file_arg(arg: str, command: str) -> Path:
    if not arg:
        raise UserError(f"{command} needs a file name: {command} FILE")
    return Path(arg).expanduser()


def read_lines(source: str) -> list[str]:
    """The messages of `--messages` (a file, or `-` for stdin), blank lines dropped."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except FileNotFoundError:
        raise UserError(f"no messages file at {source}; give a text file with one message per line, or - for stdin") \
            from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the messages file {source}: {e}") from None
    return [line for line in text.splitlines() if line.strip()]


def run_script(chat: Chat, lines: Iterable[str]) -> None:
    for line in lines:
        if not chat.handle(line.strip()):
            return


def run_interactive(chat: Chat) -> None:
    say(f"edgefinfer chat ({chat.engine.backend.name}); /help for commands, Ctrl-C stops a reply, Ctrl-D quits")
    prompt = "> " if sys.stdin.isatty() else ""  # piped in: stdout carries only the replies
    while True:
        try:
            line = input(prompt).strip()
        except EOFError:
            say("")
            return
        except KeyboardInterrupt:
            say("\n(Ctrl-D or /exit to quit)")
            continue
        if not line:
            continue
        try:
            if not chat.handle(line):
                return
        except UserError as e:  # a bad command or file: say so, keep the conversation
            say(f"error: {e}")


@click.command()
@click.argument("bundle")
@click.option("--backend", type=click.Choice(["executorch", "onnxruntime", "llamacpp", "torch"]), default=None,
              help="Force a backend (default: the bundle's).")
@click.option("-n", "--max-tokens", default=256, show_default=True, type=click.IntRange(1), help="Per reply.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-k", type=int, default=None)
@click.option("--top-p", type=float, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--kv", default=None, help="KV cache: static (default) | window:N[,sinks:S] | paged:BLOCK.")
@click.option("--speculative", default=None, help="draft:PATH[,K] | lookup[:NGRAM][,K].")
@click.option("--max-seq-len", type=click.IntRange(1), default=None, help="Context (tokens) of the cache.")
@click.option("--threads", type=int, default=None,
              help="Intra-op threads (default: llama.cpp one per physical core; ExecuTorch, ONNX Runtime "
              "and torch their own, within a narrowed CPU mask).")
@prefill_grid_option
@click.option("--messages", "messages", default=None, metavar="FILE",
              help="Non-interactive: messages and /commands one per line from FILE (- for stdin).")
@click.option("--session", "session_file", default=None, metavar="FILE", help="Start from a saved session.")
def chat(bundle: str, backend: str | None, max_tokens: int, temperature: float, top_k: int | None,
         top_p: float | None, seed: int | None, kv: str | None, speculative: str | None, max_seq_len: int | None,
         threads: int | None, prefill_grid: int | None, messages: str | None, session_file: str | None) -> None:
    """Chat with BUNDLE (or a .pte / .onnx / .gguf / HF folder): streaming replies in the model's chat
    template; each turn prefills only the new tokens."""
    from edgefinfer.runtime.early import start_loading

    lines = read_lines(messages) if messages is not None else None  # a missing file fails before loading
    start_loading(bundle, backend)  # a GGUF's weights load while the runtime imports
    from edgefinfer.libraries.quiet import quiet
    from edgefinfer.runtime.engine import Engine
    from edgefinfer.decoding.sampling import SamplingParams

    with quiet(load_ort=False):
        engine = Engine.load(bundle, backend=backend, kv=kv, speculative=speculative, threads=threads,
                             max_seq_len=max_seq_len, prefill_grid=prefill_grid)
    if engine.tokenizer.chat_template is None:
        raise UserError(f"{bundle} has no chat template in its tokenizer; use `edgefinfer run -p` for plain text")
    session = Chat(engine, max_tokens, SamplingParams(temperature, top_k, top_p, 1.0, seed))
    if session_file is not None:
        session.handle(f"/load {session_file}")
    if lines is not None:
        run_script(session, lines)
    else:
        run_interactive(session)
