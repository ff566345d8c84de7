"""megappo.algos against hand-computed cases and plain per-token loop references."""

import math

import pytest
import torch

from megappo import algos

torch.set_num_threads(1)


def _rand_mask(B, T, gen, p=0.75):
    """Random [B, T] 0/1 mask with interior holes, one fully masked row and one length-1 row."""
    mask = (torch.rand(B, T, generator=gen) < p).long()
    mask[0] = 0
    mask[1] = 0
    mask[1, T // 2] = 1
    return mask


# ----------------------------------------------------------------------------------------------------------------
# plain-loop references (python floats, one token at a time)


def ref_gae(rewards, values, mask, gamma, lam):
    """GAE over the valid positions of each row, written from the spec: masked positions copy the next valid one."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(T)):
            if mask[b][t]:
                delta = rewards[b][t] + gamma * next_value - values[b][t]
                next_adv = delta + gamma * lam * next_adv
                next_value = values[b][t]
            adv[b][t] = next_adv
    ret = [[adv[b][t] + values[b][t] for t in range(T)] for b in range(B)]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


def ref_aggregate(loss, mask, mode, num_tokens=None, num_seqs=None, norm_length=None):
    B, T = len(loss), len(loss[0])
    seq_sums, seq_means, tokens, seqs = [], [], 0, 0
    for b in range(B):
        s = n = 0
        for t in range(T):
            if mask[b][t]:
                s += loss[b][t]
                n += 1
        tokens += n
        if n:
            seqs += 1
            seq_sums.append(s)
            seq_means.append(s / n)
    num_tokens = tokens if num_tokens is None else num_tokens
    num_seqs = seqs if num_seqs is None else num_seqs
    if mode == "token-sum":
        return sum(seq_sums)
    if mode == "token-mean":
        return sum(seq_sums) / num_tokens if num_tokens else 0.0
    if mode == "seq-mean-token-mean":
        return sum(seq_means) / num_seqs if num_seqs else 0.0
    out = sum(seq_sums) / num_seqs if num_seqs else 0.0
    if mode == "seq-mean-token-sum-norm":
        out /= T if norm_length is None else norm_length
    return out


def ref_pg_token(logp, old, adv, clip_low, clip_high, clip_c):
    ratio = math.exp(min(max(logp - old, -20.0), 20.0))
    l1 = -adv * ratio
    l2 = -adv * min(max(ratio, 1 - clip_low), 1 + clip_high)
    loss = max(l1, l2)
    lower = False
    if clip_c is not None and adv < 0 and loss > -adv * clip_c:
        loss, lower = -adv * clip_c, True
    return loss, l2 > l1, lower


# ----------------------------------------------------------------------------------------------------------------
# masked reductions


def test_masked_mean_hand_and_loop():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert algos.masked_mean(x, m).item() == pytest.approx(13 / 4)  # masked nan/inf ignored
    torch.testing.assert_close(algos.masked_mean(x, m, dim=-1), torch.tensor([1.5, 5.0]))
    torch.testing.assert_close(algos.masked_mean(x, m.bool(), dim=0), torch.tensor([2.5, 2.0, 6.0]))
    assert algos.masked_mean(x, torch.zeros_like(m)).item() == 0.0  # empty mask: 0, not NaN
    with pytest.raises(ValueError, match="mask shape"):
        algos.masked_mean(x, m[:, :2])


def test_masked_whiten_matches_loop():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=gen, dtype=torch.float64) * 3 + 2
    m = _rand_mask(5, 9, gen)
    vals = [x[b, t].item() for b in range(5) for t in range(9) if m[b, t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    expected = (x - mean) / math.sqrt(var + 1e-8)
    torch.testing.assert_close(algos.masked_whiten(x, m), expected)
    torch.testing.assert_close(algos.masked_whiten(x, m, shift_mean=False), expected + mean)
    w = algos.masked_whiten(x, m)
    assert algos.masked_mean(w, m).abs().item() < 1e-12


def test_masked_whiten_degenerate_masks_stay_finite():
    x = torch.tensor([[3.0, 5.0, 7.0]])
    out = algos.masked_whiten(x, torch.tensor([[0, 1, 0]]))  # one element: no variance, shift only
    torch.testing.assert_close(out, torch.tensor([[-2.0, 0.0, 2.0]]))
    torch.testing.assert_close(algos.masked_whiten(x, torch.zeros(1, 3)), x)


# ----------------------------------------------------------------------------------------------------------------
# GAE


def test_gae_hand_computed():
    # one row, tokens at t=0, 1, 3 valid, t=2 an interior hole, t=4 padding
    r = torch.tensor([[0.0, 0.5, 9.0, 1.0, 9.0]])
    v = torch.tensor([[1.0, 2.0, 7.0, 3.0, 7.0]])
    m = torch.tensor([[1, 1, 0, 1, 0]])
    g, lam = 0.5, 0.5
    d3 = 1.0 + g * 0.0 - 3.0  # value after the last token is 0
    d1 = 0.5 + g * 3.0 - 2.0  # the hole at t=2 is skipped: next value is v[3]
    d0 = 0.0 + g * 2.0 - 1.0
    a3 = d3
    a1 = d1 + g * lam * a3
    a0 = d0 + g * lam * a1
    adv, ret = algos.compute_gae(r, v, m, gamma=g, lam=lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a3, a3, 0.0]]))
    torch.testing.assert_close(ret, adv + v)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.0), (0.0, 1.0), (0.5, 0.3)])
def test_gae_matches_loop(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    B, T = 6, 37
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = _rand_mask(B, T, gen)
    ref_adv, ref_ret = ref_gae(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    r[m == 0] = float("nan")  # rewards at masked positions are ignored
    adv, ret = algos.compute_gae(r, v, m, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert (adv[0] == 0).all()  # fully masked row: no advantage


def test_gae_long_sequence_float32_is_stable():
    # the scan never divides by gamma*lam products, so long rows with strong decay stay accurate in float32
    gen = torch.Generator().manual_seed(2)
    B, T = 3, 2000
    r = torch.randn(B, T, generator=gen)
    v = torch.randn(B, T, generator=gen)
    m = _rand_mask(B, T, gen, p=0.9)
    ref_adv, _ = ref_gae(r.double().tolist(), v.double().tolist(), m.tolist(), 0.9, 0.5)
    adv, _ = algos.compute_gae(r, v, m, gamma=0.9, lam=0.5)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), ref_adv, atol=1e-5, rtol=1e-5)


def test_gae_edges():
    r, v = torch.tensor([[2.0]]), torch.tensor([[0.5]])
    adv, ret = algos.compute_gae(r, v, torch.ones(1, 1), gamma=0.9, lam=0.9)  # length-1 response
    torch.testing.assert_close(adv, torch.tensor([[1.5]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0]]))
    adv, _ = algos.compute_gae(torch.randn(4, 5), torch.randn(4, 5), torch.zeros(4, 5), gamma=1.0, lam=0.9)
    assert (adv == 0).all()
    with pytest.raises(ValueError, match="gamma and lam"):
        algos.compute_gae(r, v, torch.ones(1, 1), gamma=1.1, lam=1.0)


# ----------------------------------------------------------------------------------------------------------------
# GRPO


def test_grpo_hand_and_loop():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 5.0, 0.0, 0.0])
    ids = ["a", "a", "a", "b", "c", "c", "c"]
    adv = algos.compute_grpo_advantages(scores, ids)
    # group a: mean 2/3, unbiased std sqrt(1/3); b is a singleton (mean 0, std 1)
    s = math.sqrt(1 / 3)
    sc = math.sqrt(((10 / 3) ** 2 + 2 * (5 / 3) ** 2) / 2)  # group c: mean 5/3
    expected = [1 / 3 / (s + 1e-6), -2 / 3 / (s + 1e-6), 1 / 3 / (s + 1e-6), 1 / (1 + 1e-6),
                (10 / 3) / (sc + 1e-6), (-5 / 3) / (sc + 1e-6), (-5 / 3) / (sc + 1e-6)]
    torch.testing.assert_close(adv, torch.tensor(expected))
    no_std = algos.compute_grpo_advantages(scores, torch.tensor([0, 0, 0, 7, 3, 3, 3]), norm_by_std=False)
    torch.testing.assert_close(no_std, torch.tensor([1 / 3, -2 / 3, 1 / 3, 1.0, 10 / 3, -5 / 3, -5 / 3]))


def test_grpo_matches_loop_and_equal_scores():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 9, (64,), generator=gen)
    scores = torch.randn(64, generator=gen, dtype=torch.float64)
    adv = algos.compute_grpo_advantages(scores, ids, eps=1e-4)
    for b in range(64):
        group = [scores[j].item() for j in range(64) if ids[j] == ids[b]]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        assert adv[b].item() == pytest.approx((scores[b].item() - mean) / (std + 1e-4), rel=1e-9)
    same = algos.compute_grpo_advantages(torch.ones(4), [0, 0, 1, 1])
    assert (same == 0).all()
    with pytest.raises(ValueError, match="group_ids"):
        algos.compute_grpo_advantages(torch.ones(4), [0, 0, 1])


# ----------------------------------------------------------------------------------------------------------------
# KL


def test_kl_penalty_hand_values():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.5, -1.0, -0.5])
    d = logp - ref  # [0.5, -1, 0]
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "k1"), d)
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "kl"), d)
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "abs"), d.abs())
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "mse"), 0.5 * d**2)
    k3 = torch.tensor([math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1, 0.0])
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "low_var_kl"), k3)
    torch.testing.assert_close(algos.kl_penalty(logp, ref, "k3"), k3)
    with pytest.raises(ValueError, match="valid kinds: k1, kl, abs"):
        algos.kl_penalty(logp, ref, "full")


def test_kl_penalty_very_large_kl_is_finite_and_clamped():
    logp = torch.tensor([0.0, -1e4, 0.0, -30.0])
    ref = torch.tensor([-1e4, 0.0, -30.0, 0.0])
    for kind in algos.KL_KINDS:
        assert torch.isfinite(algos.kl_penalty(logp, ref, kind)).all(), kind
    k3 = algos.kl_penalty(logp, ref, "k3")
    torch.testing.assert_close(k3, torch.full((4,), 10.0))  # x clamps to +-20, e^x - x - 1 then to 10


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_plus_kinds_forward_base_backward_k2(base):
    gen = torch.Generator().manual_seed(4)
    logp = torch.randn(4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    weight = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    plus = algos.kl_penalty(logp, ref, base + "+")
    torch.testing.assert_close(plus, algos.kl_penalty(logp, ref, base))
    (g_plus,) = torch.autograd.grad((plus * weight).sum(), logp)
    (g_k2,) = torch.autograd.grad((algos.kl_penalty(logp, ref, "k2") * weight).sum(), logp)
    torch.testing.assert_close(g_plus, g_k2)
    torch.testing.assert_close(g_plus, weight * (logp - ref).detach())


def test_apply_kl_penalty():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [5.0, 5.0, 5.0]])
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -2.0, -1.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -0.5, -2.0], [-1.0, -1.0, 0.0], [-9.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards, mean_kl = algos.apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kind="k1")
    kl = torch.tensor([[0.5, -0.5, 1.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0]])  # masked tokens: no penalty
    torch.testing.assert_close(rewards, scores - 0.1 * kl)
    # row means 1/3 and -1/2; the fully masked row is not a sequence
    assert mean_kl.item() == pytest.approx((1 / 3 - 1 / 2) / 2)
    assert not mean_kl.requires_grad
    _, empty = algos.apply_kl_penalty(scores, old, ref, torch.zeros(3, 3), kl_coef=0.1)
    assert empty.item() == 0.0


def test_kl_controllers_update_and_state_roundtrip():
    fixed = algos.FixedKLController(0.01)
    fixed.update(5.0, 100)
    assert fixed.value == 0.01
    ada = algos.AdaptiveKLController(0.2, target_kl=0.1, horizon=1000)
    ada.update(0.15, n_steps=100)  # e = 0.5 -> clipped to 0.2
    assert ada.value == pytest.approx(0.2 * (1 + 0.2 * 100 / 1000))
    ada.update(torch.tensor(0.09), n_steps=50)  # e = -0.1
    expected = 0.2 * 1.02 * (1 - 0.1 * 50 / 1000)
    assert ada.value == pytest.approx(expected)
    ada.update(0.0, n_steps=10)  # e = -1 -> clipped to -0.2
    expected *= 1 - 0.2 * 10 / 1000
    assert ada.value == pytest.approx(expected)

    restored = algos.AdaptiveKLController(0.2, target_kl=0.1, horizon=1000)
    restored.load_state_dict(ada.state_dict())
    assert restored.value == ada.value
    restored.update(0.3, 7)
    ada.update(0.3, 7)
    assert restored.value == ada.value
    fixed2 = algos.FixedKLController(0.5)
    fixed2.load_state_dict(fixed.state_dict())
    assert fixed2.value == 0.01
    assert isinstance(algos.build_kl_controller("adaptive", kl_coef=0.1, target_kl=1, horizon=5),
                      algos.AdaptiveKLController)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        algos.build_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="target_kl"):
        algos.AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


# ----------------------------------------------------------------------------------------------------------------
# aggregation and losses


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_aggregate_matches_loop(mode):
    gen = torch.Generator().manual_seed(5)
    loss = torch.randn(7, 11, generator=gen, dtype=torch.float64)
    mask = _rand_mask(7, 11, gen)
    loss[mask == 0] = float("nan")  # masked garbage must not leak
    got = algos.aggregate_loss(loss, mask, mode)
    assert got.item() == pytest.approx(ref_aggregate(loss.tolist(), mask.tolist(), mode), rel=1e-12)
    got = algos.aggregate_loss(loss, mask, mode, num_tokens=100, num_seqs=13, norm_length=4)
    want = ref_aggregate(loss.tolist(), mask.tolist(), mode, num_tokens=100, num_seqs=13, norm_length=4)
    assert got.item() == pytest.approx(want, rel=1e-12)
    assert algos.aggregate_loss(loss, torch.zeros_like(mask), mode).item() == 0.0
    assert algos.aggregate_loss(loss, torch.zeros_like(mask), mode, num_tokens=0, num_seqs=0).item() == 0.0


@pytest.mark.parametrize("mode", algos.AGG_MODES)
def test_aggregate_pieces_sum_to_minibatch_with_global_counts(mode):
    """Split a mini-batch over 2 DP ranks x 2 micro-batches: with global counts, loss and grad sum to the whole."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = _rand_mask(8, 10, gen)
    whole = algos.aggregate_loss(x.square(), mask, mode)
    (g_whole,) = torch.autograd.grad(whole, x)
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    parts = [
        algos.aggregate_loss(x[i : i + 2].square(), mask[i : i + 2], mode, num_tokens=num_tokens, num_seqs=num_seqs)
        for i in range(0, 8, 2)
    ]
    (g_parts,) = torch.autograd.grad(sum(parts), x)
    torch.testing.assert_close(sum(parts), whole)
    torch.testing.assert_close(g_parts, g_whole)


def test_aggregate_bad_mode():
    with pytest.raises(ValueError, match="valid modes: token-mean, token-sum"):
        algos.aggregate_loss(torch.zeros(2, 2), torch.ones(2, 2), "seq-mean")


def test_policy_loss_hand_computed():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(10.0), math.log(1.1)]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, -1.0, -2.0, 3.0]])
    mask = torch.ones(1, 4)
    loss, metrics = algos.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=3.0)
    # r=1.5, A=1: max(-1.5, -1.28) = -1.28 (clipped); r=0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped);
    # r=10, A=-2: max(20, 2.56) = 20 -> dual cap 6; r=1.1, A=3: max(-3.3, -3.3) = -3.3
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.8 + 6.0 - 3.3) / 4))
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(1.5 * 0.5 * 10 * 1.1) / 4)
    no_dual, m2 = algos.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=None)
    torch.testing.assert_close(no_dual, torch.tensor((-1.28 + 0.8 + 20.0 - 3.3) / 4))
    assert m2["pg_clipfrac_lower"].item() == 0.0
    for bad in (1.0, 0.5):
        with pytest.raises(ValueError, match="clip_c"):
            algos.policy_loss(logp, old, adv, mask, clip_c=bad)


