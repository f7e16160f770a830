"""Distillation: top-k losses, the teacher cache, exact resume, DDP parity, the measured effect, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from edgefinfer.model.checkpoint import load_model, save_model
from edgefinfer.errors import UserError
from edgefinfer.distill.losses import forward_kl, forward_kl_topk
from edgefinfer.distill.student import student_from_config, student_from_pruning
from edgefinfer.distill.teacher_cache import TeacherCache, build_teacher_cache
from edgefinfer.distill.trainer import TokenSource, Trainer, TrainConfig, batch_rows, rank_slice, read_log
from edgefinfer.distill.distributed import DistInfo
from tests.helpers import tiny_model

GQA = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=48, intermediate_size=64)


def blocks(n: int = 8, s: int = 16, vocab: int = 97, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (n, s), generator=torch.Generator().manual_seed(seed))


# ---- losses ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_topk_kl_with_k_equal_to_the_vocabulary_is_the_full_kl(tail, T):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 11, generator=g) * 3, torch.randn(3, 5, 11, generator=g) * 3
    top = t.topk(11, dim=-1)
    got = forward_kl_topk(s, top.values, top.indices, T, torch.logsumexp(t / T, -1), tail)
    expected = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True,
                        reduction="none").sum(-1).mean() * T * T
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert forward_kl(s, t, T).item() == pytest.approx(expected.item(), rel=1e-5)


def test_topk_kl_by_hand_tail_bucket_and_renormalisation():
    t = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # teacher logits; top 2 = tokens 0 and 1
    s = torch.tensor([[0.5, 1.5, 0.0, 0.0]])
    p, q = t.softmax(-1)[0], s.softmax(-1)[0]
    top = t.topk(2, -1)
    # Tail bucket: the teacher's true p on the top 2, plus "anything else" with mass r.
    r, q_tail = 1 - p[:2].sum(), q[2:].sum()
    bucket = (p[:2] * (p[:2] / q[:2]).log()).sum() + r * (r / q_tail).log()
    got = forward_kl_topk(s, top.values, top.indices, 1.0, torch.logsumexp(t, -1), "bucket")
    assert got.item() == pytest.approx(bucket.item(), rel=1e-6)
    # Renormalised: p restricted to the top 2 and rescaled to sum to 1, against the student's full q.
    p2 = p[:2] / p[:2].sum()
    renorm = (p2 * (p2 / q[:2]).log()).sum()
    got = forward_kl_topk(s, top.values, top.indices, 1.0, None, "renormalize")
    assert got.item() == pytest.approx(renorm.item(), rel=1e-6)
    full = (p * (p / q).log()).sum()
    assert bucket < full  # coarsening never overstates the KL


# ---- the teacher cache --------------------------------------------------------------------------------

def test_teacher_cache_holds_the_teachers_top_k_and_is_reused(tmp_path):
    teacher = tiny_model(**GQA)
    data = blocks()
    cache = build_teacher_cache(teacher, data, tmp_path / "c", top_k=5, hidden_layers=(3,), temperature=2.0)
    with torch.no_grad():
        states = teacher.hidden_states(data)
        logits = teacher.lm_head(states[-1])
    batch = cache.batch([3, 1])
    top = logits[[3, 1]].topk(5, dim=-1)
    assert torch.equal(batch["tokens"], data[[3, 1]]) and torch.equal(batch["indices"], top.indices)
    assert torch.allclose(batch["values"], top.values, atol=1e-6)
    assert torch.allclose(batch["lse"], torch.logsumexp(logits[[3, 1]] / 2.0, -1), atol=1e-5)
    assert torch.allclose(batch["hidden_3"], states[3][[3, 1]], atol=1e-6)
    assert 0 < cache.meta.coverage < 1 and len(cache) == 8
    # Same teacher, data and settings: reused as is, the teacher does not run again.
    stamp = (tmp_path / "c" / "values.npy").stat().st_mtime_ns
    teacher.hidden_states = None  # would fail if called
    again = build_teacher_cache(teacher, data, tmp_path / "c", top_k=5, hidden_layers=(3,), temperature=2.0)
    assert again.meta == cache.meta and (tmp_path / "c" / "values.npy").stat().st_mtime_ns == stamp


def test_a_changed_teacher_rebuilds_the_cache(tmp_path):
    build_teacher_cache(tiny_model(seed=0), blocks(), tmp_path / "c", top_k=4)
    key = TeacherCache(tmp_path / "c").meta.key
    build_teacher_cache(tiny_model(seed=1), blocks(), tmp_path / "c", top_k=4)
    assert TeacherCache(tmp_path / "c").meta.key != key


# ---- data order ---------------------------------------------------------------------------------------

def test_batches_cover_every_block_once_per_epoch_and_split_across_ranks():
    rows = [r for step in range(5) for r in batch_rows(step, 4, 10, seed=3)]  # 20 samples = 2 epochs
    assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:]) == list(range(10))
    assert rows[:10] != rows[10:]  # a fresh order each epoch
    assert batch_rows(2, 4, 10, seed=3) == rows[8:12]  # a pure function of the step
    glob = batch_rows(1, 4, 10, seed=3)
    assert rank_slice(glob, DistInfo(0, 2)) + rank_slice(glob, DistInfo(1, 2)) == glob


# ---- training and exact resume ------------------------------------------------------------------------

def small_run(tmp_path: Path, name: str, steps: int = 6, **cfg) -> tuple[Trainer, TeacherCache]:
    teacher = tiny_model(**GQA)
    cache = build_teacher_cache(teacher, blocks(12), tmp_path / "cache", top_k=8)
    student, _ = student_from_pruning(teacher, blocks(2), "0.7", layers=2, multiple_of=8)
    config = TrainConfig(**{"steps": steps, "batch_size": 4, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1,
                            "ce_weight": 0.5, **cfg})
    return Trainer(student, cache, config, tmp_path / name, log=lambda _: None), cache


class Crash(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path):
    straight, _ = small_run(tmp_path, "straight", checkpoint_every=2)
    final = straight.run().student.state_dict()

    def crash_after_3(step, _losses):
        if step == 3:
            raise Crash  # killed mid-run: the last checkpoint is step 2
    crashed, _ = small_run(tmp_path, "resumed", checkpoint_every=2)
    with pytest.raises(Crash):
        crashed.run(on_step=crash_after_3)
    resumed, _ = small_run(tmp_path, "resumed", checkpoint_every=2)
    assert resumed.step == 2
    result = resumed.run()
    assert result.step == 6
    for name, tensor in result.student.state_dict().items():
        assert torch.equal(tensor, final[name]), name  # bit for bit
    assert [r["step"] for r in read_log(tmp_path / "resumed")] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_log(tmp_path / "resumed")] == [r["loss"] for r in read_log(tmp_path / "straight")]


def test_sigint_finishes_the_step_checkpoints_and_stops(tmp_path):
    trainer, _ = small_run(tmp_path, "run")
    result = trainer.run(on_step=lambda step, _: step == 2 and os.kill(os.getpid(), signal.SIGINT))
    assert result.stopped_early and result.step == 2
    assert [p.name for p in trainer.checkpoint_paths()] == ["step-000002.pt"]
    resumed, _ = small_run(tmp_path, "run")
    assert resumed.step == 2 and resumed.run().step == 6


def test_resuming_with_other_settings_is_refused(tmp_path):
    small_run(tmp_path, "run", checkpoint_every=2)[0].run()
    with pytest.raises(UserError, match=r"different settings \(lr\)"):
        small_run(tmp_path, "run", checkpoint_every=2, lr=5e-3)
    small_run(tmp_path, "run", checkpoint_every=3)  # bookkeeping options may change


def test_hidden_state_loss_trains_a_learned_projection_and_freezes_a_fixed_one(tmp_path):
    teacher = tiny_model(**GQA)
    cache = build_teacher_cache(teacher, blocks(8), tmp_path / "cache", top_k=8, hidden_layers=(3,))
    narrow = teacher.config.replace(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2)
    for projection in ("learned", "fixed"):
        cfg = TrainConfig(steps=3, batch_size=2, hidden_weight=1.0, hidden_pairs=((2, 3),), projection=projection)
        trainer = Trainer(student_from_config(narrow), cache, cfg, tmp_path / projection, teacher_width=48,
                          log=lambda _: None)
        proj = trainer.module.projections[0]
        before = proj.weight.clone()
        result = trainer.run()
        assert "hidden" in result.last and result.last["hidden"] > 0
        assert torch.equal(proj.weight, before) == (projection == "fixed")


def test_without_a_teacher_the_trainer_is_a_plain_language_model_trainer(tmp_path):
    student = student_from_config(tiny_model(**GQA).config)
    data = (torch.arange(16)[None] * 3 + torch.arange(16)[:, None]) % 97  # [16, 16] arithmetic progressions
    result = Trainer(student, TokenSource(data), TrainConfig(steps=30, batch_size=4, lr=1e-2, kd_weight=0, ce_weight=1),
                     tmp_path / "lm", log=lambda _: None).run()
    log = read_log(tmp_path / "lm")
    assert log[-1]["ce"] < 0.5 * log[0]["ce"] and result.tok_s > 0


# ---- a real, small distillation: a tiny Austen teacher ---------------------------------------------------

@pytest.fixture(scope="module")
def austen_teacher(tmp_path_factory) -> Path:
    """A 230k-parameter Llama trained for ~100 steps on 300k characters of Austen, with a 512-token BPE."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from edgefinfer.data.corpora import load_text, token_blocks
    from edgefinfer.tokenization.tokenizer import Tokenizer

    text = load_text("train")[:300_000]
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=512, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok = Tokenizer(backend)
    config = tiny_model().config.replace(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         tie_word_embeddings=True, eos_token_id=None)
    root = tmp_path_factory.mktemp("austen")
    data = token_blocks(tok.encode(text), 64)
    cfg = TrainConfig(steps=100, batch_size=16, lr=3e-3, min_lr=3e-4, warmup_steps=10, kd_weight=0, ce_weight=1)
    teacher = Trainer(student_from_config(config), TokenSource(data), cfg, root / "run", log=lambda _: None).run()
    save_model(teacher.student.eval(), root / "teacher")
    tok.save(root / "teacher")
    (root / "corpus.txt").write_text(text)
    return root


