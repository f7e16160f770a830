"""Paged attention through the manager's block tables equals dense attention (fp32, < 1e-5)."""

import torch

from edgefinfer.runtime.kv.block_pool import builtin_block_hash
from edgefinfer.runtime.kv.paged_manager import PagedKVManager
from edgefinfer.runtime.kv.paged_torch import BatchRow, PagedBatch, PagedTensorStorage, pad_batch
from tests.helpers import tiny_model

BS = 4


def dense_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))[0]


def run_step(model, manager, storage, plans, new_tokens):
    """One forward over the sequences of `plans` (each feeding its `new_tokens`), as a scheduler would."""
    for plan in plans:
        plan.apply_to(storage)
    rows = [BatchRow(p.slot_mapping, p.block_ids, p.start_pos + len(t)) for p, t in zip(plans, new_tokens)]
    tokens, pos = pad_batch(new_tokens, [p.start_pos for p in plans])
    with torch.no_grad():
        logits = model(tokens, pos, PagedBatch(storage, rows, tokens.shape[1]))
    for p in plans:
        manager.mark_computed(p.seq_id)
    return [logits[b, : len(t)] for b, t in enumerate(new_tokens)]


def test_ragged_batch_shared_prefix_and_copy_on_write_equal_dense():
    model = tiny_model()
    manager = PagedKVManager(num_blocks=32, block_size=BS, hash_fn=builtin_block_hash)
    storage = PagedTensorStorage(model.config, 32, BS)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 97, (9,), generator=g).tolist()
    a = prefix + torch.randint(0, 97, (2,), generator=g).tolist()  # 11 tokens: the last block is partial
    c = torch.randint(0, 97, (5,), generator=g).tolist()  # unrelated, ragged

    # Step 1: prefill A and C together (ragged: 11 and 5 new tokens).
    pa, pc = manager.allocate("a", a), manager.allocate("c", c)
    out_a, out_c = run_step(model, manager, storage, [pa, pc], [a, c])
    assert (out_a - dense_logits(model, a)).abs().max() < 1e-5
    assert (out_c - dense_logits(model, c)).abs().max() < 1e-5

    # Step 2: B shares A's first two full blocks (8 tokens) and computes only its suffix.
    b = prefix + torch.randint(0, 97, (4,), generator=g).tolist()
    pb = manager.allocate("b", b)
    assert pb.num_cached_tokens == 8 and pb.block_ids[:2] == pa.block_ids[:2]
    (out_b,) = run_step(model, manager, storage, [pb], [b[8:]])
    assert (out_b - dense_logits(model, b)[8:]).abs().max() < 1e-5

    # Step 3: fork A (parallel sampling), then both write into the shared partial block: copy-on-write.
    manager.fork("a", "a2")
    ta, ta2 = [7], [11]
    plan_a, plan_a2 = manager.append("a", ta), manager.append("a2", ta2)
    assert plan_a.copy_ops or plan_a2.copy_ops  # somebody copied the shared last block
    la, la2 = run_step(model, manager, storage, [plan_a, plan_a2], [ta, ta2])
    assert (la - dense_logits(model, a + ta)[-1:]).abs().max() < 1e-5
    assert (la2 - dense_logits(model, a + ta2)[-1:]).abs().max() < 1e-5

    # Step 4: decode all four sequences in one batch.
    seqs = {"a": a + ta, "a2": a + ta2, "b": b, "c": c}
    nxt = {s: [int(torch.randint(0, 97, (1,), generator=g))] for s in seqs}
    plans = [manager.append(s, nxt[s]) for s in seqs]
    outs = run_step(model, manager, storage, plans, [nxt[s] for s in seqs])
    for s, out in zip(seqs, outs):
        assert (out - dense_logits(model, seqs[s] + nxt[s])[-1:]).abs().max() < 1e-5, s

    for s in list(seqs):
        manager.free(s)
    assert manager.stats().num_free == 32


def test_truncate_after_rejected_speculation_equals_dense():
    model = tiny_model()
    manager = PagedKVManager(num_blocks=16, block_size=BS, hash_fn=builtin_block_hash)
    storage = PagedTensorStorage(model.config, 16, BS)
    ids = list(range(3, 13))
    run_step(model, manager, storage, [manager.allocate("s", ids)], [ids])
    drafts = [50, 51, 52, 53]
    run_step(model, manager, storage, [manager.append("s", drafts)], [drafts])
    manager.truncate("s", len(ids) + 1).apply_to(storage)  # keep one accepted draft
    (out,) = run_step(model, manager, storage, [manager.append("s", [60])], [[60]])
    assert (out - dense_logits(model, ids + [50, 60])[-1:]).abs().max() < 1e-5


def test_runtime_paged_backend_on_a_window_model_holds_flat_blocks_and_recomputes_a_dropped_prefix():
    # `edgefinfer generate --kv paged:4` on a sliding-window model: the same manager as the server
    # drops the blocks behind the window; the tokens equal the ring cache's (`--kv window:10`).
    from edgefinfer.runtime.backends.torch_eager import TorchBackend
    from edgefinfer.runtime.backends.torch_paged import SEQ, PagedTorchBackend
    from edgefinfer.runtime.decode import generate_tokens

    model = tiny_model(seed=6, sliding_window=10)
    prompt = list(range(3, 10))
    paged = PagedTorchBackend(model, block_size=BS)
    held = []
    tokens = []
    for t in generate_tokens(paged, prompt, 50):
        tokens.append(t)
        held.append(paged.manager.num_held_blocks(SEQ))
    assert tokens == list(generate_tokens(TorchBackend(model, window=10), prompt, 50))
    assert max(held[20:]) <= -(-10 // BS) + 1 and paged.manager.first_stored_position(SEQ) > 30
    # Rolling back behind the window (a new prompt sharing only an early prefix) recomputes it.
    full = prompt + tokens
    paged.rollback(12)
    assert paged.manager.num_tokens(SEQ) == 12 and paged.manager.first_stored_position(SEQ) == 0
    got = paged.forward(full[12:20], 12)
    want = dense_logits(model, full[:20])[12:20]
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)