@pytest.mark.parametrize("clip_c", [3.0, None])
def test_policy_loss_matches_loop(clip_c):
    gen = torch.Generator().manual_seed(7)
    B, T = 5, 13
    logp = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    old = logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64) * 2
    mask = _rand_mask(B, T, gen)
    loss, metrics = algos.policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.3, clip_c=clip_c,
                                      agg_mode="seq-mean-token-mean")
    clipped, lower, rows = [], [], []
    for b in range(B):
        row = []
        for t in range(T):
            if mask[b, t]:
                l, c, lo = ref_pg_token(logp[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.1, 0.3, clip_c)
                row.append(l)
                clipped.append(c)
                lower.append(lo)
        if row:
            rows.append(sum(row) / len(row))
    assert loss.item() == pytest.approx(sum(rows) / len(rows), rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped))
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(sum(lower) / len(lower))
    assert all(not v.requires_grad for v in metrics.values())


def test_policy_loss_extreme_ratios_and_empty_mask():
    logp = torch.tensor([[0.0, -500.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-500.0, 0.0, float("nan")]])
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = algos.policy_loss(logp, old, adv, mask)
    loss.backward()
    # ratio e^20 with A<0 is capped at 3 (no gradient); ratio e^-20 with A>0 is unclipped (-A r ~ 0)
    torch.testing.assert_close(loss, torch.tensor(1.5))
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0
    assert all(torch.isfinite(v) for v in metrics.values())
    loss0, metrics0 = algos.policy_loss(logp, old, adv, torch.zeros(1, 3))
    assert loss0.item() == 0.0 and all(v.item() == 0.0 for v in metrics0.values())


