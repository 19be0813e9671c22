"""research/logit_energy.py: the share of a head's logits a rank-r head can keep on given states."""

import torch

from tests.scripts import load_script


def test_kept_shares_match_a_float64_svd_of_the_logits():
    """Catches the covariance's square root, the centring over tokens or the rank index going wrong: the shares
    must equal a float64 SVD of the logits W X themselves (centred over the tokens for the second row), at an odd
    shape, and a vector added to every row must move the plain share but not the centred one."""
    g = torch.Generator().manual_seed(3)
    vocab, d, n = 211, 23, 400
    w = torch.randn(vocab, d, generator=g, dtype=torch.float64) * torch.logspace(0, -1, d, dtype=torch.float64)
    x = torch.randn(d, n, generator=g, dtype=torch.float64) * torch.logspace(0.5, -1, d, dtype=torch.float64)[:, None]
    ranks = [1, 5, 11]
    shares = load_script("logit_energy").kept_shares(w, x @ x.T, ranks)
    for name, logits in (("plain", w @ x), ("centred", (w - w.mean(0)) @ x)):
        s2 = torch.linalg.svdvals(logits) ** 2
        for r in ranks:
            assert abs(shares[name][r] - float(s2[:r].sum() / s2.sum())) < 1e-9, (name, r)
    shifted = load_script("logit_energy").kept_shares(w + 5.0 * torch.randn(d, generator=g, dtype=torch.float64),
                                                      x @ x.T, ranks)
    assert all(abs(shifted["centred"][r] - shares["centred"][r]) < 1e-9 for r in ranks)
    assert shifted["plain"][1] > shares["plain"][1] + 0.1
