"""RL core: group advantages, GRPO loss (grpo / bnpo / dr_grpo), DPO loss (OraPO's).

Every expected number is worked out by hand in the comments (float64 tensors, so the
tolerances are tight); the rest are behavioural properties (gradient signs, exact zeros).
"""

import math

import pytest
import torch

from common import group_advantages, grpo_loss
from orapo import dpo_loss

D = torch.float64
LN2 = math.log(2.0)


def t(x):
    return torch.tensor(x, dtype=D)


# --------------------------------------------------------------------------- advantages
def test_group_advantages_std_hand_values():
    # group 0: [1,0,0,1], mean 0.5, Bessel var = 4 * 0.25 / 3 = 1/3, std = 0.5773502692
    #   A = +-0.5 / (0.5773502692 + 1e-4) = +-0.8658754297607016
    # group 1: [2,2,2,2], all equal -> exactly 0
    A = group_advantages(t([1, 0, 0, 1, 2, 2, 2, 2]), group_size=4)
    a = 0.8658754297607016
    torch.testing.assert_close(A, t([a, -a, -a, a, 0, 0, 0, 0]), rtol=0, atol=1e-12)
    # G = 2: [1, 3], mean 2, std = sqrt(2) (population std would be 1) -> 1 / 1.41431356...
    A2 = group_advantages(t([1, 3]), group_size=2)
    b = 1 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(A2, t([-b, b]), rtol=0, atol=1e-12)


def test_group_advantages_scale_none_only_subtracts_mean():
    A = group_advantages(t([1, 0, 0, 1, 2, 2, 2, 5]), group_size=4, scale="none")
    # group 1 mean = 11/4 = 2.75
    torch.testing.assert_close(A, t([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]))


def test_group_advantages_identical_rewards_exactly_zero():
    # float32: mean([0.9] * 3) != 0.9, so naive (r - mean) / (std + eps) gives ~6e-4, not 0
    r = torch.full((3,), 0.9, dtype=torch.float32)
    assert (r - r.mean()).abs().max() > 0  # the float trap this guards against is real
    for scale in ("std", "none"):
        A = group_advantages(torch.cat([r, torch.tensor([0.0, 1.0, 5.0])]), 3, scale=scale)
        assert torch.equal(A[:3], torch.zeros(3)), A
        assert torch.isfinite(A).all() and (A[3:] != 0).all()


def test_group_advantages_reject_a_reward_of_nan_or_inf():
    # a user's reward function (or labeler) that returns NaN would poison every update silently
    with pytest.raises(ValueError, match=r"the reward function returned NaN or inf at completions \[1, 3\]"):
        group_advantages(t([0, float("nan"), 1, float("inf")]), group_size=2)


# --------------------------------------------------------------------------- GRPO loss
# One update per rollout: the ratio is exactly 1, so the per-token loss is -A (+ beta k3). N=2, T=3, row 1 has a
# padded last token; A = [1, -0.5]: row 0 [-1, -1, -1] sums to -3 over 3 tokens, row 1 [0.5, 0.5, (pad)] to 1 over 2.
MASK = t([[1, 1, 1], [1, 1, 0]])
ADV = t([1.0, -0.5])
LOGP = t([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.0]])


def _logp():
    return LOGP.clone().requires_grad_(True)  # (N, T)


@pytest.mark.parametrize(
    "loss_type, mcl, expected",
    [
        ("grpo", None, (-3 / 3 + 1 / 2) / 2),  # -0.25: mean per row, then over rows
        ("bnpo", None, (-3 + 1) / 5),  # -0.4: token sum / token count
        ("dr_grpo", 4, (-3 + 1) / (2 * 4)),  # -0.25: / (N * max_completion_length)
    ],
)
def test_grpo_loss_hand_values(loss_type, mcl, expected):
    loss, stats = grpo_loss(_logp(), None, ADV, MASK, loss_type=loss_type, max_completion_length=mcl)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats == {"kl": 0.0}


def test_grpo_loss_gradient_is_minus_a_grad_log_pi():
    """The ratio's gradient is logp's: d/dlogp = -A / (len_i * N) for "grpo", 0 on padding; the pad's log-prob
    (-2.0) weighs nothing."""
    logp = _logp()
    grpo_loss(logp, None, ADV, MASK)[0].backward()
    expected = t([[-1 / 6] * 3, [0.5 / 4, 0.5 / 4, 0.0]])
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