def invoke(*args: str):
    from click.testing import CliRunner

    from edgefinfer.app.distill_command import distill

    return CliRunner().invoke(distill, list(args))


def test_distillation_measurably_lowers_a_pruned_students_perplexity(austen_teacher, tmp_path, monkeypatch):
    """Teacher pruned to ~50% of its parameters (2 of 4 layers, 1 of 2 KV groups), then 60 KD steps."""
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "student"
    result = invoke(str(austen_teacher / "teacher"), str(out), "--params", "0.5", "--layers", "2", "--kv-heads", "1",
                    "--multiple-of", "16", "--calib-blocks", "8", "--calib-len", "64",
                    "--corpus", str(austen_teacher / "corpus.txt"), "--steps", "60", "--batch-size", "16",
                    "--block-len", "64", "--lr", "1e-3", "--min-lr", "1e-4", "--top-k", "32",
                    "--eval-tokens", "3000", "--log-every", "20")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "distill_report.json").read_text())
    print(f"teacher {report['test_ppl_teacher']:.1f}, pruned student {report['test_ppl_before']:.1f} -> "
          f"distilled {report['test_ppl_after']:.1f} ({report['params_student']} / {report['params_teacher']} params, "
          f"{report['train_seconds']:.1f}s)")
    assert report["params_student"] <= 0.5 * report["params_teacher"]
    assert report["test_ppl_before"] > 1.1 * report["test_ppl_teacher"]  # pruning hurt...
    assert report["test_ppl_after"] < 0.92 * report["test_ppl_before"]  # ...and distillation won much of it back
    assert report["tokens_trained"] == 60 * 16 * 64 and report["steps"] == 60
    student = load_model(out / "model")
    assert student.config.num_hidden_layers == 2 and student.config.num_key_value_heads == 1
    assert (out / "model" / "tokenizer.json").read_text() == (austen_teacher / "teacher" / "tokenizer.json").read_text()


