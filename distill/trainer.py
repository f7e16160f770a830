"""The distillation trainer: student <- teacher's cached top-k logits (+ optional CE and hidden-state MSE).

**Data order.** Sample i of the run (i = step * batch_size + j) is block perm_e[i mod N] of epoch
e = i // N, where perm_e is a permutation drawn from a generator seeded with (seed, e). The order is a
pure function of the step, so the data position of a checkpoint is just its step number, and under
DDP rank r takes the r-th equal slice of each global batch: W processes see exactly the samples one
process sees with the same global batch, and DDP's gradient average equals the single-process mean.

**Checkpoints** (`<out>/checkpoints/step-NNNNNN.pt`, torch.save written to a temporary name and
renamed) hold the student (with any hidden-state projection), the AdamW state, the step, the RNG
states and the training config. Learning rates are a function of the step, so there is no scheduler
state. Resuming restores all of it and continues bit for bit where the run stopped; a config that
differs from the checkpoint's is refused. SIGINT/SIGTERM finish the current step, write a checkpoint
and stop (all ranks at the same step).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import Tensor, nn

from edgefinfer.files.atomic import atomic_file
from edgefinfer.distill import distributed
from edgefinfer.distill.losses import TAILS, forward_kl_topk, hidden_mse, next_token_ce
from edgefinfer.errors import UserError
from edgefinfer.model.transformer import Transformer

LOG_NAME = "train_log.jsonl"
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8  # sequences per optimizer step, summed over all processes
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    temperature: float = 1.0
    topk_tail: str = "bucket"  # how the teacher's top-k becomes a target: "bucket" | "renormalize" (losses.py)
    kd_weight: float = 1.0  # forward KL against the teacher's top-k
    ce_weight: float = 0.0  # next-token cross-entropy on the data
    hidden_weight: float = 0.0  # MSE between hidden states, see hidden_pairs
    hidden_pairs: tuple[tuple[int, int], ...] = ()  # (student state, teacher state), indices of hidden_states()
    projection: str = "learned"  # student -> teacher width when they differ: "learned" or "fixed" (random, frozen)
    seed: int = 0
    # Bookkeeping only: these may change between a run and its resumption.
    checkpoint_every: int = 0  # 0: only when stopping
    keep_checkpoints: int = 2
    log_every: int = 1

    def validate(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0:
            raise UserError(f"steps and batch size must be positive, got {self.steps} and {self.batch_size}")
        if self.temperature <= 0:
            raise UserError(f"temperature must be positive, got {self.temperature}")
        if min(self.kd_weight, self.ce_weight, self.hidden_weight) < 0 or \
                self.kd_weight + self.ce_weight + self.hidden_weight == 0:
            raise UserError("loss weights must be >= 0 and not all zero (--kd-weight, --ce-weight, --hidden-weight)")
        if self.hidden_weight > 0 and not self.hidden_pairs:
            raise UserError("a hidden-state loss needs at least one (student, teacher) layer pair")
        if self.topk_tail not in TAILS:
            raise UserError(f"top-k tail must be one of {', '.join(TAILS)}, got {self.topk_tail!r}")
        if self.projection not in ("learned", "fixed"):
            raise UserError(f"projection must be 'learned' or 'fixed', got {self.projection!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise UserError(f"warmup steps must be in [0, steps), got {self.warmup_steps}")

    def identity(self) -> dict:
        """The fields that make a run what it is (a checkpoint resumes only under the same ones)."""
        d = asdict(self)
        for k in ("checkpoint_every", "keep_checkpoints", "log_every"):
            d.pop(k)
        d["hidden_pairs"] = [list(p) for p in self.hidden_pairs]
        return d


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def batch_rows(step: int, batch_size: int, num_blocks: int, seed: int) -> list[int]:
    """Block indices of the global batch at `step` (see the module docstring)."""
    rows, perm, epoch = [], None, -1
    for i in range(step * batch_size, (step + 1) * batch_size):
        if i // num_blocks != epoch:
            epoch = i // num_blocks
            perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        rows.append(int(perm[i % num_blocks]))  # type: ignore[index]
    return rows


def rank_slice(rows: list[int], info: distributed.DistInfo) -> list[int]:
    per = len(rows) // info.world
    return rows[info.rank * per: (info.rank + 1) * per]


class Source(Protocol):
    """Training data: token blocks and, for distillation, what the teacher said about them."""

    def __len__(self) -> int: ...

    def batch(self, rows: list[int], device: torch.device | str = "cpu") -> dict[str, Tensor]: ...


class TokenSource:
    """Plain token blocks (no teacher): for CE-only training."""

    def __init__(self, blocks: Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def batch(self, rows: list[int], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        return {"tokens": self.blocks[rows].to(device)}


class FixedProjection(nn.Module):
    """A frozen random map d_s -> d_t (scaled so it roughly preserves norms)."""

    def __init__(self, d_in: int, d_out: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("weight", torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.T


def _projection(d_in: int, d_out: int, cfg: TrainConfig, index: int) -> nn.Module:
    """Identity when the widths agree; else a learned or frozen random map, seeded by (seed, index) only."""
    if d_in == d_out:
        return nn.Identity()
    if cfg.projection == "fixed":
        return FixedProjection(d_in, d_out, cfg.seed * 1009 + index)
    proj = nn.Linear(d_in, d_out, bias=False)
    g = torch.Generator().manual_seed(cfg.seed * 1009 + index)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in))
    return proj


class DistillModule(nn.Module):
    """The trained module (what DDP wraps): the student plus the projections of its hidden states."""

    def __init__(self, student: Transformer, cfg: TrainConfig, teacher_width: int):
        super().__init__()
        self.student = student
        self.pairs = cfg.hidden_pairs if cfg.hidden_weight > 0 else ()
        d_s = student.config.hidden_size
        self.projections = nn.ModuleList(_projection(d_s, teacher_width, cfg, i) for i in range(len(self.pairs)))

    def forward(self, tokens: Tensor) -> tuple[Tensor, list[Tensor]]:
        states = self.student.hidden_states(tokens)  # L+1 x [B, S, d]
        logits = self.student.lm_head(states[-1])  # [B, S, V]
        return logits, [proj(states[s]) for proj, (s, _) in zip(self.projections, self.pairs)]


def loss_terms(cfg: TrainConfig, logits: Tensor, hidden: list[Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The weighted terms and their sum under "loss"."""
    terms: dict[str, Tensor] = {}
    if cfg.kd_weight > 0:
        terms["kd"] = forward_kl_topk(logits, batch["values"], batch["indices"], cfg.temperature, batch.get("lse"),
                                      cfg.topk_tail)
    if cfg.ce_weight > 0:
        terms["ce"] = next_token_ce(logits, batch["tokens"])
    if cfg.hidden_weight > 0:
        terms["hidden"] = sum(hidden_mse(h, batch[f"hidden_{t}"]) for h, (_, t) in zip(hidden, cfg.hidden_pairs)
                              ) / len(hidden)  # type: ignore[assignment]
    weights = {"kd": cfg.kd_weight, "ce": cfg.ce_weight, "hidden": cfg.hidden_weight}
    terms["loss"] = sum(weights[k] * v for k, v in terms.items())  # type: ignore[assignment]
    return terms