def test_value_loss_hand_and_loop():
    v = torch.tensor([[1.0, 2.0, 0.0, 9.0]])
    old = torch.tensor([[0.0, 2.1, 0.0, 0.0]])
    ret = torch.tensor([[1.0, 0.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = algos.value_loss(v, old, ret, mask, clip_range=0.5)
    # t0: max(0, (0.5-1)^2)=0.25 clipped; t1: max(4, 4)=4; t2: max(9, 9)=9
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.25 + 4 + 9) / 3))
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    plain, m2 = algos.value_loss(v, old, ret, mask, clip_range=None, agg_mode="token-sum")
    torch.testing.assert_close(plain, torch.tensor(0.5 * (0 + 4 + 9)))
    assert m2["vf_clipfrac"].item() == 0.0

    gen = torch.Generator().manual_seed(8)
    v, old, ret = (torch.randn(4, 9, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = _rand_mask(4, 9, gen)
    v.requires_grad_(True)
    ret_garbage = torch.where(mask.bool(), ret, torch.tensor(float("nan"), dtype=ret.dtype))
    loss, _ = algos.value_loss(v, old, ret_garbage, mask, clip_range=0.2)
    loss.backward()
    assert torch.isfinite(v.grad).all() and (v.grad[mask == 0] == 0).all()
    terms = []
    for b in range(4):
        for t in range(9):
            if mask[b, t]:
                vc = old[b, t].item() + min(max(v[b, t].item() - old[b, t].item(), -0.2), 0.2)
                terms.append(max((v[b, t].item() - ret[b, t].item()) ** 2, (vc - ret[b, t].item()) ** 2))
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms), rel=1e-12)


