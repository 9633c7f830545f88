"""05_sequence_context_parallel: sequence parallelism, ring attention, zig-zag, against 01.

Layer level (2 gloo ranks, float64, so only summation order differs: 1e-12): ring attention,
all-gather K/V attention and Ulysses all-to-all attention (contiguous and zig-zag, grouped-query heads)
against dense causal attention, forward and the q/k/v gradients; a whole model under TP+SP and under CP
against the dense model (loss and every gradient, with SP's norm-gradient all-reduce and CP's gradient
averaging applied).
Formulas measured, not assumed: SP moves the same bytes as TP (all-reduce = reduce-scatter +
all-gather), CP sends cp−1 K/V blocks per layer forward (cp−1 K/V + cp dK/dV backward), SP divides
the norm-region activations by tp and changes nothing else, CP divides all activations by cp,
zig-zag gives every rank the same number of attention tiles while contiguous does not; all-gather K/V
moves (cp−1) blocks each way and saves (cp−1) blocks per layer more than the ring.
Whole runs (float32, 3 AdamW steps) equal 01 for the same global batch, with the tolerances of
test_tensor_parallel.py (same reasons; ring attention's log-sum-exp merge rounds like SDPA's).
"""
import contextlib
import copy
import os
from importlib import import_module

import pytest
import torch
import torch.distributed as dist

import common
from harness import layout_results, run_layouts, run_ranks, selected
from test_tensor_parallel import EXACT, _leaf, assert_matches_reference, numbers, shard_like, train_layout

import cli
import model as modeling
import memory
import recompute
import process_grid
import comm
import mappings
import tensor_parallel
import sequence_parallel
import context_parallel
import ulysses
import allgather_kv
cp_train = import_module("05_sequence_context_parallel.train")

B, T, C, L, V = 2, 16, 32, 2, 64


def small_model(dtype):
    torch.manual_seed(0)
    config = modeling.LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=48, num_hidden_layers=L,
                                  num_attention_heads=4, num_key_value_heads=2)
    return modeling.LlamaForCausalLM(config).to(dtype)