def test_grpo_loss_k3_kl_hand_value():
    # ref - logp: row 0 [ln2, 0, 0], row 1 [0, -ln2, pad 5.0]
    #   k3 = exp(d) - d - 1: ln2 -> 1 - ln2 = 0.3068528; -ln2 -> ln2 - 0.5 = 0.1931472
    logp = _logp()
    ref = logp.detach() + t([[LN2, 0, 0], [0, -LN2, 5.0]])
    k_a, k_b = 1 - LN2, LN2 - 0.5
    beta = 0.1
    loss, stats = grpo_loss(logp, ref, ADV, MASK, beta=beta)
    expected = ((-3 + beta * k_a) / 3 + (1 + beta * k_b) / 2) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["kl"] == pytest.approx((k_a + k_b) / 5, abs=1e-12)  # = 0.1 exactly
    # the kl stat is reported whenever ref is given, also with beta = 0 (loss unchanged)
    loss0, stats0 = grpo_loss(_logp(), ref, ADV, MASK, beta=0.0)
    assert loss0.item() == pytest.approx((-3 / 3 + 1 / 2) / 2, abs=1e-12)
    assert stats0["kl"] == pytest.approx(0.1, abs=1e-12)


def test_grpo_loss_equals_trls_clipped_loss_at_its_first_update():
    """TRL's GRPOTrainer loss, -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta k3 with r = exp(logp - old), written out
    here, at old = logp (its first update of a rollout, num_iterations 1): the same loss and the same gradient."""
    logp_ours, logp_trl = _logp(), _logp()
    ref = LOGP + t([[0.3, -0.2, 0.1], [0.0, 0.4, 1.0]])
    ours, _ = grpo_loss(logp_ours, ref, ADV, MASK, beta=0.04, loss_type="bnpo")
    r = torch.exp(logp_trl - logp_trl.detach())
    clipped = -torch.min(r * ADV[:, None], torch.clamp(r, 0.8, 1.2) * ADV[:, None])
    k3 = torch.exp(ref - logp_trl) - (ref - logp_trl) - 1
    trl = ((clipped + 0.04 * k3) * MASK).sum() / MASK.sum()
    assert ours.item() == pytest.approx(trl.item(), abs=1e-12)
    ours.backward()
    trl.backward()
    torch.testing.assert_close(logp_ours.grad, logp_trl.grad, rtol=0, atol=1e-12)


def test_grpo_loss_identical_rewards_give_zero_policy_gradient():
    adv = group_advantages(torch.full((2,), 0.3, dtype=D), group_size=2)  # exactly [0, 0]
    logp = _logp()
    loss, _ = grpo_loss(logp, None, adv, MASK)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros_like(logp))
    # with beta > 0 only the KL gradient is left: beta * (1 - exp(ref - logp)) / (len_i * N)
    logp = _logp()
    d = t([[LN2, 0, 0], [0, -LN2, 0]])
    loss, _ = grpo_loss(logp, logp.detach() + d, adv, MASK, beta=0.5)
    loss.backward()
    w = t([[1 / 6] * 3, [1 / 4, 1 / 4, 0]])
    torch.testing.assert_close(logp.grad, 0.5 * (1 - d.exp()) * w, rtol=0, atol=1e-12)
    assert torch.isfinite(loss)


def test_grpo_loss_token_advantages_broadcast_equal_sequence_advantages():
    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        l1, s1 = grpo_loss(_logp(), None, ADV, MASK, loss_type=loss_type, max_completion_length=3)
        l2, s2 = grpo_loss(_logp(), None, ADV[:, None].expand(2, 3), MASK, loss_type=loss_type, max_completion_length=3)
        assert l1.item() == l2.item() and s1 == s2
    # a token with advantage 0 contributes nothing: zero row 0 token 2 -> row 0 sum -2
    adv_t = ADV[:, None].expand(2, 3).clone()
    adv_t[0, 2] = 0.0
    loss, _ = grpo_loss(_logp(), None, adv_t, MASK, loss_type="bnpo")
    assert loss.item() == pytest.approx((-2 + 1) / 5, abs=1e-12)


def test_grpo_and_bnpo_agree_only_for_equal_lengths():
    full = torch.ones(2, 3, dtype=D)
    lg, _ = grpo_loss(_logp(), None, ADV, full, loss_type="grpo")
    lb, _ = grpo_loss(_logp(), None, ADV, full, loss_type="bnpo")
    assert lg.item() == pytest.approx(lb.item(), abs=1e-12)
    lg, _ = grpo_loss(_logp(), None, ADV, MASK, loss_type="grpo")
    lb, _ = grpo_loss(_logp(), None, ADV, MASK, loss_type="bnpo")
    assert lg.item() == pytest.approx(-0.25, abs=1e-12) and lb.item() == pytest.approx(-0.4, abs=1e-12)


def test_grpo_loss_empty_generation_is_finite():
    mask = t([[1, 1, 1], [0, 0, 0]])  # row 1 generated EOS-less nothing: length 0
    for loss_type, expected in [("grpo", (-3 / 3 + 0) / 2), ("bnpo", -3 / 3), ("dr_grpo", -3 / 6)]:
        logp = _logp()
        loss, stats = grpo_loss(logp, None, ADV, mask, loss_type=loss_type, max_completion_length=3)
        loss.backward()
        assert loss.item() == pytest.approx(expected, abs=1e-12)
        assert torch.isfinite(logp.grad).all() and (logp.grad[1] == 0).all()
    # all masks empty: loss 0, stats 0, no NaN
    loss, stats = grpo_loss(_logp(), None, ADV, torch.zeros(2, 3, dtype=D))
    assert loss.item() == 0.0 and stats == {"kl": 0.0}