def test_value_clipfrac_counts_only_clipped_tokens():
    # float32 values much smaller than the old values they are compared with: old + (v - old) is not v bit for bit,
    # so clipping as old + clamp(v - old, -c, c) made vf_clipped > vf_unclipped on tokens nothing clipped
    gen = torch.Generator().manual_seed(11)
    c = 0.5
    v = torch.randn(8, 64, generator=gen) * 1e-3
    old = v + (torch.rand(8, 64, generator=gen) * 2 - 1) * (0.9 * c)  # v strictly inside [old - c, old + c]
    ret = torch.randn(8, 64, generator=gen)
    mask = torch.ones(8, 64)
    rounded = old + torch.clamp(v - old, -c, c)
    assert ((rounded - ret).square() > (v - ret).square()).any()  # the case the old formula miscounted
    loss, metrics = algos.value_loss(v, old, ret, mask, clip_range=c)
    assert metrics["vf_clipfrac"].item() == 0.0
    torch.testing.assert_close(loss, 0.5 * (v - ret).square().mean())

    # every other token moves past old + c towards a return far above: the clipped term is the larger one there
    old = torch.full((8, 64), 1000.1)
    v = old + (torch.rand(8, 64, generator=gen) * 2 - 1) * (0.9 * c)
    out = torch.arange(64) % 2 == 0
    v2 = torch.where(out, old + 2 * c, v)
    ret2 = torch.where(out, old + 10.0, ret)
    loss2, metrics2 = algos.value_loss(v2, old, ret2, mask, clip_range=c)
    assert metrics2["vf_clipfrac"].item() == 0.5
    want = torch.where(out, (old + c - ret2).square(), (v2 - ret2).square())
    torch.testing.assert_close(loss2, 0.5 * want.mean())
    # a token past the range but moving away from its return keeps the unclipped (larger) term: not counted
    v3 = torch.where(out, old - 2 * c, v)
    _, metrics3 = algos.value_loss(v3, old, ret2, mask, clip_range=c)
    assert metrics3["vf_clipfrac"].item() == 0.0


