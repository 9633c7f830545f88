"""04_tensor_parallel: every parallel layer against its dense twin, and whole runs against 01.

Layer level (2 gloo ranks): the region functions, ColumnParallelLinear, RowParallelLinear, the
vocab-parallel embedding and loss, attention split by heads (GQA), the MLP, a whole decoder layer:
forward outputs and every gradient (input and weight shards) against the dense layer with the same
weights. float64 there, so only summation order differs: 1e-12 is far below any wrong slice.
Whole runs (float32, 3 AdamW steps): losses, gradient norms and final parameter shards equal
01_single_gpu's for the same global batch. rtol 1e-5 on losses/norms: the all-reduced partial sums
round differently from one matmul (float32 ε ≈ 1.2e-7, a few hundred terms). atol 1e-4 on
parameters: AdamW's m/(√v + 1e-8) turns gradient rounding on a near-zero entry into an update
difference of up to ~lr (3e-3) a step (3.8e-5 seen on one entry of 512); a wrong shard or a missed
reduction moves whole tensors by ~lr.
The measured communication is checked against the formula in tensor_parallel.py's docstring.
"""
import copy
import shutil
from importlib import import_module
from pathlib import Path

import pytest
import torch
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import common
from harness import layout_results, run_layouts, run_ranks, selected

import cli
import data
import model as modeling
import hf_io
import process_grid
import comm
import memory
import mappings
import tensor_parallel
tp_train = import_module("04_tensor_parallel.train")

ROOT = Path(__file__).resolve().parents[1]
EXACT = dict(rtol=1e-12, atol=1e-12)      # float64 layer twins
LOSS = dict(rtol=1e-5, atol=0)
PARAMS = dict(rtol=0, atol=1e-4)          # fp32 whole runs: the module docstring says why


# ======================================================================================
# Helpers shared with test_context_parallel.py
# ======================================================================================
def shard_like(full, local, rank, size):
    """The slice of a dense tensor that a rank's (possibly sharded) tensor should equal."""
    for dim, (n, m) in enumerate(zip(full.shape, local.shape)):
        if n != m:
            return full.chunk(size, dim=dim)[rank]
    return full


def reference(*extra, **kw):
    """01_single_gpu on the same flags: (losses, grad norms, final state dict)."""
    records, model = import_module("01_single_gpu.train").main(common.argv(*extra, **kw))
    return ([r["loss"] for r in records], [r["grad_norm"] for r in records],
            {k: v.detach().clone() for k, v in model.state_dict().items()})


def train_layout(layout, steps=3):
    """On every rank: run NN/train.py's main() for one (module, flags); losses, norms, state dict."""
    module, extra = layout
    return numbers(*import_module(module).main(common.argv(*extra, steps=steps))[:2])


def numbers(records, model):
    return ([r["loss"] for r in records], [r["grad_norm"] for r in records],                 # numpy: pickled
            {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()})  # by value


