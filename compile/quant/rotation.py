"""Offline rotations (QuaRot / SpinQuant R1 + R2 without the learned part), fused into the weights.

A rotated model is still an ordinary Llama: the same modules, the same forward, no new runtime op,
so every exporter (ExecuTorch, ONNX, GGUF) ships it unchanged. In float it computes the same logits;
what changes is the *basis* the weights are stored in, where outliers are spread across channels and
round-to-nearest / GPTQ lose less (QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et al. 2024).

    rotate_model(model)                 # in place; returns a RotationReport

Three steps, each exact in float:

1. Fold every RMSNorm weight into the linears that read it (q/k/v <- input_layernorm, gate/up <-
   post_attention_layernorm, lm_head <- the final norm) and set the norm weights to 1. RMSNorm
   without a weight, x / rms(x), commutes with any orthogonal Q because ||x Q|| = ||x||.
2. R1: rotate the residual stream by one orthogonal Q [d, d]: the embedding rows and every writer
   into the stream (o_proj, down_proj: rows and biases) become W -> Q^T W, every reader (q/k/v,
   gate/up, lm_head) becomes W -> W Q.
3. R2: per attention head, rotate V by an orthogonal Hd [D, D] (v_proj rows per kv head, and its
   bias) and undo it on o_proj's matching input columns (per query head). Attention mixes V rows
   linearly per head, so this is exact, with grouped-query attention too (every query head of a
   group reads the same rotated V and gets the same Hd).

Q is a randomized Hadamard matrix H diag(s) / sqrt(d) (s random signs, seeded). Sizes that are not a
power of two use, as QuaRot does, the Kronecker product of a Walsh-Hadamard matrix with a small
Hadamard matrix (12, 20, 28, 36, ... from Paley's constructions): SmolLM2's 576 = 16 x 36. A size
with no such construction falls back to a random orthogonal matrix (`kind="orthogonal"` asks for it).

Tied embeddings: after folding the final norm into the head, the head is E diag(g) Q and the
embedding E Q. They are the same matrix only when g is a constant vector, so a tied model is untied
(config.tie_word_embeddings=False) and exporters write both tables; the report gives the extra
parameter count. (There is no exact alternative: keeping g unfolded would need g to commute with Q,
i.e. be a scalar, and scaling the residual stream per channel breaks RMSNorm's invariance.)

Not done: SpinQuant's online Hadamards (R3 on Q/K after RoPE, R4 before down_proj) need a runtime op
in every exporter's graph; the learned (Cayley-SGD) rotations need training.

What it buys depends on the model (bench/rotation.py). On SmolLM2-135M it helps GPTQ at g64-sym
(test ppl +11.8% -> +9.4%) but makes round-to-nearest much worse (int4-g32 +19% -> +42%), for two
measured reasons: its weights are dequantized Q4_1 (12 distinct values per group of 32), a grid any
mixing of weights destroys (R2 alone, which folds nothing, costs 7% at int4-g64-sym RTN); and folding
the norm gains is costly: they span 0.0002..0.35 within one norm, and the normalised residual carries
one massive channel (507, ~23x the RMS on almost every token) that the gains attenuate before the
weights see it, but that meets the full weight error once they are folded (folding alone, without a
rotation: 37 -> 56 ppl; keeping channel 507's gain unfolded: 46). A rotation cannot undo that; GPTQ,
which places the error away from the dominant input direction, can.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from edgefinfer.errors import UserError
from edgefinfer.model.transformer import MLP, Attention, DecoderLayer, DecoderStack, RMSNorm, Transformer

Kind = Literal["hadamard", "orthogonal"]
KINDS: tuple[str, ...] = ("hadamard", "orthogonal")
# Every module a rotation knows how to fold into (exact types: a quantized subclass is refused).
_FOLDABLE = (Transformer, DecoderStack, DecoderLayer, Attention, MLP, nn.ModuleList, RMSNorm, nn.Linear, nn.Embedding)


# ---- Hadamard matrices -------------------------------------------------------------------------------------

def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % p for p in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> Tensor:
    """Q[i, j] = chi(j - i) over GF(q), q prime: the quadratic character (0, +1 residue, -1 non-residue)."""
    residues = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> Tensor:
    """Order q + 1 for a prime q = 3 mod 4: H = I + S, S = [[0, 1^T], [-1, Q]] (skew)."""
    n = q + 1
    S = torch.zeros(n, n, dtype=torch.float64)
    S[0, 1:], S[1:, 0], S[1:, 1:] = 1, -1, _jacobsthal(q)
    return torch.eye(n, dtype=torch.float64) + S


def _paley2(q: int) -> Tensor:
    """Order 2 (q + 1) for a prime q = 1 mod 4: in C = [[0, 1^T], [1, Q]] (symmetric) replace 0 by
    [[1, -1], [-1, -1]] and +-1 by +-[[1, 1], [1, -1]]."""
    n = q + 1
    C = torch.zeros(n, n, dtype=torch.float64)
    C[0, 1:], C[1:, 0], C[1:, 1:] = 1, 1, _jacobsthal(q)
    zero = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    one = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(C, one) + torch.kron((C == 0).double(), zero)


def _small_hadamard(m: int) -> tuple[Tensor, str] | None:
    """A Hadamard matrix of order m (1, or from Paley I or II) and its name, or None."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64), ""
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley1(m - 1), f"paley-I {m} (q={m - 1})"
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley2(m // 2 - 1), f"paley-II {m} (q={m // 2 - 1})"
    return None


def hadamard_matrix(n: int) -> tuple[Tensor, str] | None:
    """An unnormalised Hadamard matrix of order n (+-1 entries, H H^T = n I) and how it was built, or
    None when neither a power of two nor 2^k times a Paley order covers n. Float64."""
    k = 1
    while n % k == 0:  # largest power-of-two factor first, so the small factor stays small
        k *= 2
    k //= 2
    while k >= 1:
        small = _small_hadamard(n // k)
        if small is not None:
            H, how = small
            walsh = torch.ones(1, 1, dtype=torch.float64)
            for _ in range(int(math.log2(k))):
                walsh = torch.kron(walsh, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
            name = " x ".join(part for part in (f"walsh {k}" if k > 1 else "", how) if part)
            return torch.kron(walsh, H), name or "1"
        k //= 2
    return None


def random_orthogonal(n: int, generator: torch.Generator) -> Tensor:
    """A Haar-random orthogonal matrix (QR of a Gaussian with the signs of R's diagonal fixed)."""
    q, r = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    return q * torch.sign(torch.diagonal(r))[None, :]


def rotation_matrix(n: int, kind: Kind = "hadamard", seed: int = 0) -> tuple[Tensor, str]:
    """An orthogonal [n, n] float64 matrix and its description: H diag(s) / sqrt(n) with random signs
    s (kind "hadamard", falling back to random orthogonal when no Hadamard of order n is built here)."""
    if kind not in KINDS:
        raise UserError(f"unknown rotation {kind!r}: use one of {', '.join(KINDS)}")
    gen = torch.Generator().manual_seed(seed)
    if kind == "hadamard":
        found = hadamard_matrix(n)
        if found is not None:
            H, how = found
            signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
            return H * signs[None, :] / math.sqrt(n), f"hadamard {how}"
    return random_orthogonal(n, gen), "random orthogonal"


# ---- the model -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RotationReport:
    residual: str  # how R1 was built, e.g. "hadamard walsh 16 x paley-II 36 (q=17)"
    head: str  # how R2 (per head) was built
    untied: bool  # the model tied its head to its embeddings and no longer does
    extra_parameters: int  # parameters added by untying (vocab x hidden), 0 otherwise
    seconds: float


def check_rotatable(model: nn.Module) -> None:
    """One-line UserError when `model` cannot take a fused rotation, saying why."""
    if not isinstance(model, Transformer):
        raise UserError(f"cannot rotate a {type(model).__name__}: rotations fold into edgefinfer's Transformer")
    for name, m in model.named_modules():
        if type(m) in _FOLDABLE:
            continue
        if isinstance(m, (nn.Linear, nn.Embedding)) or hasattr(m, "qweight"):
            raise UserError(f"cannot rotate: {name} is already quantized ({type(m).__name__}); a rotation must be "
                            "fused into the float weights before quantization (quantize the float model with a "
                            "-rot recipe)")
        raise UserError(f"cannot rotate: {name} is a {type(m).__name__}, which a rotation cannot be folded into "
                        "(only RMSNorm, float nn.Linear and nn.Embedding in a Llama-family decoder)")
    if model.config.sandwich_norms:
        raise UserError("cannot rotate: this model normalises its attention and MLP outputs (sandwich norms, Gemma), "
                        "and a norm's gain on a block output cannot be folded into a rotated residual stream; "
                        "use a recipe without -rot")
    w = model.lm_head.weight
    if w.device.type == "meta" or not w.dtype.is_floating_point:
        raise UserError("cannot rotate: the model's weights are not loaded float tensors")


@torch.no_grad()
def rotate_model(model: Transformer, kind: Kind = "hadamard", seed: int = 0) -> RotationReport:
    """Fold the RMSNorm weights and rotate `model` in place (see the module docstring); float logits
    are unchanged up to rounding. A tied head is untied (config.tie_word_embeddings becomes False)."""
    t0 = time.perf_counter()
    check_rotatable(model)
    cfg = model.config
    d, hd = cfg.hidden_size, cfg.dim_per_head
    Q, residual = rotation_matrix(d, kind, seed)
    Hd, head = rotation_matrix(hd, kind, seed + 1)

    untied = _untie(model)
    _fold_norms(model)

    stack = model.model
    _set(stack.embed_tokens.weight, stack.embed_tokens.weight.double() @ Q)  # rows are stream vectors
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for reader in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _rotate_input(reader, Q)
        for writer in (attn.o_proj, mlp.down_proj):
            _rotate_output(writer, Q)
        _rotate_heads(attn.v_proj, attn.o_proj, Hd, attn.n_kv_heads, attn.n_heads)
    _rotate_input(model.lm_head, Q)
    return RotationReport(residual, head, untied, cfg.vocab_size * d if untied else 0, time.perf_counter() - t0)


def _set(param: Tensor, value: Tensor) -> None:
    param.copy_(value.to(param.dtype))


def _untie(model: Transformer) -> bool:
    """Give the head its own copy of the embedding table; the config then says the model is untied,
    so checkpoints and every exporter write both."""
    if not model.config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        return False
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.config = model.config.replace(tie_word_embeddings=False)
    return True


def _fold_norms(model: Transformer) -> None:
    """RMSNorm(x) W^T = (x / rms(x)) (W diag(g))^T: move g into the readers, leave the norm weightless."""
    stack = model.model
    pairs = [(layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
             for layer in stack.layers]
    pairs += [(layer.mlp_norm, (layer.mlp.gate_proj, layer.mlp.up_proj)) for layer in stack.layers]
    pairs.append((stack.norm, (model.lm_head,)))
    for norm, readers in pairs:
        g = norm.weight.double()
        for lin in readers:
            _set(lin.weight, lin.weight.double() * g[None, :])
        norm.weight.fill_(1.0)


def _rotate_input(lin: nn.Linear, Q: Tensor) -> None:
    """The linear now reads x Q: y = (x Q)(W Q)^T = x W^T. Its bias lives in the output space: unchanged."""
    _set(lin.weight, lin.weight.double() @ Q)


def _rotate_output(lin: nn.Linear, Q: Tensor) -> None:
    """The linear now writes y Q into the rotated stream: W -> Q^T W, b -> b Q."""
    _set(lin.weight, Q.T @ lin.weight.double())
    if lin.bias is not None:
        _set(lin.bias, lin.bias.double() @ Q)


def _rotate_heads(v_proj: nn.Linear, o_proj: nn.Linear, Hd: Tensor, n_kv_heads: int, n_heads: int) -> None:
    """R2: every head's V becomes v Hd (v_proj rows per kv head: W_h -> Hd^T W_h, b_h -> b_h Hd), and the
    attention output of every query head, a mix of its group's V rows, is y Hd: o_proj's columns of
    that head become W[:, h] Hd so that (y Hd)(W_h Hd)^T = y W_h^T."""
    D = Hd.shape[0]
    W = v_proj.weight.double().reshape(n_kv_heads, D, -1)
    _set(v_proj.weight, (Hd.T @ W).reshape(n_kv_heads * D, -1))
    if v_proj.bias is not None:
        _set(v_proj.bias, (v_proj.bias.double().reshape(n_kv_heads, D) @ Hd).reshape(-1))
    Wo = o_proj.weight.double().reshape(-1, n_heads, D)
    _set(o_proj.weight, (Wo @ Hd).reshape(-1, n_heads * D))
