"""The 5D layout: 08's flags, every folder's rules composed, and the order in which 08 applies them.

Playbook §2.8 and chapter 3. Shared by 08's train.py and planner.py, so the planner refuses exactly the
layouts the trainer refuses. `parallelize` applies the earlier folders' transforms to the seeded full 01
model, in this order (each needs the previous one's result):

    2. TP (+ SP)    --tp/--sp (04, 05): slices every matrix; SP shards the norm regions along T
    3. CP           --cp/--cp-layout/--cp-attn (05): the ring (all-gather K/V, Ulysses) replaces the core
       MoE, EP      --num-experts/--ep (07, via experts.py): MoE blocks replace the MLPs, 1/ep of the experts
    4. PP           --pp/--pp-schedule/--pp-chunks (06): keeps this rank's layers as stage chunks
    5. recompute    --recompute (01): wraps the layers / the (ring) attention core the stages hold;
                    --partition-activations (04's P_a): full recompute's checkpoints in 1/tp slices
(1, the kernels, happen in 01's build_model; 6, DP or ZeRO, in the schedule's passes and the step.)

    torchrun --nproc_per_node 8 08_5d_combined/train.py --dp 2 --tp 2 --pp 2 --grad-acc 4 --mbs 4
New compared with 05's sequence_context_layout.py: every folder's rules and transforms, in one order.
"""
import contextlib
import os

import cli
import mixed_precision
import process_grid
import tensor_parallel
import partition_activations
import sequence_context_layout as sequence_layout
import context_parallel
import pipeline
import moe
import experts
import gradient_sync


def build_parser(description):
    parser = cli.core_parser(description)
    process_grid.add_degree_arguments(parser, "dp", "pp", "cp", "tp", "ep")
    sequence_layout.add_arguments(parser)                 # --sp --cp-layout --cp-attn
    pipeline.add_arguments(parser)                        # --pp-schedule --pp-chunks --timeline
    moe.add_arguments(parser, num_experts=0)              # --num-experts --top-k --aux-loss-coef …
    gradient_sync.add_arguments(parser)                   # --dp-mode --bucket-mb --zero-stage
    partition_activations.add_arguments(parser)           # --partition-activations (04's ZeRO-R P_a)
    mixed_precision.add_arguments(parser)                 # --precision-layout --loss-scale-init …
    return parser


def check_layout(args, config):
    """Every rule of every folder, and the world size dp·pp·cp·tp, before any process group exists."""
    gradient_sync.check_gradient_sync(args)
    check_degrees(args, config)


def check_degrees(args, config):
    """The rules of 02-07 (the planner checks these too)."""
    experts.check_experts(args)
    pipeline.check_pipeline(config.num_hidden_layers, args.pp, args.pp_chunks, args.pp_schedule,
                            args.grad_acc, config.tie_word_embeddings)
    sequence_layout.check_sequence_layout(args, config)
    partition_activations.check_partition_activations(args, sp=args.sp)
    tensor_parallel.check_tensor_parallel(config, args.tp)
    process_grid.grid_layout(int(os.environ.get("WORLD_SIZE", 1)), args.dp, args.pp, args.cp, args.tp,
                             args.ep)


def parallelize(full, args, grid, device):
    """Steps 2-5 on the full (meta) model's shapes; returns this rank's stage chunks."""
    # exercise 08.4: the 5D composition
    # hint: [PB] §2.8 (08's README, "What this step adds: the composition"; the order in this module's
    #   docstring): each earlier folder's transform is one call of its module (05's sequence_context_layout,
    #   08's experts, 06's pipeline, 04's partition_activations), applied from outside to the full model;
    #   a stage cut by PP needs the RoPE positions of this rank's tokens (05's CPLayout), and each transform
    #   must find in place what the one before it made (a recomputed attention core must be the ring's).
    # test: tests/test_5d_combined.py::test_parallelize_composes_every_folders_transform_on_shapes
    sequence_layout.parallelize(full, args, grid)                          # 2. TP (+ SP), 3. CP (05)
    if args.num_experts:                                                   # 3b. MoE, EP (07)
        experts.apply_experts(full, args, grid)
    positions = context_parallel.CPLayout(args.cp_layout, grid.cp_size).positions(
        grid.cp_rank, args.seq_len, device)                                  # (T/cp,) this rank's tokens
    stages = pipeline.build_stages(full, grid.pp_rank, grid.pp_size, args.pp_chunks, positions,   # 4. PP
                                   v_shape=args.pp_schedule in pipeline.V_SHAPED)
    partition_activations.apply_recompute(full, args.recompute, args.partition_activations,   # 5. the stages
                                          grid.tp_group)                                  # hold these layers
    return stages
    # end exercise


@contextlib.contextmanager
def world_size(n: int):
    """check_degrees reads the world from WORLD_SIZE (torchrun's); the planner checks a layout in a world
    of its degrees' product."""
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(n)
    try:
        yield
    finally:
        os.environ.pop("WORLD_SIZE") if saved is None else os.environ.update(WORLD_SIZE=saved)