def check_attention(grid, attn):
    """`attn` (ring, all-gather K/V or Ulysses) in both layouts against dense attention: output and q/k/v
    gradients, and the collectives each makes."""
    torch.manual_seed(1)
    # GQA: 4 q / 2 kv heads
    q, k, v = torch.randn(B, 4, T, 8), torch.randn(B, 2, T, 8), torch.randn(B, 2, T, 8)
    dense = [_leaf(t) for t in (q, k, v)]
    out = modeling.sdpa_attention(*dense)        # float64 throughout (eager's softmax is float32)
    upstream = torch.randn_like(out)
    out.backward(upstream)
    for kind in context_parallel.LAYOUTS:
        layout = context_parallel.CPLayout(kind, grid.cp_size)
        pos = layout.positions(grid.cp_rank, T)
        mine = [_leaf(t[:, :, pos]) for t in (q, k, v)]
        with comm.CommMeter(grid.group_names()) as forward:
            cp_out = attn(layout, grid.cp_group)(*mine)
        torch.testing.assert_close(cp_out, out[:, :, pos], **EXACT)
        with comm.CommMeter(grid.group_names()) as backward:
            cp_out.backward(upstream[:, :, pos])
        for got, want in zip(mine, dense):
            torch.testing.assert_close(got.grad, want.grad[:, :, pos], **EXACT)
        if attn is ulysses.UlyssesAttention:   # q, k, v there and the output back; the reverse in backward
            assert dict(forward.calls) == dict(backward.calls) == {("all_to_all", "cp"): 4}
            local = B * (T // 2) * 8 * (4 + 2 + 2 + 4) * 8     # b·(s/cp)·hd·(nh + 2·nkv + nh) float64
            assert forward.total_wire() == backward.total_wire() == local // 2   # (cp−1)/cp leaves
        if attn is allgather_kv.AllGatherKVAttention:   # one block (2, B, nkv, T/cp, hd) float64 each way
            assert dict(forward.calls) == {("all_gather", "cp"): 1}
            assert dict(backward.calls) == {("reduce_scatter", "cp"): 1}
            assert forward.total_wire() == backward.total_wire() == 2 * B * 2 * (T // 2) * 8 * 8
    return True


def dense_run():
    """The float64 dense model after one backward on a batch, and that batch."""
    dense = small_model(torch.float64)
    ids = torch.randint(0, V, (B, T + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    dense(x, labels=y).backward()
    return dense, x, y


def check_sp(tp_grid):
    """TP+SP model against the dense model: loss and all gradients (SP's norm-gradient sum applied)."""
    dense, x, y = dense_run()
    sp = copy.deepcopy(dense)
    norms = sequence_parallel.norm_weights(sequence_parallel.apply_sequence_parallel(sp, tp_grid))
    loss = sp(x, labels=y)
    loss.backward()
    sequence_parallel.all_reduce_norm_gradients(norms, tp_grid.tp_group)
    torch.testing.assert_close(loss, dense(x, labels=y), **EXACT)
    for (name, p), want in zip(sp.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(p.grad, shard_like(want.grad, p.grad, tp_grid.tp_rank, tp_grid.tp_size),
                                   **EXACT, msg=name)
    return True


def check_models(cp_grid):
    """The CP model in both layouts against the dense model: loss and all gradients."""
    dense, x, y = dense_run()
    for kind in context_parallel.LAYOUTS:
        layout = context_parallel.CPLayout(kind, cp_grid.cp_size)
        cp = context_parallel.apply_context_parallel(copy.deepcopy(dense), layout, cp_grid.cp_group)
        cp.zero_grad()
        pos = layout.positions(cp_grid.cp_rank, T)
        cp_loss = cp(x[:, pos], labels=y[:, pos], position_ids=pos)
        cp_loss.backward()
        # every rank holds T/cp tokens, none ignored: the mean of the means
        total = cp_loss.detach().clone()
        torch.distributed.all_reduce(total, group=cp_grid.cp_group)
        torch.testing.assert_close(total / cp_grid.cp_size, dense(x, labels=y), **EXACT)
        for (name, p), want in zip(cp.named_parameters(), dense.parameters(), strict=True):
            torch.distributed.all_reduce(p.grad, group=cp_grid.cp_group)   # mean over the cp ranks' tokens
            torch.testing.assert_close(p.grad / cp_grid.cp_size, want.grad, **EXACT, msg=name)


def saved_bytes(model, x, y, pos=None, only=None):
    """Bytes autograd saves for one forward: of the whole model (y given) or of its decoder (y None),
    or only inside the `only` modules (their forwards stay wrapped: measure those last)."""
    params = list(model.parameters())
    if only is None:
        with memory.saved_activation_bytes(exclude=params) as meter:
            model(x, labels=y, position_ids=pos) if y is not None else model.model(x, pos)
        return meter.bytes
    total = 0

    def measured(inner):
        def forward(*args):
            nonlocal total
            with memory.saved_activation_bytes(exclude=params) as meter:
                out = inner(*args)
            total += meter.bytes
            return out
        return forward
    for module in only:
        module.forward = measured(module.forward)
    model(x, labels=y, position_ids=pos)
    return total


@contextlib.contextmanager
def batches_posted():
    """Spy on dist.batch_isend_irecv: yields the list of batches posted, each [(op name, peer rank)]."""
    real, posted, c10d = dist.batch_isend_irecv, [], dist.distributed_c10d
    def spy(p2p_op_list):
        posted.append([("isend" if op.op is c10d.isend else "irecv", op.peer) for op in p2p_op_list])
        return real(p2p_op_list)
    dist.batch_isend_irecv = spy
    try:
        yield posted
    finally:
        dist.batch_isend_irecv = real


def measure(tp_grid, cp_grid, solo_grid):
    """Communication of one TP / TP+SP decoder layer and of ring attention; activation bytes."""
    out, ids = {}, torch.randint(0, V, (B, T + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    for name, regions in (("tp", mappings.TENSOR_PARALLEL), ("sp", sequence_parallel.SEQUENCE_PARALLEL)):
        model = tensor_parallel.apply_tensor_parallel(small_model(torch.float32), tp_grid, regions)
        h = torch.randn(B, T // (2 if name == "sp" else 1), C, requires_grad=True)
        cos, sin = model.model.rotary(torch.arange(T), torch.float32)
        with comm.CommMeter(tp_grid.group_names()) as forward:
            z, _ = model.model.layers[0](h, cos, sin)
        with comm.CommMeter(tp_grid.group_names()) as backward:
            z.sum().backward()
        out[name, "comm"] = [(dict(m.calls), dict(m.payload), m.total_wire()) for m in (forward, backward)]
        norm_modules = [m for m in model.modules() if isinstance(m, modeling.RMSNorm)]
        out[name, "model_bytes"] = saved_bytes(model, x, y)
        out[name, "norm_bytes"] = saved_bytes(model, x, y, only=norm_modules)
    for grid, cp in ((solo_grid, 1), (cp_grid, cp_grid.cp_size)):
        for kind in context_parallel.LAYOUTS:
            layout = context_parallel.CPLayout(kind, cp)
            model = context_parallel.apply_context_parallel(small_model(torch.float32), layout, grid.cp_group)
            pos = layout.positions(grid.cp_rank, T)
            out[kind, cp, "bytes"] = saved_bytes(model, x[:, pos], None, pos)
            with batches_posted() as forward_batches, comm.CommMeter(grid.group_names()) as forward:
                loss = model(x[:, pos], labels=y[:, pos], position_ids=pos)
            with batches_posted() as backward_batches, comm.CommMeter(grid.group_names()) as backward:
                loss.backward()
            out[kind, cp, "comm"] = [(dict(m.calls), dict(m.payload)) for m in (forward, backward)]
            out[kind, cp, "batches"] = [forward_batches, backward_batches]
    layout = context_parallel.CPLayout("zigzag", cp_grid.cp_size)        # the all-gather variant, same layout
    model = allgather_kv.apply_allgather_kv(small_model(torch.float32), layout, cp_grid.cp_group)
    pos = layout.positions(cp_grid.cp_rank, T)
    out["allgather", "bytes"] = saved_bytes(model, x[:, pos], None, pos)
    with comm.CommMeter(cp_grid.group_names()) as forward:
        loss = model(x[:, pos], labels=y[:, pos], position_ids=pos)
    with comm.CommMeter(cp_grid.group_names()) as backward:
        loss.backward()
    out["allgather", "comm"] = [(dict(m.calls), dict(m.wire)) for m in (forward, backward)]
    return out


ATTENTIONS = {"ring": context_parallel.RingAttention, "allgather": allgather_kv.AllGatherKVAttention,
              "ulysses": ulysses.UlyssesAttention}


def layer_level(part):
    """One part on every rank: the "sp" model twin, the "ring", "allgather" or "ulysses" attention twins, or
    the CP "models" twins (float64) and then the measurements (float32), which it returns."""
    tp_grid = process_grid.build_process_grid(tp=2)
    cp_grid = process_grid.build_process_grid(cp=2)
    solo_grid = process_grid.build_process_grid(dp=2)         # its cp group is this rank alone
    torch.set_default_dtype(torch.float64)
    try:
        if part == "sp":
            return check_sp(tp_grid)
        if part != "models":
            return check_attention(cp_grid, ATTENTIONS[part])
        check_models(cp_grid)
    finally:
        torch.set_default_dtype(torch.float32)
    return measure(tp_grid, cp_grid, solo_grid)


LAYER_PARTS = ("sp", *ATTENTIONS, "models")


@pytest.fixture(scope="module")
def layer_runs(request):
    """One 2-rank spawn runs the parts in turn; a part that raises is named, the others still run."""
    return run_layouts(layer_level, selected(request, {part: part for part in LAYER_PARTS}), 2, timeout=180)


@pytest.fixture(scope="module")
def measured(layer_runs):
    return layout_results(layer_runs, "models")


@pytest.mark.parametrize("part", LAYER_PARTS)
def test_attention_and_models_match_dense_twins(layer_runs, part):
    assert len(layout_results(layer_runs, part)) == 2   # the twins are asserted on the ranks


def test_sequence_parallel_moves_the_same_bytes_as_tensor_parallel(measured):
    """Per layer and pass: TP 2 all-reduces, SP 2 all-gathers + 2 reduce-scatters of b·s·h elements;
    the ring wire bytes are equal (all-reduce = reduce-scatter + all-gather)."""
    bsh, t = B * T * C * 4, 2
    for result in measured:
        for (tp_calls, tp_payload, tp_wire), (sp_calls, sp_payload, sp_wire) in zip(result["tp", "comm"],
                                                                                    result["sp", "comm"]):
            assert tp_calls == {("all_reduce", "tp"): 2} and tp_payload == {("all_reduce", "tp"): 2 * bsh}
            assert sp_calls == {("all_gather", "tp"): 2, ("reduce_scatter", "tp"): 2}
            assert sp_payload == {("all_gather", "tp"): 2 * bsh, ("reduce_scatter", "tp"): 2 * bsh}
            assert sp_wire == tp_wire == 4 * bsh * (t - 1) // t


def test_sequence_parallel_divides_norm_region_activations_by_tp(measured):
    """The RMSNorms (their input, 1/rms and normalised output) hold T/tp tokens under SP: exactly 1/tp
    of TP's bytes; everything else saved for backward is unchanged, so the whole-model difference is
    exactly (1 − 1/tp) of TP's norm-region bytes (the playbook's 34/t vs 10 + 24/t: the norm part)."""
    for result in measured:
        assert result["tp", "norm_bytes"] == 2 * result["sp", "norm_bytes"] > 0
        assert result["tp", "model_bytes"] - result["sp", "model_bytes"] == result["tp", "norm_bytes"] // 2


def test_context_parallel_divides_activations_and_sends_cp_minus_1_blocks(measured):
    """Every activation is per token except attention's, and ring attention saves only its own
    q/k/v/out/lse: the bytes the decoder saves per rank with cp=2 are exactly half of cp=1's (same
    code, one rank). (The loss would add one float32 scalar, nll_loss's total weight, on every rank.)
    Forward: cp−1 K/V blocks (2·b·(s/cp)·h_kv floats each) per layer; backward: cp−1 K/V + cp dK/dV."""
    block = 2 * B * (T // 2) * 2 * 8 * 4          # (2, B, nkv, T/cp, hd) float32
    for result in measured:
        for kind in context_parallel.LAYOUTS:
            assert result[kind, 1, "bytes"] == 2 * result[kind, 2, "bytes"]
            (fwd_calls, fwd_payload), (bwd_calls, bwd_payload) = result[kind, 2, "comm"]
            assert fwd_calls == {("isend", "cp"): L * 1, ("irecv", "cp"): L * 1}
            assert fwd_payload[("isend", "cp")] == L * 1 * block
            assert bwd_calls == {("isend", "cp"): L * (1 + 2), ("irecv", "cp"): L * (1 + 2)}
            assert bwd_payload[("isend", "cp")] == L * 3 * block
            assert result[kind, 1, "comm"] == [({}, {}), ({}, {})]    # one rank: no ring at all


def test_allgather_kv_trades_memory_for_bytes_against_the_ring(measured):
    """allgather_kv.py's formulas, per layer, one block = 2·b·(s/cp)·h_kv elements: wire (cp−1) blocks forward
    (one all-gather) and (cp−1) backward (one reduce-scatter), against the ring's (cp−1) and (cp−1) + cp;
    K/V saved for backward cp blocks against the ring's 1, so the decoder saves exactly L·(cp−1) blocks
    more (everything else it saves is the ring's: q, out, lse and the per-token layers)."""
    block, cp = 2 * B * (T // 2) * 2 * 8 * 4, 2          # (2, B, nkv, T/cp, hd) float32
    for result in measured:
        (fwd_calls, fwd_wire), (bwd_calls, bwd_wire) = result["allgather", "comm"]
        assert fwd_calls == {("all_gather", "cp"): L} and bwd_calls == {("reduce_scatter", "cp"): L}
        assert fwd_wire == {("all_gather", "cp"): L * (cp - 1) * block}
        assert bwd_wire == {("reduce_scatter", "cp"): L * (cp - 1) * block}
        (_, ring_fwd), (_, ring_bwd) = result["zigzag", cp, "comm"]
        assert ring_fwd[("isend", "cp")] == L * (cp - 1) * block
        assert ring_bwd[("isend", "cp")] == L * (2 * cp - 1) * block     # cp blocks more than all-gather
        assert result["allgather", "bytes"] - result["zigzag", cp, "bytes"] == L * (cp - 1) * block


def test_ring_posts_each_step_send_and_receive_as_one_batch(measured):
    """Every hop of ring attention is one `batch_isend_irecv` of [send to next, receive from previous]
    (with cp = 2 both are the other rank: the case NCCL deadlocks on unbatched). Forward: cp−1 hops per
    layer; backward: cp−1 K/V hops + cp dK/dV hops; no ring at all with cp = 1. Together with the
    meter's counts above (one isend per hop), no send or receive is left outside a batch."""
    for rank, result in enumerate(measured):
        hop = [("isend", 1 - rank), ("irecv", 1 - rank)]
        for kind in context_parallel.LAYOUTS:
            assert result[kind, 2, "batches"] == [[hop] * L * 1, [hop] * L * (1 + 2)]
            assert result[kind, 1, "batches"] == [[], []]


def tile_counts():
    """Query·key scores each rank's ring attention computes, counted at every tile it really runs."""
    grid = process_grid.build_process_grid(cp=4)
    counts, scores = {}, []
    inner = context_parallel.tile_forward

    def counted(q, k, v, causal):
        scores.append(q.shape[2] * k.shape[2])
        return inner(q, k, v, causal)
    context_parallel.tile_forward = counted          # in this spawned rank only
    for kind in context_parallel.LAYOUTS:
        q = torch.randn(1, 2, 32 // 4, 4, dtype=torch.float64)
        for attn in (context_parallel.RingAttention, allgather_kv.AllGatherKVAttention):
            scores.clear()
            out = attn(context_parallel.CPLayout(kind, 4), grid.cp_group)(q, q[:, :1], q[:, :1])
            counts[kind, attn.__name__] = (sum(scores), out)
    return counts


def test_zigzag_gives_every_rank_the_same_tiles():
    """No ranks: the tiles `_tiles` lists for a rank against every source block (cp 4). Zig-zag: each rank
    holds two chunks of 2cp, mirror images (chunk c and 2cp−1−c), so every rank computes 2cp + 1 = 9 tiles;
    contiguous: rank r computes r + 1. Together the ranks hold every chunk once."""
    for kind, expected, chunks in (("zigzag", [9] * 4, 8), ("contiguous", [1, 2, 3, 4], 4)):
        layout = context_parallel.CPLayout(kind, 4)
        held = [c for rank in range(4) for c in layout.chunk_ids(rank)]
        assert sorted(held) == list(range(chunks)) == list(range(layout.num_chunks)), kind
        tiles = [sum(len(context_parallel._tiles(layout, rank, src)) for src in range(4))
                 for rank in range(4)]
        assert tiles == expected, kind
        positions = torch.cat([layout.positions(rank, 32) for rank in range(4)])
        assert sorted(positions.tolist()) == list(range(32)), kind


def test_zigzag_balances_attention_work():
    """Causal attention over 8 chunks of 4 tokens (cp 4): a rank computes the query·key scores of
    every tile on or below the diagonal. Contiguous: rank r has r+1 tiles of 8×8 (unbalanced, 64·(r+1));
    zig-zag: every rank 2cp+1 = 9 tiles of 4×4 (144 each). In total T²/2 below the diagonal plus the
    masked half of the diagonal tiles, T·c/2 for chunks of c tokens: 512 + 128 and 512 + 64. The
    all-gather variant runs the same tiles and gives the ring's output (float64: 1e-12)."""
    results = run_ranks(tile_counts, 4, timeout=120)
    for kind in context_parallel.LAYOUTS:       # all-gather KV: the ring's tiles, the ring's output at cp 4
        for rank in results:
            names = ("RingAttention", "AllGatherKVAttention")
            (ring_scores, ring_out), (gathered_scores, gathered_out) = (rank[kind, name] for name in names)
            assert ring_scores == gathered_scores
            torch.testing.assert_close(gathered_out, ring_out, **EXACT)
    counts = [{kind: rank[kind, "RingAttention"][0] for kind in context_parallel.LAYOUTS} for rank in results]
    assert [c["contiguous"] for c in counts] == [64 * (r + 1) for r in range(4)]
    assert [c["zigzag"] for c in counts] == [16 * 9] * 4
    assert sum(c["contiguous"] for c in counts) == 32 * 32 // 2 + 32 * 8 // 2
    assert sum(c["zigzag"] for c in counts) == 32 * 32 // 2 + 32 * 4 // 2


# ======================================================================================
# Whole runs against 01
# ======================================================================================
SCP = "05_sequence_context_parallel.train"


TWO_RANKS = {"tp2-sp": (SCP, ["--tp", "2", "--sp"]),
             "cp2-contiguous": (SCP, ["--cp", "2", "--cp-layout", "contiguous"]),
             "cp2-zigzag": (SCP, ["--cp", "2", "--cp-layout", "zigzag"]),
             "cp2-ulysses-eager": (SCP, ["--cp", "2", "--cp-attn", "ulysses", "--attn", "eager"]),
             "cp2-allgather-zigzag": (SCP, ["--cp", "2", "--cp-attn", "allgather"])}
FOUR_RANKS = {"cp4-contiguous": (SCP, ["--cp", "4", "--cp-layout", "contiguous"]),
              "cp4-zigzag": (SCP, ["--cp", "4", "--cp-layout", "zigzag"]),
              "tp2sp-cp2-zigzag": (SCP, ["--tp", "2", "--sp", "--cp", "2", "--cp-layout", "zigzag"]),
              "tp2-cp2-contiguous": (SCP, ["--tp", "2", "--cp", "2", "--cp-layout", "contiguous"]),
              "dp2-cp2": (SCP, ["--dp", "2", "--cp", "2", "--mbs", "2"]),
              "tp2-cp2-full-pa": (SCP, ["--tp", "2", "--cp", "2", "--recompute", "full",
                                        "--partition-activations"])}


def _tp(layout):
    _, extra = layout
    return int(extra[extra.index("--tp") + 1]) if "--tp" in extra else 1


@pytest.fixture(scope="module")
def two_ranks(request):
    """One 2-rank spawn runs TWO_RANKS in turn (a spawn costs seconds; a layout that raises on the ranks
    is named, and the next ones still run unless a rank may be blocked in a collective with it)."""
    return run_layouts(train_layout, selected(request, TWO_RANKS), 2)


@process_grid.keep_groups()    # the model's tp and cp groups, for the passes after the run
def four_rank_run(layout):
    """train_layout's numbers; under P_a also the saved-for-backward peaks of one more forward and backward
    of the trained model on this rank's tokens: with P_a's checkpoints, then with 01's plain ones."""
    module, extra = layout
    records, model = import_module(module).main(common.argv(*extra))[:2]
    if "--partition-activations" not in extra:
        return numbers(records, model)
    cp_rank = torch.distributed.get_rank() // 2 % 2             # the grid (dp, pp, cp, tp) = (1, 1, 2, 2)
    pos = context_parallel.CPLayout("zigzag", 2).positions(cp_rank, common.SEQ_LEN)             # (T/cp,)
    ids = torch.randint(0, 320, (4, common.SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    result, peaks = numbers(records, model), []
    for plain in (False, True):
        if plain:                                                 # the same layers, 01's checkpoints
            for layer in model.model.layers:
                layer.forward = recompute.checkpointed(layer.forward.__wrapped__)
        with memory.saved_activation_bytes(exclude=model.parameters()) as saved:
            model(ids[:, :-1][:, pos], labels=ids[:, 1:][:, pos], position_ids=pos).backward()
        peaks.append(saved.peak)
    return result, peaks


@pytest.fixture(scope="module")
def four_ranks(request):
    """One 4-rank spawn for FOUR_RANKS, as two_ranks."""
    return run_layouts(four_rank_run, selected(request, FOUR_RANKS), 4, timeout=300)


@pytest.mark.parametrize("layout_id", TWO_RANKS)
def test_sp_and_cp2_runs_equal_single_device(two_ranks, default_reference, layout_id):
    """tp 2 + sp, cp 2 in both ring layouts, and Ulysses around the layer's own (here eager) core."""
    assert_matches_reference(layout_results(two_ranks, layout_id), default_reference,
                             tp=_tp(TWO_RANKS[layout_id]))


@pytest.mark.parametrize("layout_id", [name for name in FOUR_RANKS if not name.endswith("-pa")])
def test_four_rank_layouts_equal_single_device(four_ranks, default_reference, layout_id):
    """cp 4 both layouts (zig-zag: 8 chunks of 4 tokens), tp 2 + sp × cp 2 zig-zag, tp 2 × cp 2,
    dp 2 × cp 2 (mbs 2 per replica: the same global batch of 4)."""
    assert_matches_reference(layout_results(four_ranks, layout_id), default_reference,
                             tp=_tp(FOUR_RANKS[layout_id]))


def test_partitioned_activations_under_cp_equal_single_device_keeping_1_over_tp(four_ranks,
                                                                                default_reference):
    """04's P_a under tp 2 × cp 2 (--recompute full --partition-activations) == 01, tolerances above. The
    checkpoints are not replicated over cp (each cp rank holds its T/cp tokens), only over tp, so a rank keeps
    L layer inputs of (B, T/cp, C/t) instead of (B, T/cp, C): the measured saved-for-backward peak of one
    forward and backward (the end of the forward) is exactly L·B·(T/cp)·C·4·(1 − 1/t) bytes lower than
    with 01's checkpoints on the same layers (everything else saved is the same)."""
    L, B, T, C, t, cp = 4, 4, common.SEQ_LEN, 32, 2, 2
    runs = layout_results(four_ranks, "tp2-cp2-full-pa")
    assert_matches_reference([run for run, _ in runs], default_reference, tp=t)
    for rank, (_, (partitioned, plain)) in enumerate(runs):
        assert plain - partitioned == L * B * T // cp * C * 4 * (t - 1) // t, f"rank {rank}"


def _check(*flags, world):
    args = cli.parse_args(cp_train.build_parser(), common.argv(*flags))
    os.environ["WORLD_SIZE"] = str(world)
    try:
        cp_train.check_layout(args, cli.model_config(args, 257))       # the byte tokenizer's vocabulary
    finally:
        del os.environ["WORLD_SIZE"]


def test_bad_layouts_fail_before_any_process_group():
    with pytest.raises(ValueError, match=r"seq_len=32 is not divisible by 6 .*cp=3"):
        _check("--cp", "3", world=3)
    with pytest.raises(ValueError, match=r"seq_len=36 is not divisible by 8 \(2·cp chunks .*zigzag"):
        _check("--cp", "4", "--seq-len", "36", world=4)
    with pytest.raises(ValueError, match=r"seq_len=30 is not divisible by 4 \(cp chunks"):
        _check("--cp", "4", "--cp-layout", "contiguous", "--seq-len", "30", world=4)
    with pytest.raises(ValueError, match=r"--sp .* needs --tp 2 or more"):
        _check("--sp", world=1)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the sequence each rank holds \(6 tokens"):
        _check("--sp", "--tp", "4", "--num-kv-heads", "4", "--cp", "2", "--cp-layout", "contiguous",
               "--seq-len", "12", world=8)
    with pytest.raises(ValueError, match=r"does not equal the world size 2"):
        _check("--tp", "2", "--cp", "2", world=2)
    with pytest.raises(ValueError, match=r"ulysses .* cp=2 does not divide the 1 key/value heads"):
        _check("--tp", "2", "--cp", "2", "--cp-attn", "ulysses", world=4)
    with pytest.raises(ValueError, match=r"--cp-attn ring .* --attn triton would be ignored"):
        _check("--cp", "2", "--attn", "triton", world=2)
    with pytest.raises(ValueError, match=r"--partition-activations with --sp: .* drop --partition-activ"):
        _check("--tp", "2", "--sp", "--recompute", "full", "--partition-activations", world=2)