def test_entropy_from_logits():
    V = 17
    assert algos.entropy_from_logits(torch.zeros(2, 3, V)).allclose(torch.full((2, 3), math.log(V)))
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 5, V, generator=gen, dtype=torch.float64) * 4
    want = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(algos.entropy_from_logits(logits), want)
    loop = [-sum(p * math.log(p) for p in torch.softmax(logits[1, 2], -1).tolist() if p > 0)]
    assert algos.entropy_from_logits(logits)[1, 2].item() == pytest.approx(loop[0], rel=1e-10)
    masked = torch.tensor([[0.0, 0.0, float("-inf")]])
    torch.testing.assert_close(algos.entropy_from_logits(masked), torch.tensor([math.log(2)]))
    onehot = torch.tensor([[1e4, 0.0, 0.0]])
    assert algos.entropy_from_logits(onehot).item() == pytest.approx(0.0, abs=1e-6)
    bf16 = algos.entropy_from_logits(logits.to(torch.bfloat16))
    assert bf16.dtype == torch.float32 and torch.allclose(bf16.double(), want, atol=0.05)


def test_opo_lengths_in_a_multi_turn_step_are_the_model_tokens():
    """The trainer's advantage phase weighs OPO's baseline by the loss mask's tokens (verl's response_mask), not by
    the attention mask, which also counts the tool answers of a multi-turn rollout."""
    from types import SimpleNamespace

    from megappo.algos.estimators import opo, EstimatorParams
    from megappo.config import load_config
    from megappo.trainer import phases
    from megappo.trainer.experience import build_experience, Samples

    responses = [[5, 6, 7, 8, 9, 10], [5, 6], [7, 8, 9], [5]]
    loss_masks = [[1, 0, 0, 0, 1, 1], None, [1, 0, 1], None]  # tool answers in the first and third
    n = len(responses)
    samples = Samples(prompt_ids=[[1, 2]] * n, response_ids=responses, rollout_log_probs=[[0.0] * len(r) for r in
                      responses], truncated=[False] * n, uids=[0, 0, 0, 0], data_sources=["t"] * n,
                      ground_truths=[None] * n, extra_infos=[{}] * n, weight_versions=[0] * n,
                      dataset_indices=[0] * n, partial=[False] * n, loss_masks=loss_masks)
    exp = build_experience(samples, range(n), pad_token_id=0)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    rewards = torch.zeros(exp.mask.shape)
    rewards[torch.arange(n), exp.last_scored_index()] = scores
    exp.token_rewards = rewards
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=opo",
                             "actor_rollout_ref.rollout.n=4"])
    run = SimpleNamespace(cfg=cfg, ps=SimpleNamespace(dp_size=1, dp_rank=0, dp_group=None))
    phases.advantages(run, exp)
    model_tokens = torch.tensor([3.0, 2.0, 2.0, 1.0])
    assert torch.equal(exp.mask.sum(-1).float(), model_tokens)
    params = EstimatorParams(gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, gdpo_reward_weights=None)
    expected = opo(scores, torch.zeros(n, dtype=torch.long), model_tokens, params)
    torch.testing.assert_close(exp.train.advantages, expected[:, None] * exp.mask)
    attention = opo(scores, torch.zeros(n, dtype=torch.long), exp.response_lengths().float(), params)
    assert not torch.allclose(expected, attention)  # the attention mask's lengths would give other numbers


