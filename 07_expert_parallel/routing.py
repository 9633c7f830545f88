"""What the router adds to its top-k: a capacity per sequence (token dropping) and its side losses.

Playbook §2.7; Switch Transformer (Fedus et al. 2021 §2.2), GShard (Lepikhin et al. 2020 §2.2), ST-MoE
(Zoph et al. 2022 §3.1). Per sequence of T tokens, each sending k rows to E experts, router probabilities p:

    capacity = ⌈F·T·k/E⌉ rows per expert; over it, a row is dropped (first choices before second ones)
    aux = E · Σ_i f_i · P_i,  f_i = #{choices to i}/(T·k),  P_i = Σ_t p_i(t)/T     (Switch, weight α)
    z   = mean_t logsumexp(x_t · Wgᵀ)²                                             (ST-MoE, weight β)

Every quantity is per sequence, so no split of the batch over ranks or micro-batches changes it. Under
08's context parallelism a rank holds T/cp tokens of each sequence: aux's statistics are summed over the
cp ranks first (`SumOverRanks`, whose backward is an all-reduce too). moe.py's block calls these.
"""
import torch
import torch.distributed as dist


class SumOverRanks(torch.autograd.Function):
    """Forward: x summed over `group`; backward: the gradient summed over `group` too.

    Why the backward sums (08: every rank of a cp group holds T/cp tokens of the same sequences): the
    summed S = Σ_c s_c feeds an identical aux on each of the cp ranks, and 08 averages gradients over the
    cp·dp replicas, i.e. differentiates L = (1/(cp·dp))·Σ_{c,d} L_{c,d}. Rank c's own s_c reaches every
    copy, so ∂L/∂s_c = (1/(cp·dp))·Σ_{c'} ∂L_{c'}/∂S: the sum over the group of the gradients arriving
    at S (the 1/(cp·dp) is 08's averaging). An identity backward (04's reduce region) would give the
    router 1/cp of its aux gradient; the test against one device tells the two apart.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def router_z_loss(logits):
    """ST-MoE's z-loss (Zoph et al. 2022 §3.1), the module docstring's z: (B, T, E) -> (). It keeps the
    router's logits small, where float32/bf16 softmax rounds least; ∂/∂logits = 2·lse·p/N."""
    # exercise 07.5: the router's z-loss
    # hint: ST-MoE §3.1 (07's README, "MoE as used today"; z in the module docstring): per token, the log of
    #   the sum of the exponentials of its router logits (computed stably, as a softmax is), squared; then
    #   the mean over every token of the batch.
    # test: tests/test_expert_parallel.py::test_router_z_loss_and_its_gradient_equal_the_hand_written_ones
    return logits.logsumexp(dim=-1).pow(2).mean()                           # () over B·T tokens
    # end exercise


def within_capacity(chosen, capacity: int, num_experts: int):
    """chosen (B, T, k) -> kept (B, T, k) bool: each sequence sends at most `capacity` rows to an expert.

    GShard's groups (§2.2; Lepikhin et al. 2020), one group per sequence, so the rows a layout drops
    never depend on which sequences share a rank or a micro-batch. Priority: every token's first choice
    before any second choice (GShard's top-2 order), then position in the sequence.
    """
    B, T, k = chosen.shape
    # exercise 07.3: the capacity factor
    # hint: Switch §2.2, GShard §2.2 (07's README, Reference, "MoE as used today"): line up each sequence's
    #   rows in priority order; a row is kept when fewer than `capacity` rows before it chose the same
    #   expert (a running count per expert: a cumulative sum of one-hot rows).
    # test: tests/test_expert_parallel.py::
    #   test_capacity_drops_per_sequence_first_choices_first_and_shared_experts_add
    queue = chosen.transpose(1, 2).reshape(B, k * T)                         # (B, k·T): choice-major
    onehot = torch.nn.functional.one_hot(queue, num_experts)                 # (B, k·T, E)
    place = (onehot.cumsum(dim=1) - 1).gather(2, queue.unsqueeze(-1)).squeeze(-1)   # (B, k·T): 0, 1, …
    return (place < capacity).view(B, k, T).transpose(1, 2)                  # (B, T, k)
    # end exercise


def load_balancing_loss(probs, chosen, stats_group=None):
    """Per-sequence E·Σ_i f_i·P_i, averaged over sequences. probs (B, T, E), chosen (B, T, k) -> ().

    With a `stats_group` each rank holds T/cp tokens of every sequence (probs (B, T/cp, E)): the
    statistics are summed over the group first, so every rank gets the whole sequences' aux.
    """
    B, T, E = probs.shape
    k = chosen.shape[-1]
    # exercise 07.1: the load-balancing loss
    # hint: Switch §2.2, the aux formula of this module's docstring (07's README, "Load balancing"): per
    #   sequence, f counts the choices (no gradient), P averages the probabilities (the gradient's path);
    #   under a `stats_group` both are sums over its ranks first (SumOverRanks for P) and T grows with it.
    # test: tests/test_expert_parallel.py::test_load_balancing_loss_is_switchs_per_sequence_formula
    ones = probs.new_ones(B, T * k)
    routed = probs.new_zeros(B, E).scatter_add_(1, chosen.view(B, T * k), ones)   # (B, E) choices per expert
    prob_sum = probs.sum(dim=1)                                              # (B, E)
    if stats_group is not None:
        dist.all_reduce(routed, group=stats_group)                           # (B, E) whole sequences; no grad
        prob_sum = SumOverRanks.apply(prob_sum, stats_group)                 # (B, E)
        T = T * dist.get_world_size(stats_group)                             # the whole sequence's tokens
    f = routed / (T * k)                                                     # (B, E), rows sum to 1
    P = prob_sum / T                                                         # (B, E)
    return E * (f * P).sum(-1).mean()
    # end exercise
