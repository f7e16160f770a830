"""GPTQ (Frantar et al., 2022): quantize a weight matrix column by column, compensating each column's
rounding error on the not-yet-quantized columns through the inverse Hessian of the layer's inputs.

Minimises ||X W^T - X Q^T||^2 over the calibration inputs X, with H = 2 X^T X / T:

    H += damp * mean(diag H) * I                 (dampening: X^T X is singular for few tokens)
    U  = chol(H^-1) (upper)                      (the rows of U are the update directions)
    for each column j (in blocks of B columns, updating later blocks lazily with one matmul):
        q_j  = quant(w_j)
        e_j  = (w_j - dequant(q_j)) / U_jj
        w_k -= e_j * U_jk  for k > j

Groups: without act-order a group's scale and zero point are chosen when the sweep reaches its first
column, from the already error-compensated weights (so they fit what is actually rounded). With
act-order (columns by decreasing diag H, the most influential first) the group parameters are fixed
up front from the original weights ("static groups"), so groups stay contiguous runs of input
channels and the layout exporters read does not need a permutation (g_idx).

Rows are independent given H, so linears that read the same input (q/k/v, gate/up) are quantized as
one stacked matrix.

Damping sweep (`gptq_damp_sweep`): dampening trades fitting the calibration tokens against
generalising beyond them, and the best amount depends on the layer and on how many tokens there are.
For each candidate damp the weights are quantized with the Hessian of one half of the calibration
tokens and scored by the layer-output error on the other half (tr(dW H_val dW^T), exactly the
squared output error on those tokens); the winner is re-run on all tokens. Scoring on the tokens
that were fitted would always pick the smallest damp.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from edgefinfer.compile.quant.primitives import (IntWeights, choose_qparams, dequantize_int, group_qparams,
                                                 quantize_with, scale_storage_dtype, zero_dtype)
from edgefinfer.compile.quant.recipe import GPTQSettings, WeightFormat


def _inverse_hessian_factor(H: Tensor, damp: float) -> Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag) * I)^-1, increasing the dampening if H is not
    positive definite (it can be only semi-definite when calibration tokens are few or collinear)."""
    diag_mean = H.diagonal().mean().clamp(min=1e-8)
    eye = torch.eye(H.shape[0], dtype=H.dtype)
    for attempt in range(6):
        L, info = torch.linalg.cholesky_ex(H + (damp * 10**attempt) * diag_mean * eye)
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info == 0:
                return U
    raise RuntimeError("GPTQ: the Hessian stays singular after dampening up to 1e5 x damp")


@torch.no_grad()
def gptq_quantize(weight: Tensor, hessian: Tensor, fmt: WeightFormat, settings: GPTQSettings | None = None,
                  where: str = "this layer") -> IntWeights:
    """Codes, scales and zeros of `weight` [N, K] (float) given the input Hessian [K, K]."""
    settings = settings or GPTQSettings()
    N, K = weight.shape
    g = fmt.group_for(K, where)
    G = K // g
    W = weight.detach().float().clone()
    H = hessian.float().clone()

    dead = H.diagonal() == 0  # inputs that were always zero: their weights do not matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    scales = torch.zeros(G, N)  # transposed throughout: a column of W is a contiguous row here
    zeros = torch.zeros(G, N)
    if settings.act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
        s, z = group_qparams(W.reshape(N, G, g), fmt)  # static groups
        scales[:], zeros[:] = s.T, z.T
        W, H = W[:, perm], H[perm][:, perm]
        group_of = (perm // g).tolist()  # group of the j-th column in sweep order
    elif fmt.super_block:
        raise ValueError("K-quant super-blocks couple the scales of 8 groups: GPTQ chooses them up front, "
                         "with act-order")
    else:
        perm = None
        group_of = (torch.arange(K) // g).tolist()
    U = _inverse_hessian_factor(H, settings.damp)

    Wt = W.T.contiguous()  # [K, N]
    codes = torch.zeros(K, N)  # in sweep order
    # Without act-order a block must hold whole groups, so a group's parameters see updated weights.
    B = settings.block_size if settings.act_order else g * max(1, -(-settings.block_size // g))
    for i1 in range(0, K, B):
        i2 = min(i1 + B, K)
        W1 = Wt[i1:i2].clone()  # [b, N]
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j, gi = i1 + i, group_of[i1 + i]
            if perm is None and j % g == 0:
                scales[gi], zeros[gi] = choose_qparams(W1[i: i + g].T, fmt.bits, fmt.symmetric,
                                                       fmt.scale_dtype, fmt.float_zero)
            s, z, w = scales[gi], zeros[gi], W1[i]
            q = quantize_with(w, s, z, fmt.bits, fmt.symmetric, fmt.float_zero)
            codes[j] = q
            err = torch.sub(w, (q - z).mul_(s)).div_(U1[i, i])
            W1[i:].addr_(U1[i, i:], err, alpha=-1.0)  # w_k -= e_j * U_jk for the block's later columns
            E1[i] = err
        Wt[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1.0)  # lazy update of all later blocks at once

    codes, scales, zeros = codes.T, scales.T, zeros.T
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return IntWeights(codes.to(torch.int8), scales.to(scale_storage_dtype(fmt)), zeros.to(zero_dtype(fmt)))


def output_error(weight: Tensor, q: IntWeights, hessian: Tensor) -> float:
    """Mean squared output error of the quantized weights on the tokens behind `hessian` (= 2 X^T X / T):
    ||X dW^T||^2 / T = tr(dW H dW^T) / 2, per output element."""
    dW = (weight.float() - dequantize_int(*q)).double()  # [N, K]
    return ((dW @ hessian.double()) * dW).sum().item() / (2 * dW.shape[0])


def gptq_damp_sweep(weight: Tensor, fit: Tensor, val: Tensor, full: Tensor, fmt: WeightFormat,
                    settings: GPTQSettings, where: str = "this layer") -> tuple[IntWeights, float]:
    """GPTQ with the damp of `settings.damp_grid` whose weights, fitted on the Hessian `fit`, give the
    least output error on the held-out tokens' Hessian `val`; re-run on `full` (all tokens)."""
    errors = {d: output_error(weight, gptq_quantize(weight, fit, fmt, replace(settings, damp=d), where), val)
              for d in settings.damp_grid}
    best = min(errors, key=errors.__getitem__)
    return gptq_quantize(weight, full, fmt, replace(settings, damp=best), where), best
