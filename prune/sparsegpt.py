"""SparseGPT (Frantar & Alistarh, 2023): prune a Linear and update its surviving weights so that the
layer's output on the calibration inputs changes as little as possible.

For a row w of W and inputs X, the layer-wise error ||X w - X w'||^2 has Hessian H = X^T X. Zeroing
weight j is compensated optimally (Optimal Brain Surgeon) by moving the weights not yet processed.
With U the upper Cholesky factor of H^-1 (U^T U = H^-1) and columns processed left to right, the
error e_j = (w_j - q_j) / U_jj is spread over the later columns as w[j:] -= e_j * U[j, j:]. Every row
shares U, so all rows update at once. The mask is chosen "adaptively" per block of columns from the
current (already compensated) weights, with the OBS saliency w_j^2 / U_jj^2.

Two choices that differ from the paper's reference code (documented in docs/COMPRESSION.md):
- unstructured masks compare within each row of a column block (exact per-row sparsity, the same
  comparison group as our Wanda) instead of across the whole block;
- the Hessian is the mean X^T X (the paper's 2 X^T X / n only rescales the dampening, which is relative).
"""

from __future__ import annotations

import torch
from torch import Tensor

from edgefinfer.errors import UserError
from edgefinfer.prune.masks import check_sparsity, n_m_mask, unstructured_mask


def inverse_hessian_factor(hessian: Tensor, damp: float = 0.01) -> tuple[Tensor, Tensor]:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, and the mask of dead input channels.

    A channel that never fired (H_jj == 0) carries no information: its weights are pruned outright and
    its diagonal set to 1 so the factorisation exists.
    """
    H = hessian.double().clone()  # [in, in]; float64: the inverse of a dampened Gram matrix is ill-conditioned
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(damp * torch.diag(H).mean())
    L = torch.linalg.cholesky(H)
    H_inv = torch.cholesky_inverse(L)
    U = torch.linalg.cholesky(H_inv, upper=True)
    return U.float(), dead


@torch.no_grad()
def sparsegpt_prune(weight: Tensor, hessian: Tensor, sparsity: float = 0.5, pattern: tuple[int, int] | None = None,
                    block_size: int = 128, damp: float = 0.01) -> Tensor:
    """The pruned and compensated weight [out, in] (a new tensor); `pattern=(n, m)` gives N:M sparsity."""
    check_sparsity(sparsity)
    W = weight.detach().float().clone()  # [out, in]
    out_features, in_features = W.shape
    if pattern is not None and (block_size % pattern[1] or in_features % pattern[1]):
        raise UserError(f"{pattern[0]}:{pattern[1]} sparsity needs an input dimension divisible by {pattern[1]}, "
                        f"got {in_features}")
    U, dead = inverse_hessian_factor(hessian, damp)
    W[:, dead] = 0.0

    for i1 in range(0, in_features, block_size):
        i2 = min(i1 + block_size, in_features)
        W1 = W[:, i1:i2].clone()  # [out, b] weights of this block, compensated as we go
        Q1 = torch.zeros_like(W1)  # pruned result
        E1 = torch.zeros_like(W1)  # scaled errors, to propagate to later blocks
        U1 = U[i1:i2, i1:i2]
        d = torch.diag(U1)  # [b]
        keep = None if pattern is not None else unstructured_mask(W1.pow(2) / d.pow(2), sparsity, "row")
        for j in range(i2 - i1):
            if pattern is not None and j % pattern[1] == 0:  # choose this N:M group's mask from current weights
                n, m = pattern
                group = W1[:, j: j + m].pow(2) / d[j: j + m].pow(2)  # [out, m]
                keep_group = n_m_mask(group, n, m)
            w = W1[:, j]
            kept = keep[:, j] if keep is not None else keep_group[:, j % pattern[1]]  # type: ignore[index]
            q = torch.where(kept, w, torch.zeros_like(w))
            err = (w - q) / d[j]  # [out]
            W1[:, j:] -= err[:, None] * U1[j, j:][None, :]
            Q1[:, j] = q
            E1[:, j] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    return W.to(weight.dtype)
