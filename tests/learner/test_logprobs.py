"""moe_rl.learner.logprobs: token_logprobs_energy against token_logprobs, closed forms and autograd."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.learner.logprobs import token_logprobs, token_logprobs_energy


@pytest.mark.unit
def test_energy_pass_matches_token_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=gen) * 3
    tokens = torch.randint(0, 11, (3, 6), generator=gen)
    logp, ent = token_logprobs(logits, tokens, 0.7)
    logp2, ent2, spi = token_logprobs_energy(logits, tokens, 0.7)
    torch.testing.assert_close(logp2, logp, rtol=0, atol=0)  # the same log_softmax and gather
    torch.testing.assert_close(ent2, ent, rtol=1e-6, atol=1e-6)
    assert spi.dtype == torch.float32 and spi.shape == (3, 6)
    assert (spi[:, 0] == 0).all() and (spi[:, 1:] > 1 / 11 - 1e-6).all() and (spi <= 1).all()
    ref = torch.softmax(logits[:, :-1] / 0.7, -1).pow(2).sum(-1)  # sum_v pi^2 = exp(lse(2z) - 2 lse(z)) too
    torch.testing.assert_close(spi[:, 1:], ref, rtol=1e-6, atol=1e-7)
    z = logits[:, :-1] / 0.7
    lse2, lse = torch.logsumexp(2 * z, -1), torch.logsumexp(z, -1)
    torch.testing.assert_close(spi[:, 1:], (lse2 - 2 * lse).exp(), rtol=1e-5, atol=1e-7)


@pytest.mark.unit
def test_uniform_and_one_hot_closed_forms():
    V = 8
    tokens = torch.tensor([[0, 3, 5]])
    logp, ent, spi = token_logprobs_energy(torch.zeros(1, 3, V, dtype=torch.float64), tokens, 2.0)
    torch.testing.assert_close(logp, torch.tensor([[0.0, -math.log(V), -math.log(V)]], dtype=torch.float64))
    torch.testing.assert_close(ent, torch.tensor([[0.0, math.log(V), math.log(V)]], dtype=torch.float64))
    torch.testing.assert_close(spi, torch.tensor([[0.0, 1 / V, 1 / V]], dtype=torch.float64))
    peaked = torch.full((1, 3, V), -1e4, dtype=torch.float64)
    peaked[0, 0, 3] = 0.0  # position 0 predicts token 3 with certainty: energy 1 - 2 + 1 = 0
    peaked[0, 1, 2] = 0.0  # position 1 is sure of token 2 but token 5 was taken: energy 1 - 0 + 1 = 2
    logp, _, spi = token_logprobs_energy(peaked, tokens)
    w = 1 - 2 * logp.exp() + spi
    torch.testing.assert_close(w[0, 1:], torch.tensor([0.0, 2.0], dtype=torch.float64))


@pytest.mark.unit
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_energy_equals_squared_logit_gradient_norm(temperature):
    """docs/math.md 6.3 step 3: || d log pi(y) / d z ||^2 = ||e_y - pi||^2 = 1 - 2 pi(y) + sum_v pi(v)^2
    with z = logits / temperature, i.e. temperature^2 * || d log pi(y) / d logits ||^2."""
    gen = torch.Generator().manual_seed(1)
    B, S, V = 2, 5, 9
    logits = (torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    tokens = torch.randint(0, V, (B, S), generator=gen)
    logp, _, spi = token_logprobs_energy(logits, tokens, temperature)
    w = (1 - 2 * logp.exp() + spi).detach()
    for b in range(B):
        for t in range(1, S):
            (g,) = torch.autograd.grad(logp[b, t], logits, retain_graph=True)
            assert g[b, t - 1].pow(2).sum().item() * temperature**2 == pytest.approx(
                w[b, t].item(), rel=1e-12
            )
            g[b, t - 1] = 0
            assert (g == 0).all()  # log pi_t depends only on the logits that produced token t


@pytest.mark.unit
def test_low_precision_logits_compute_in_float32():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, 6, generator=gen)
    tokens = torch.randint(0, 6, (2, 4), generator=gen)
    out = token_logprobs_energy(logits.bfloat16(), tokens)
    ref = token_logprobs_energy(logits.bfloat16().float(), tokens)
    for a, b in zip(out, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b)