def test_gdpo_step_reads_the_reward_components():
    """The trainer's phases hand gdpo algorithm.gdpo_reward_keys of the reward function's extras (a failed sample:
    failure_score), not the summed score; a key the function did not return stops the run naming what it did."""
    from types import SimpleNamespace

    from megappo.algos.estimators import EstimatorParams, gdpo, get_adv_estimator, outcome_to_tokens
    from megappo.config import load_config
    from megappo.platform.exits import RunStopped
    from megappo.trainer import phases
    from megappo.trainer.experience import Samples, build_experience

    n = 6
    samples = Samples(prompt_ids=[[1, 2]] * n, response_ids=[[5] * (k + 1) for k in range(n)],
                      rollout_log_probs=[[0.0] * (k + 1) for k in range(n)], truncated=[False] * n,
                      uids=[0, 0, 0, 1, 1, 1], data_sources=["t"] * n, ground_truths=[None] * n,
                      extra_infos=[{}] * n, weight_versions=[0] * n, dataset_indices=[0] * n, partial=[False] * n)
    exp = build_experience(samples, range(n), pad_token_id=0)
    exp.token_rewards = torch.zeros(exp.mask.shape)
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=gdpo",
                             "actor_rollout_ref.rollout.n=3", "algorithm.gdpo_reward_keys=[fmt,acc]",
                             "algorithm.gdpo_reward_weights=[0.5,2]", "reward_model.failure_score=-1"])
    run = SimpleNamespace(cfg=cfg, ps=SimpleNamespace(dp_size=1, dp_rank=0, dp_group=None))
    extras = {"fmt": [1.0, 0.0, 1.0, 1.0, 1.0, 0.0], "acc": [0.0, 1.0, float("nan"), 1.0, 0.0, 0.0], "x": [0.0] * n}
    phases.reward_components(run, exp, extras)
    torch.testing.assert_close(exp.reward_components[1], torch.tensor([0.0, 1.0, -1.0, 1.0, 0.0, 0.0]))
    phases.advantages(run, exp)
    p = EstimatorParams(gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, gdpo_reward_weights=(0.5, 2.0))
    seq = gdpo(exp.reward_components, exp.uids, exp.mask.sum(-1), p)
    expected, _ = outcome_to_tokens(get_adv_estimator("gdpo"), seq, exp.mask)
    torch.testing.assert_close(exp.train.advantages, expected)
    assert exp.train.advantages.abs().sum() > 0  # the summed token rewards (all 0) would give nothing
    with pytest.raises(RunStopped, match=r"names acc, which .* did not return \(it returned: score, acc2, fmt"):
        phases.reward_components(run, exp, {"fmt": extras["fmt"], "acc2": extras["acc"]})