def test_dr_grpo_requires_its_constant_normaliser():
    # no silent fallback to the batch's padded length, which would make the normaliser vary per batch
    with pytest.raises(ValueError, match="dr_grpo needs max_completion_length"):
        grpo_loss(_logp(), None, ADV, MASK, loss_type="dr_grpo")


# --------------------------------------------------------------------------- DPO loss
def test_dpo_loss_hand_value_sequence_logps():
    # beta (c - ref_c) = 0.1 * [0.5, 0] ; beta (r - ref_r) = 0.1 * [-1, 0.5]
    # margins [0.15, -0.05] -> loss = mean(log(1 + e^-0.15), log(1 + e^0.05))
    #                              = mean(0.6209570477895321, 0.7184596480132863)
    loss, stats = dpo_loss(t([-1.0, -2.0]), t([-3.0, -1.0]), t([-1.5, -2.0]), t([-2.0, -1.5]))
    assert loss.item() == pytest.approx((0.6209570477895321 + 0.7184596480132863) / 2, abs=1e-12)
    assert stats["chosen_reward"] == pytest.approx(0.025)
    assert stats["rejected_reward"] == pytest.approx(-0.025)
    assert stats["reward_margin"] == pytest.approx(0.05)
    assert stats["accuracy"] == 0.5


def test_dpo_loss_token_logps_sum_and_length_normalised():
    # chosen  policy [-1, -2, pad -3] -> sum -3, mean -1.5 ; ref [-1, -1, pad 9] -> -2, -1
    # rejected policy [-1, -1, -4]    -> sum -6, mean -2   ; ref [-2, -2, -2]    -> -6, -2
    # sum:  margin = 0.1 * ((-3 + 2) - (-6 + 6)) = -0.1  -> loss log(1 + e^0.1)  = 0.744396660073571
    # mean: margin = 0.1 * ((-1.5 + 1) - (-2 + 2)) = -0.05 -> loss log(1 + e^0.05) = 0.7184596480132863
    pc, pr = t([[-1.0, -2.0, -3.0]]), t([[-1.0, -1.0, -4.0]])
    rc, rr = t([[-1.0, -1.0, 9.0]]), t([[-2.0, -2.0, -2.0]])
    cm, rm = t([[1, 1, 0]]), t([[1, 1, 1]])
    loss, stats = dpo_loss(pc, pr, rc, rr, chosen_mask=cm, rejected_mask=rm)
    assert loss.item() == pytest.approx(0.744396660073571, abs=1e-12)
    assert stats["reward_margin"] == pytest.approx(-0.1) and stats["accuracy"] == 0.0
    loss, stats = dpo_loss(pc, pr, rc, rr, length_normalize=True, chosen_mask=cm, rejected_mask=rm)
    assert loss.item() == pytest.approx(0.7184596480132863, abs=1e-12)
    assert stats["reward_margin"] == pytest.approx(-0.05)


def test_dpo_gradient_step_raises_chosen_lowers_rejected():
    torch.manual_seed(0)
    logits = torch.nn.Parameter(torch.randn(2, 5, dtype=D))  # (T=2, V=5) a tiny "policy"
    chosen, rejected = torch.tensor([0, 1]), torch.tensor([2, 3])  # token ids, (T,)

    def seq_logps():
        lp = torch.log_softmax(logits, dim=-1)  # (T, V)
        c = lp[torch.arange(2), chosen].sum()[None]  # (1,)
        r = lp[torch.arange(2), rejected].sum()[None]  # (1,)
        return c, r

    c0, r0 = (x.detach() for x in seq_logps())  # reference = initial policy
    c, r = seq_logps()
    c.retain_grad()
    r.retain_grad()
    loss, stats = dpo_loss(c, r, c0, r0, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))  # margin 0 at the reference
    assert stats["accuracy"] == 0.0  # a tie is no preference (TRL's chosen > rejected): OraPO's first steps read 0
    loss.backward()
    # dL/dc = -beta * sigmoid(-margin) = -0.05 at margin 0; dL/dr = +0.05
    assert c.grad.item() == pytest.approx(-0.05) and r.grad.item() == pytest.approx(0.05)
    with torch.no_grad():
        logits -= 1.0 * logits.grad
    c1, r1 = seq_logps()
    assert c1.item() > c0.item() and r1.item() < r0.item()
    assert dpo_loss(c1, r1, c0, r0)[0].item() < math.log(2)