@dataclass
class TrainResult:
    student: Transformer
    step: int  # steps completed
    tokens: int  # tokens trained on in this process group, since the start of the run
    seconds: float  # wall time of this invocation's training loop
    tok_s: float  # tokens per second in this invocation (all processes together)
    last: dict = field(default_factory=dict)  # the last logged losses
    stopped_early: bool = False


class _StopFlag:
    """Set by SIGINT/SIGTERM; the loop checks it between steps."""

    def __init__(self) -> None:
        self.set = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> "_StopFlag":
        if hasattr(signal, "SIGTERM") and _main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, _sig, _frame) -> None:
        self.set = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class Trainer:
    """Runs `cfg.steps` optimizer steps on `source`, checkpointing under `out_dir`; resumes automatically."""

    def __init__(self, student: Transformer, source: Source, cfg: TrainConfig, out_dir: str | Path,
                 teacher_width: int | None = None, device: torch.device | str = "cpu",
                 info: distributed.DistInfo = distributed.DistInfo(), log: Callable[[str], None] | None = None):
        cfg.validate()
        if len(source) == 0:
            raise UserError("the training corpus is empty: no token blocks to train on")
        if cfg.batch_size % info.world:
            raise UserError(f"the global batch ({cfg.batch_size}) must be divisible by the number of processes "
                            f"({info.world})")
        meta = getattr(source, "meta", None)
        if cfg.kd_weight > 0 and meta is not None and meta.temperature != cfg.temperature:
            raise UserError(f"the teacher cache was built at temperature {meta.temperature}, the run asks for "
                            f"{cfg.temperature}; rebuild the cache at the run's temperature")
        self.cfg, self.source, self.info = cfg, source, info
        self.device = torch.device(device)
        self.out = Path(out_dir)
        self.log = log if log is not None else (_stderr if info.is_main else None)
        self.module = DistillModule(student, cfg, teacher_width or student.config.hidden_size).to(self.device)
        self.module.train()
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay, foreach=False)
        self.step = 0
        self.tokens = 0
        self._resume()
        self.ddp = self.module
        if info.distributed:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.module, device_ids=ids)

    # ---- checkpoints --------------------------------------------------------------------------
    def checkpoint_paths(self) -> list[Path]:
        return sorted((self.out / CHECKPOINTS).glob("step-*.pt"))

    def _resume(self) -> None:
        paths = self.checkpoint_paths()
        if not paths:
            return
        state = torch.load(paths[-1], map_location="cpu", weights_only=True)  # load_state_dict moves it
        if state["config"] != self.cfg.identity():
            diff = sorted(k for k in state["config"] if state["config"][k] != self.cfg.identity().get(k))
            raise UserError(f"{self.out} holds a run with different settings ({', '.join(diff)}); "
                            "rerun with the same options or use a new output folder")
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"])
        if torch.cuda.is_available() and state["rng"].get("cuda"):
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        if self.info.is_main:
            _truncate_log(self.out / LOG_NAME, self.step)
        if self.log:
            self.log(f"resuming from {paths[-1]} (step {self.step}/{self.cfg.steps})")

    def save_checkpoint(self) -> Path | None:
        if not self.info.is_main:
            return None
        folder = self.out / CHECKPOINTS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step-{self.step:06d}.pt"
        state = {
            "step": self.step, "tokens": self.tokens, "config": self.cfg.identity(),
            "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
            "rng": {"cpu": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        }
        with atomic_file(path) as tmp:  # a checkpoint torn by a kill would be resumed from
            torch.save(state, tmp)
        for old in self.checkpoint_paths()[:-max(1, self.cfg.keep_checkpoints)]:
            old.unlink(missing_ok=True)
        return path

    # ---- the loop -----------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(cfg, self.step)
        rows = rank_slice(batch_rows(self.step, cfg.batch_size, len(self.source), cfg.seed), self.info)
        batch = self.source.batch(rows, self.device)
        logits, hidden = self.ddp(batch["tokens"])
        terms = loss_terms(cfg, logits, hidden, batch)
        self.optimizer.zero_grad(set_to_none=True)
        terms["loss"].backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        self.tokens += cfg.batch_size * batch["tokens"].shape[1]
        names = sorted(terms)
        values = distributed.mean_over_ranks(torch.stack([terms[k].detach().float() for k in names]), self.info)
        return {k: float(v) for k, v in zip(names, values.cpu())}

    def run(self, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
        """Train to cfg.steps (from wherever the checkpoints say); `on_step(step, losses)` after each step."""
        cfg = self.cfg
        t0, start_step, start_tokens = time.perf_counter(), self.step, self.tokens
        last: dict = {}
        stopped = False
        with _StopFlag() as stop:
            while self.step < cfg.steps:
                last = self.train_step()
                elapsed = time.perf_counter() - t0
                tok_s = (self.tokens - start_tokens) / elapsed if elapsed > 0 else 0.0
                record = {"step": self.step, **last,
                          "lr": learning_rate(cfg, self.step - 1), "tok_s": round(tok_s, 1),
                          "elapsed_s": round(elapsed, 2)}
                if self.info.is_main:
                    _append_log(self.out / LOG_NAME, record)
                if self.log and (self.step % cfg.log_every == 0 or self.step == cfg.steps):
                    self.log(_progress_line(record, cfg.steps, self.step - start_step, elapsed))
                if on_step is not None:
                    on_step(self.step, last)
                stopped = distributed.any_rank(stop.set, self.info, self.device) and self.step < cfg.steps
                due = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                if due or stopped or self.step == cfg.steps:
                    self.save_checkpoint()
                if stopped:
                    if self.log:
                        self.log(f"stopped at step {self.step}/{cfg.steps}; rerun the same command to resume")
                    break
        distributed.barrier(self.info)
        seconds = time.perf_counter() - t0
        tok_s = (self.tokens - start_tokens) / seconds if seconds > 0 else 0.0
        return TrainResult(self.module.student, self.step, self.tokens, seconds, tok_s, last, stopped)


def _progress_line(r: dict, total: int, done_here: int, elapsed: float) -> str:
    terms = "  ".join(f"{k} {r[k]:.4f}" for k in ("kd", "ce", "hidden") if k in r)
    eta = elapsed / max(done_here, 1) * (total - r["step"])
    return (f"step {r['step']}/{total}  loss {r['loss']:.4f}  ({terms})  lr {r['lr']:.2e}  "
            f"{r['tok_s']:.0f} tok/s  eta {eta:.0f}s")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _append_log(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines of steps after `step` (written by the interrupted run after its last checkpoint)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in lines))


def read_log(out_dir: str | Path) -> list[dict]:
    path = Path(out_dir) / LOG_NAME
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