def assert_matches_reference(per_rank, ref, tp):
    """Every rank's losses and norms equal 01's; its parameters equal its tp shard of 01's."""
    ref_losses, ref_norms, ref_state = ref
    for rank, (losses, norms, state) in enumerate(per_rank):
        torch.testing.assert_close(losses, ref_losses, **LOSS)
        torch.testing.assert_close(norms, ref_norms, **LOSS)
        assert state.keys() == ref_state.keys()
        for name, local in state.items():
            local = torch.from_numpy(local)
            torch.testing.assert_close(local, shard_like(ref_state[name], local, rank % tp, tp), **PARAMS,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


# ======================================================================================
# Layer level
# ======================================================================================
def _twin_grads(out, dense_out, inputs, params, dense_params, rank, size):
    """Backward the same upstream gradient through both; compare outputs and all gradients."""
    torch.testing.assert_close(out, dense_out, **EXACT)
    upstream = torch.randn_like(dense_out)
    out.backward(upstream)
    dense_out.backward(upstream)
    for x, dense_x in inputs:
        torch.testing.assert_close(x.grad, dense_x.grad, **EXACT)
    for p, dense_p in zip(params, dense_params, strict=True):
        torch.testing.assert_close(p.grad, shard_like(dense_p.grad, p.grad, rank, size), **EXACT)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


B, T, C, V = 2, 8, 32, 64


def check_layers(part):
    """One part of the twins on every rank, in float64: "f-and-f-bar" (the parallel linears through
    Megatron's regions), "embedding" (the vocab-parallel embedding), "model" (attention, MLP, a layer, the
    vocab-parallel loss) or "clip" (the gradient norm over the shards)."""
    grid = process_grid.build_process_grid(tp=2)
    torch.manual_seed(0)   # the same dense twins and inputs on every rank
    torch.set_default_dtype(torch.float64)
    try:
        {"f-and-f-bar": check_parallel_linears, "embedding": check_embedding, "model": check_model_pieces,
         "clip": check_clip}[part](grid)
    finally:
        torch.set_default_dtype(torch.float32)
    return True


def check_parallel_linears(grid):
    """Column-parallel (entered with f, gathered at the end) and row-parallel (scattered input)."""
    group, rank, size = grid.tp_group, grid.tp_rank, grid.tp_size
    dense = nn.Linear(C, 48, bias=False)
    x = _leaf(torch.randn(B, T, C))
    dense_x = _leaf(x)
    column = tensor_parallel.ColumnParallelLinear(dense.weight, rank, size, group, gather_output=True)
    _twin_grads(column(mappings.copy_to_tp_region(x, group)), dense(dense_x), [(x, dense_x)],
                [column.weight], [dense.weight], rank, size)
    dense = nn.Linear(48, C, bias=False)
    x = _leaf(torch.randn(B, T, 48))
    dense_x = _leaf(x)
    row = tensor_parallel.RowParallelLinear(dense.weight, rank, size, group)
    _twin_grads(row(mappings.scatter_to_tp_region(x, group)), dense(dense_x), [(x, dense_x)],
                [row.weight], [dense.weight], rank, size)


def twin_models(grid):
    """A dense one-layer model (GQA: 4 heads, 2 kv heads) and its TP twin."""
    config = modeling.LlamaConfig(vocab_size=V, hidden_size=C, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2)
    dense_model = modeling.LlamaForCausalLM(config)
    return tensor_parallel.apply_tensor_parallel(copy.deepcopy(dense_model), grid), dense_model


def check_embedding(grid):
    """The vocab-parallel embedding: each rank's ids, looked up where owned, summed over tp."""
    model, dense_model = twin_models(grid)
    ids = torch.randint(0, V, (B, T))
    emb, dense_emb = model.model.embed_tokens, dense_model.model.embed_tokens
    _twin_grads(emb(ids), dense_emb(ids), [], [emb.weight], [dense_emb.weight], grid.tp_rank, grid.tp_size)


def check_model_pieces(grid):
    """The whole model's pieces: attention (GQA: 4 heads, 2 kv heads), MLP, layer, loss."""
    rank, size = grid.tp_rank, grid.tp_size
    model, dense_model = twin_models(grid)
    # f is where a reader looks: a named child that print(model) lists, run by a pre-hook; forward is 01's
    attn = model.model.layers[0].self_attn
    assert "forward" not in vars(attn) and "forward" not in vars(model.lm_head)
    f_line = "(enter_tp_region): EnterRegion(copy_to_tp_region (f: identity forward, all-reduce backward))"
    assert f_line in repr(attn)
    assert "exit reduce_from_tp_region (f̄: all-reduce forward, identity backward)" in repr(attn.o_proj)
    cos, sin = dense_model.model.rotary(torch.arange(T), torch.float64)
    layer, dense_layer = model.model.layers[0], dense_model.model.layers[0]
    for part, args in (("self_attn", (cos, sin)), ("mlp", ()), (None, (cos, sin))):
        mod, dense_mod = (getattr(layer, part), getattr(dense_layer, part)) if part else (layer, dense_layer)
        x = _leaf(torch.randn(B, T, C))
        dense_x = _leaf(x)
        params = [p for _, p in sorted(mod.named_parameters())]
        dense_params = [p for _, p in sorted(dense_mod.named_parameters())]
        first = lambda out: out[0] if isinstance(out, tuple) else out   # noqa: E731  (a layer: (x, aux 0.0))
        _twin_grads(first(mod(x, *args)), first(dense_mod(dense_x, *args)), [(x, dense_x)],
                    params, dense_params, rank, size)
    labels = torch.randint(0, V, (B, T))
    labels[0, :3] = -100                                  # ignored positions are skipped by both
    hidden = _leaf(torch.randn(B, T, C))
    dense_hidden = _leaf(hidden)
    _twin_grads(model.loss_fn(hidden, model.lm_head, labels),
                dense_model.loss_fn(dense_hidden, dense_model.lm_head, labels),
                [(hidden, dense_hidden)], [model.lm_head.weight], [dense_model.lm_head.weight], rank, size)


def check_clip(grid):
    """Gradient clipping counts each shard once and each replicated norm weight once."""
    group, rank, size = grid.tp_group, grid.tp_rank, grid.tp_size
    model, dense_model = twin_models(grid)
    ids, labels = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    labels[0, :3] = -100
    model(ids, labels=labels).backward()
    dense_model(ids, labels=labels).backward()
    norm = tensor_parallel.clip_grad_norm_tp(list(model.parameters()), 0.5, group)
    dense_norm = torch.nn.utils.clip_grad_norm_(dense_model.parameters(), 0.5)
    torch.testing.assert_close(norm, dense_norm, **EXACT)
    for (name, p), dense_p in zip(model.named_parameters(), dense_model.parameters()):
        torch.testing.assert_close(p.grad, shard_like(dense_p.grad, p.grad, rank, size), **EXACT, msg=name)


def measure_communication():
    """All-reduces in the tp group for one decoder layer and for a whole model (float32)."""
    grid = process_grid.build_process_grid(tp=2)
    torch.manual_seed(0)
    B, T, C, L = 2, 8, 32, 3
    config = modeling.LlamaConfig(vocab_size=64, hidden_size=C, intermediate_size=48, num_hidden_layers=L,
                                  num_attention_heads=4, num_key_value_heads=2)
    model = tensor_parallel.apply_tensor_parallel(modeling.LlamaForCausalLM(config), grid)
    x = torch.randn(B, T, C, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(T), torch.float32)
    meters = {}
    with comm.CommMeter(grid.group_names()) as meters["layer_forward"]:
        y, _ = model.model.layers[0](x, cos, sin)
    with comm.CommMeter(grid.group_names()) as meters["layer_backward"]:
        y.sum().backward()
    ids = torch.randint(0, 64, (B, T + 1))
    with comm.CommMeter(grid.group_names()) as meters["model"]:
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
    return {k: (dict(m.calls), dict(m.payload), dict(m.wire)) for k, m in meters.items()}


LAYER_PARTS = ("f-and-f-bar", "embedding", "model", "clip")


@pytest.fixture(scope="module")
def layer_twins(request):
    """One 2-rank spawn runs the parts in turn; a part that raises is named, the others still run."""
    return run_layouts(check_layers, selected(request, {part: part for part in LAYER_PARTS}), 2, timeout=120)


@pytest.mark.parametrize("part", LAYER_PARTS)
def test_parallel_layers_match_dense_twins(layer_twins, part):
    assert layout_results(layer_twins, part) == [True, True]   # the twins are asserted on the ranks


def test_communication_matches_megatron_formula():
    """Per layer: 2 all-reduces forward and 2 backward of b·s·h elements; ring wire per rank
    4·b·s·h·(t−1)/t per pass, 8·b·s·h·(t−1)/t per layer and micro-batch ([MEG] §4.2.2). The whole
    model adds the embedding's f̄ and the head's f (b·s·h each) and the vocab-parallel loss's three
    all-reduces of b·s elements (max, Σexp, target logit) — never the b·s·V logits."""
    B, T, C, L, t, f32 = 2, 8, 32, 3, 2, 4
    bsh, key = B * T * C * f32, ("all_reduce", "tp")
    for result in run_ranks(measure_communication, 2, timeout=120):
        for phase in ("layer_forward", "layer_backward"):
            calls, payload, wire = result[phase]
            assert calls == {key: 2} and payload == {key: 2 * bsh}
            assert wire == {key: 4 * bsh * (t - 1) // t}
        calls, payload, _ = result["model"]
        assert calls == {key: 4 * L + 2 + 3}
        assert payload == {key: (4 * L + 2) * bsh + 3 * B * T * f32}


# ======================================================================================
# Whole runs against 01
# ======================================================================================
TP = "04_tensor_parallel.train"


def tp2_run(layout):
    """One layout; a resume first removes the step-3 checkpoint the layout before it wrote (rank 0)."""
    _, extra = layout
    if "--resume" in extra:
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(Path(extra[extra.index("--checkpoint-dir") + 1]) / "step_000003")
        torch.distributed.barrier()
    if "--recompute" in extra:
        return recompute_run(layout)
    if "--compile" in extra:
        return compiled_run(layout)
    return train_layout(layout)


def compiled_run(layout):
    """train_layout's numbers under --compile, each layer compiled by AOT autograd as inductor gets it but
    run as traced (aot_eager's compilers, which also list the graphs' collectives); then dynamo's counts
    of graphs and breaks and, per forward or backward graph made, its c10d calls."""
    collectives = {"forward": [], "backward": []}

    def listing(kind):
        def compiler(graph, example_inputs):
            collectives[kind].append([str(node.target) for node in graph.graph.nodes
                                      if node.op == "call_function" and "c10d" in str(node.target)])
            return make_boxed_func(graph.forward)
        return compiler
    backend = aot_autograd(fw_compiler=listing("forward"), bw_compiler=listing("backward"))
    compile_layer = torch.nn.Module.compile
    torch.nn.Module.compile = lambda layer: compile_layer(layer, backend=backend)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        result = train_layout(layout)
    finally:
        torch.nn.Module.compile = compile_layer
    counters = torch._dynamo.utils.counters
    return result, counters["stats"]["unique_graphs"], dict(counters["graph_break"]), collectives


@process_grid.keep_groups()    # the model's tp group, for the forward and backward after the run
def recompute_run(layout):
    """train_layout's numbers, with the all-gather wire bytes of the run, and what autograd keeps for
    backward over one more forward and backward of the trained model: the peak (when the forward ends:
    the layers' checkpoints, the head's and the loss's tensors) and what is left after the backward."""
    module, extra = layout
    with comm.CommMeter() as meter:
        records, model = import_module(module).main(common.argv(*extra))[:2]
    ids = torch.randint(0, 320, (4, common.SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    with memory.saved_activation_bytes(exclude=model.parameters()) as saved:
        model(ids[:, :-1], labels=ids[:, 1:]).backward()                # (mbs 4, T): the runs' micro-batch
    return numbers(records, model), dict(peak=saved.peak, left=saved.live, calls=dict(meter.calls),
                                         wire=dict(meter.wire))


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory):
    """One 2-rank spawn for the layouts of the test below, in turn: tp2-resumed resumes from the checkpoints
    tp2-checkpoints wrote (if that one failed, this one fails too). A layout that raises on the ranks is
    named, and the next ones still run unless a rank may be blocked in a collective with the failed one."""
    tmp_path = tmp_path_factory.mktemp("tp2")
    config = cli.model_config(cli.parse_args(cli.core_parser("t"), common.argv("--tie-embeddings")),
                              data.ByteTokenizer().vocab_size)
    torch.manual_seed(7)
    hf_io.save_hf(modeling.LlamaForCausalLM(config), tmp_path / "hf")
    init, ckpt = ("--init-from", str(tmp_path / "hf")), str(tmp_path / "ckpt")
    layouts = {"tp2-checkpoints": (TP, ["--tp", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "2"]),
               "tp2-hf-init": (TP, ["--tp", "2", *init]),
               "tp2-resumed": (TP, ["--tp", "2", "--checkpoint-dir", ckpt, "--resume"]),
               "tp2-full": (TP, ["--tp", "2", "--recompute", "full"]),
               "tp2-full-pa": (TP, ["--tp", "2", "--recompute", "full", "--partition-activations"]),
               "tp2-compile": (TP, ["--tp", "2", "--compile"])}          # last: dynamo's state stays
    return run_layouts(tp2_run, layouts, 2, timeout=180), init


@pytest.mark.parametrize("layout_id", ["tp2-checkpoints", "tp2-hf-init", "tp2-resumed"])
def test_tp2_equals_single_device_with_checkpoints_and_hf_weights(tp2_runs, default_reference, layout_id):
    """tp 2 on the default tiny model, saving per-rank shards at step 2; resumed from them, step 3
    is the same again. Then tp 2 started from an HF-format directory (--init-from) with tied
    embeddings: the full checkpoint is loaded on every rank and sliced, and the tied vocab-parallel
    embedding and head share one (V/t, C) shard."""
    outcomes, init = tp2_runs
    ref = default_reference
    if layout_id == "tp2-resumed":                        # one step: 01's third
        losses, norms, state = default_reference
        ref = (losses[2:], norms[2:], state)
    elif layout_id == "tp2-hf-init":
        ref = reference(*init)
    assert_matches_reference(layout_results(outcomes, layout_id), ref, tp=2)


def _partitioned_checkpoint_rank():
    """On 2 ranks, one layer function (tanh(linear(x))·cos + sin, float64, the same weights and x on both tp
    ranks) under torch's checkpoint and under P_a: its output, its gradients, the tensors handed to torch's
    checkpoint (what it keeps for backward), and the collectives of forward and of backward."""
    import functools
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint
    import partition_activations
    torch.manual_seed(0)
    B, T, C = 2, 8, 16
    linear = nn.Linear(C, C).double()
    x0, cos, sin = torch.randn(B, T, C).double(), torch.rand(T, C).double(), torch.rand(T, C).double()
    handed = []

    def recorded(function, *args, **kwargs):                         # torch's checkpoint, its tensors noted
        handed.extend(a.detach().clone() for a in args if isinstance(a, torch.Tensor) and a.dim() == 3)
        return checkpoint(function, *args, **kwargs)
    partition_activations.checkpoint = recorded

    def layer_forward(x, cos, sin):
        return torch.tanh(linear(x)) * cos + sin
    runs = {}
    partitioned = partition_activations.partitioned_checkpoint(layer_forward, dist.group.WORLD)
    try:
        for name, forward in (("plain", functools.partial(recorded, layer_forward, use_reentrant=False)),
                              ("pa", partitioned)):
            x = x0.clone().requires_grad_()
            linear.zero_grad()
            handed.clear()
            with comm.CommMeter() as forward_calls:
                y = forward(x, cos, sin)
            with comm.CommMeter() as backward_calls:
                y.square().sum().backward()
            runs[name] = dict(y=y.detach(), dx=x.grad, dw=linear.weight.grad.clone(), kept=list(handed),
                              forward=dict(forward_calls.calls), backward=dict(backward_calls.calls))
    finally:
        partition_activations.checkpoint = checkpoint
    return runs, x0.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()]


def test_partitioned_checkpoint_keeps_a_slice_and_gathers_it_in_backward():
    """ZeRO-R's P_a on one layer function, 2 ranks (exercise 04.5): the output and the gradients of x and the
    weight equal torch's plain checkpoint exactly (the same forward reruns on the same, re-gathered input);
    what torch's checkpoint is handed to keep is this rank's (B, T, C/t) slice of x, not x (ZeRO §6.1: the
    checkpoint bytes divided by t); the forward communicates nothing and the backward all-gathers once (ZeRO
    §8: one all-gather per layer and micro-batch)."""
    for rank, (runs, my_slice) in enumerate(run_ranks(_partitioned_checkpoint_rank, 2)):
        plain, pa = runs["plain"], runs["pa"]
        for key in ("y", "dx", "dw"):
            assert torch.equal(pa[key], plain[key]), f"rank {rank}: {key}"
        assert [k.shape for k in plain["kept"]] == [(2, 8, 16)]
        assert len(pa["kept"]) == 1 and torch.equal(pa["kept"][0], my_slice), f"rank {rank}: {pa['kept']}"
        assert pa["forward"] == {} and pa["backward"] == {("all_gather", "world"): 1}, f"rank {rank}: {pa}"


def test_partitioned_activation_checkpoints_equal_single_device_and_keep_1_over_tp(tp2_runs,
                                                                                  default_reference):
    """ZeRO-R's P_a at tp 2 (--recompute full --partition-activations) == 01 (tolerances above), and equal
    to tp 2's plain full recompute exactly: the same forward is rerun on the same, re-gathered input.

    Bytes, exact, per rank, L = 4 layers of input (B, T, C) = (4, 32, 32) fp32, t = 2: at the saved-tensor
    peak of a forward and backward (the end of the forward) the layer checkpoints hold L·B·T·C·4 bytes
    without P_a and 1/t of that with it (ZeRO §6.1), everything else (the head's and the loss's tensors,
    RoPE's cos/sin) being the same, and the backward releases all of it. Communication: P_a adds one
    all-gather of (t−1)/t·B·T·C·4 wire bytes per layer, micro-batch and step (3 steps × 1 micro-batch),
    in backward, and no other call (torch's checkpoint reruns the same part of each layer either way)."""
    outcomes, _ = tp2_runs
    L, B, T, C, t, steps = 4, 4, common.SEQ_LEN, 32, 2, 3
    plain, partitioned = layout_results(outcomes, "tp2-full"), layout_results(outcomes, "tp2-full-pa")
    assert_matches_reference([run for run, _ in partitioned], default_reference, tp=t)
    for rank, ((full_numbers, full), (pa_numbers, pa)) in enumerate(zip(plain, partitioned)):
        assert pa_numbers[:2] == full_numbers[:2], f"rank {rank}: losses and norms"
        for name, value in full_numbers[2].items():
            assert (pa_numbers[2][name] == value).all(), f"rank {rank} {name}"
        checkpoints = L * B * T * C * 4
        assert full["peak"] - pa["peak"] == checkpoints - checkpoints // t, f"rank {rank}"
        assert full["left"] == pa["left"] == 0, f"rank {rank}"
        gathers = [key for key in pa["wire"] if key[0] == "all_gather"]   # the group is named by its ranks
        assert [key for key in full["wire"] if key[0] == "all_gather"] == [] and len(gathers) == 1
        assert pa["wire"][gathers[0]] == steps * L * (t - 1) * B * T * C * 4 // t, f"rank {rank}"
        assert pa["calls"][gathers[0]] == steps * L, f"rank {rank}"
        others = {key: n for key, n in pa["calls"].items() if key[0] != "all_gather"}
        assert others == full["calls"], f"rank {rank}: P_a adds the all-gathers, nothing else"


FOUR_RANKS = {"tp4": (TP, ["--tp", "4", "--num-kv-heads", "4"]),
              "dp2-tp2": (TP, ["--tp", "2", "--dp", "2", "--mbs", "2"])}


@pytest.fixture(scope="module")
def four_ranks():
    """One 4-rank spawn for FOUR_RANKS, in turn (as tp2_runs)."""
    return run_layouts(train_layout, FOUR_RANKS, 4)


@pytest.mark.parametrize("layout_id", FOUR_RANKS)
def test_tp4_and_dp2_tp2_equal_single_device(four_ranks, default_reference, layout_id):
    """tp 4 needs 4 kv heads (the tiny preset has 2: --num-kv-heads 4 on both sides); dp 2 × tp 2
    with mbs 2 per replica is the global batch of 4 that 01 takes in one micro-batch."""
    ref, tp = (reference("--num-kv-heads", "4"), 4) if layout_id == "tp4" else (default_reference, 2)
    assert_matches_reference(layout_results(four_ranks, layout_id), ref, tp=tp)


def _check(*flags, world=None):
    args = cli.parse_args(tp_train.build_parser(), common.argv(*flags))
    import os
    os.environ["WORLD_SIZE"] = str(world or args.tp * args.dp)
    try:
        tp_train.check_layout(args, cli.model_config(args, data.ByteTokenizer().vocab_size))
    finally:
        del os.environ["WORLD_SIZE"]


def test_bad_layouts_fail_before_any_process_group():
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4"):
        _check("--tp", "3")
    with pytest.raises(ValueError, match=r"tp=2 and num_key_value_heads=3: .*one must divide the other"):
        _check("--tp", "2", "--hidden-size", "48", "--num-heads", "6", "--num-kv-heads", "3")
    with pytest.raises(ValueError, match=r"tp=2 does not divide vocab_size=321"):
        _check("--tp", "2", "--vocab-size", "321", "--num-kv-heads", "4")
    with pytest.raises(ValueError, match=r"does not equal the world size 2"):
        _check("--tp", "2", "--dp", "2", world=2)
    # As a user meets it (`python 04_tensor_parallel/train.py --tp 3`: exit 2, one line): test_bad_inputs


def test_compile_gives_one_graph_per_layer_and_says_what_the_meter_missed(monkeypatch, capsys):
    """--compile under tensor parallelism: each decoder layer is one graph with no break (the layers share
    it), though the meter wraps every collective. The meter's counting is Python that a compiled graph
    does not run, so it stays out of the trace and the table says the compiled layers' collectives are
    not in it. A world of one (tp 1 calls the same collectives) and dynamo's eager backend: the graph
    breaks are dynamo's, whatever compiles the graph after it."""
    compile_layer = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda layer: compile_layer(layer, backend="eager"))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tp_train.main(common.argv("--compile", "--tp", "1", "--dataset", "synthetic", steps=2))
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert "collectives inside torch.compile'd code are not counted" in capsys.readouterr().out


def test_compile_at_tp2_gives_one_graph_per_layer_whose_collectives_move_the_data(tp2_runs,
                                                                                    default_reference):
    """The test above where the collectives move data: --compile --tp 2 on two gloo ranks. On each rank the
    four layers share one graph with no break (the meter stepped aside: with its counting traced, 20 graphs
    and 6 breaks); AOT autograd's forward graph holds the layer's 2 all-reduces (f̄ after attention and MLP)
    and its backward graph the 2 of f ([MEG] §4.2.2), each with its wait; and the run equals 01 with the
    tolerances above, so the collectives traced into the graphs summed the right shards. AOT autograd is
    the path inductor takes; its graphs are run as traced (aot_eager) since inductor's C++ build costs
    ~40 s on 2 cores and would change no graph or break."""
    outcomes, _ = tp2_runs
    pair = ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"] * 2
    per_rank = layout_results(outcomes, "tp2-compile")
    for rank, (_, graphs, breaks, collectives) in enumerate(per_rank):
        assert graphs == 1 and not breaks, f"rank {rank}: {graphs} graphs, breaks {breaks}"
        assert collectives == {"forward": [pair], "backward": [pair]}, f"rank {rank}"
    assert_matches_reference([run for run, *_ in per_rank], default_reference, tp=2)