def test_a_student_from_a_config_starts_random_and_trains(austen_teacher, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEFINFER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "student.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 32,
                                                       "intermediate_size": 64}))
    result = invoke(str(austen_teacher / "teacher"), str(tmp_path / "out"), "--student-config",
                    str(tmp_path / "student.json"), "--corpus", str(austen_teacher / "corpus.txt"), "--steps", "3",
                    "--batch-size", "2", "--block-len", "32", "--eval-tokens", "0", "--hidden-weight", "0.5",
                    "--hidden-pairs", "2:4", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output[result.output.index("{"):])
    assert report["shape"] == {"layers": 2, "kv_heads": 2, "heads": 4, "intermediate_size": 64}
    assert "random init" in report["student_source"] and report["final_losses"]["hidden"] > 0
    assert load_model(tmp_path / "out" / "model").config.hidden_size == 32


def test_torchrun_with_two_processes_follows_the_single_process_loss_curve(austen_teacher, tmp_path):
    """Same global batch (8): 1 process x 8 sequences vs 2 processes x 4, gloo on CPU."""
    common = [str(austen_teacher / "teacher"), "--params", "0.6", "--layers", "3", "--multiple-of", "16",
              "--calib-blocks", "4", "--calib-len", "64", "--corpus", str(austen_teacher / "corpus.txt"),
              "--steps", "8", "--batch-size", "8", "--block-len", "32", "--lr", "1e-3", "--top-k", "16",
              "--eval-tokens", "0", "--teacher-cache", str(tmp_path / "cache")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EDGEFINFER_CACHE": str(tmp_path / "c")}
    one = subprocess.run([sys.executable, "-m", "edgefinfer.distill", *common[:1], str(tmp_path / "one"), *common[1:]],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "edgefinfer.distill", *common[:1], str(tmp_path / "two"), *common[1:]],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr
    report = json.loads((tmp_path / "two" / "distill_report.json").read_text())
    assert report["world_size"] == 2
    a, b = read_log(tmp_path / "one"), read_log(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    diffs = [abs(x["loss"] - y["loss"]) / x["loss"] for x, y in zip(a, b)]
    w1, w2 = load_model(tmp_path / "one" / "model"), load_model(tmp_path / "two" / "model")
    weight_diff = max((p - q).abs().max().item() for p, q in zip(w1.parameters(), w2.parameters()))
    print(f"1 vs 2 processes: max relative loss difference {max(diffs):.1e}, max weight difference {weight_diff:.1e}")
    assert max(diffs) < 3e-5 and weight_diff < 1e-5  # float32 sums in another order, nothing more


# ---- bad input ------------------------------------------------------------------------------------------

def run_main(monkeypatch, capsys, *args: str) -> tuple[int, list[str]]:
    from edgefinfer.app import cli
    from edgefinfer.app.distill_command import distill

    monkeypatch.setitem(cli.cli.commands, "distill", distill)
    code = cli.main(["distill", *args])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_student_with_another_tokenizer_is_refused(austen_teacher, tmp_path, monkeypatch, capsys):
    from tests.helpers import tiny_tokenizer

    other = tiny_tokenizer(vocab_size=512)
    save_model(tiny_model(vocab_size=512, eos_token_id=None), tmp_path / "other")
    other.save(tmp_path / "other")
    code, err = run_main(monkeypatch, capsys, str(austen_teacher / "teacher"), str(tmp_path / "o"),
                         "--student", str(tmp_path / "other"), "--corpus", str(austen_teacher / "corpus.txt"),
                         "--eval-tokens", "0")
    assert code == 2 and len(err) == 1 and "different tokenizers" in err[0]


@pytest.mark.parametrize("args,fragment", [
    (["--heads", "3"], "break the GQA groups"),
    (["--temperature", "0"], "temperature must be positive"),
    (["--student-config", "{}", "--student", "x"], "at most one of --student and --student-config"),
])
def test_bad_options_are_one_line_errors(austen_teacher, tmp_path, monkeypatch, capsys, args, fragment):
    code, err = run_main(monkeypatch, capsys, str(austen_teacher / "teacher"), str(tmp_path / "o"),
                         "--corpus", str(austen_teacher / "corpus.txt"), "--eval-tokens", "0", "--steps", "2", *args)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], err


def test_an_empty_corpus_is_a_one_line_error(austen_teacher, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.txt").write_text("")
    code, err = run_main(monkeypatch, capsys, str(austen_teacher / "teacher"), str(tmp_path / "o"),
                         "--corpus", str(tmp_path / "empty.txt"), "--eval-tokens", "0")
    assert code == 2 and len(err) == 1 and "empty" in err[0], err
    result = invoke(str(austen_teacher / "teacher"), str(tmp_path / "o2"), "--corpus", str(tmp_path / "empty.txt"))
    assert isinstance(result.exception, UserError)