def test_dynamic_sampling_keeps_each_kept_samples_reward_extras(monkeypatch):
    """With algorithm.filter_groups, the reward extras gdpo reads follow the kept rows across generation batches (a
    key one batch lacks is NaN in its rows)."""
    import math
    from types import SimpleNamespace

    from megappo.config import load_config
    from megappo.trainer import dynamic_sampling, phases
    from megappo.trainer.experience import Samples
    from megappo.trainer.metrics import Timer

    def batch(first_uid):
        n = 4
        return Samples(prompt_ids=[[1]] * n, response_ids=[[5]] * n, rollout_log_probs=[[0.0]] * n,
                       truncated=[False] * n, uids=[first_uid, first_uid, first_uid + 1, first_uid + 1],
                       data_sources=["t"] * n, ground_truths=[None] * n, extra_infos=[{}] * n,
                       weight_versions=[0] * n, dataset_indices=list(range(n)), partial=[False] * n)

    # batch 0: group 0 constant (dropped), group 1 kept; batch 1: group 2 kept, group 3 surplus
    batches = [batch(0), batch(2)]
    scored = [phases.RuleScores([1.0, 1.0, 0.0, 1.0], {}, {"fmt": [9.0, 9.0, 1.0, 2.0]}),
              phases.RuleScores([0.0, 1.0, 0.0, 1.0], {}, {"fmt": [3.0, 4.0, 5.0, 6.0], "acc": [7.0, 8.0, 0.0, 0.0]})]
    monkeypatch.setattr(dynamic_sampling, "_score", lambda run, s: (scored[0].scores, {}, scored.pop(0)))
    source = SimpleNamespace(take=lambda step, gen_batch: (batches[gen_batch], {}))
    cfg = load_config(None, ["actor_rollout_ref.model.path=/m", "algorithm.filter_groups.enable=true",
                             "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2"])
    run = SimpleNamespace(cfg=cfg, state=SimpleNamespace(weight_version=0), roles=SimpleNamespace(critic=None))
    out = dynamic_sampling.rollout_and_score(run, source, 1, Timer())
    assert out.scores == [0.0, 1.0, 0.0, 1.0]
    assert out.extras["fmt"] == [1.0, 2.0, 3.0, 4.0]
    assert all(math.isnan(v) for v in out.extras["acc"][:2]) and out.extras["acc"][2:] == [7.0, 8.0]
