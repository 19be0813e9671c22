"""Factorisation against a float64 torch.linalg.svd reference (Eckart-Young optimum)."""

import pytest
import torch

from slimspec.convert.factorize import (
    centered_gram,
    factorize,
    gram_matrix,
    relative_error,
    squared_singular_values,
)


def _reference(weight: torch.Tensor, rank: int) -> torch.Tensor:
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def _decaying(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -2, cols, dtype=torch.float64)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64) * scales


@pytest.mark.parametrize(("rows", "cols", "rank"), [(257, 48, 1), (1001, 64, 7), (333, 40, 39), (129, 96, 12)])
def test_error_equals_svd_optimum(rows, cols, rank):
    """Catches a factorisation that is not the Eckart-Young optimum (wrong eigenvectors, order, scaling)."""
    w = _decaying(rows, cols)
    up, down = factorize(w, rank)
    assert up.shape == (rows, rank) and down.shape == (rank, cols)
    ours = torch.linalg.norm(w - up @ down)
    ref = torch.linalg.norm(w - _reference(w, rank))
    assert abs(float(ours - ref)) <= 1e-6 * float(ref)
    assert torch.allclose(up @ down, _reference(w, rank), atol=1e-10, rtol=0)


def test_sqrt_sigma_split_across_factors():
    """Catches all of Sigma landing in one factor: both factors must carry sqrt(Sigma)."""
    w = _decaying(200, 32, seed=3)
    up, down = factorize(w, 8)
    s = torch.linalg.svdvals(w)[:8]
    assert torch.allclose(down.norm(dim=1), s.sqrt(), rtol=1e-8)
    assert torch.allclose(up.norm(dim=0), s.sqrt(), rtol=1e-8)


def test_float32_and_low_precision_inputs():
    """Catches precision loss: fp32 input keeps fp32 factors whose error matches the float64 optimum."""
    w64 = _decaying(3001, 64, seed=1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        w = w64.to(dtype)
        up, down = factorize(w, 16)
        assert up.dtype == dtype and down.dtype == dtype
        ref_err = torch.linalg.norm(w.double() - _reference(w.double(), 16)) / torch.linalg.norm(w.double())
        err = relative_error(w.float(), up.float(), down.float())
        assert abs(err - float(ref_err)) <= max(tol, 1e-2 * float(ref_err) if dtype == torch.bfloat16 else 0)


def test_rank_deficient_matrix():
    """Catches division by zero singular values: exact low-rank input is reproduced, no NaN."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(100, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 20, generator=g, dtype=torch.float64)
    up, down = factorize(w, 6)
    assert torch.isfinite(up).all() and torch.isfinite(down).all()
    assert torch.allclose(up @ down, w, atol=1e-9)


def test_chunking_does_not_change_result():
    """Catches chunk-boundary bugs: V not a multiple of the chunk gives the same Gram and factors."""
    w = _decaying(1003, 24, seed=4)
    assert torch.allclose(gram_matrix(w, chunk_rows=100), w.T @ w, rtol=1e-12)
    up1, down1 = factorize(w, 5, chunk_rows=7)
    up2, down2 = factorize(w, 5, chunk_rows=4096)
    assert torch.allclose(up1 @ down1, up2 @ down2, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("column_blocks", [1, 3, 8, 40])
def test_gram_blocks_cover_the_whole_matrix(dtype, column_blocks):
    """Catches a block-triangle bug in the Gram (a block skipped or counted twice, a lost last block when d is no
    multiple of the block width, an asymmetric result): every entry equals the float64 ``W^T W`` of the weight the
    chunks see, for any block count, including more blocks than columns."""
    w = _decaying(301, 23, seed=6).to(dtype)
    exact = w.double().T @ w.double()
    got = gram_matrix(w, chunk_rows=64, column_blocks=column_blocks)
    assert got.dtype == torch.float64 and torch.equal(got, got.T)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, exact, rtol=rtol, atol=rtol * float(exact.abs().max()))


def test_singular_values_descending_and_match_svd():
    w = _decaying(300, 40, seed=5)
    s2 = squared_singular_values(gram_matrix(w))
    assert torch.all(s2[:-1] >= s2[1:])
    assert torch.allclose(s2.sqrt(), torch.linalg.svdvals(w), rtol=1e-7, atol=1e-9)


def test_centered_spectrum_ignores_a_row_added_to_every_row():
    """Catches an energy figure inflated by the head's mean row, which softmax ignores (82 % of the embedded
    drafter's head): the centred spectrum equals a float64 SVD of the centred head at an odd shape, over several
    row chunks, and a large vector added to every row leaves it unchanged while the plain spectrum jumps."""
    from slimspec.convert.rank import energy_curve

    w = _decaying(301, 37, seed=7)
    shifted = w + 3.0 * torch.randn(37, dtype=w.dtype)
    got = squared_singular_values(centered_gram(shifted, gram_matrix(shifted), chunk_rows=64))  # sums over chunks
    exact = torch.linalg.svdvals(shifted - shifted.mean(0)) ** 2
    torch.testing.assert_close(got, exact, rtol=1e-9, atol=1e-12 * float(exact.max()))
    torch.testing.assert_close(squared_singular_values(centered_gram(w, gram_matrix(w))), got, rtol=1e-9,
                               atol=1e-12 * float(exact.max()))
    assert float(squared_singular_values(gram_matrix(shifted))[0]) > 10 * float(got[0])
    low = shifted.float()  # a float32 head: the downdate keeps the energy curve to 1e-4
    curve = energy_curve(squared_singular_values(centered_gram(low, gram_matrix(low))))
    torch.testing.assert_close(curve, energy_curve(exact), rtol=0, atol=1e-4)


def test_bad_rank():
    with pytest.raises(ValueError):
        factorize(torch.randn(10, 4), 0)
    with pytest.raises(ValueError):
        factorize(torch.randn(10, 4), 5)


def test_public_api():
    """slimspec.factorize is the documented entry point."""
    import slimspec

    up, down = slimspec.factorize(_decaying(50, 10), 3)
    assert up.shape == (50, 3) and down.shape == (3, 10)


def test_mixed_precision_eigensolver_matches_svd():
    """Catches the large-d path (float32 start + float64 Rayleigh-Ritz) losing the optimum."""
    from slimspec.convert.factorize import top_eigenpairs

    w = _decaying(2500, 1100, seed=6)
    gram = gram_matrix(w)
    exact_vals, exact_vecs = top_eigenpairs(gram, 90, mixed_from=10**9)
    mixed_vals, mixed_vecs = top_eigenpairs(gram, 90, mixed_from=1)
    assert torch.allclose(mixed_vals, exact_vals, rtol=1e-10)
    up, down = factorize(w, 90)  # d = 1100 takes the mixed path by default
    ours = torch.linalg.norm(w - up @ down)
    ref = torch.linalg.norm(w - _reference(w, 90))
    assert abs(float(ours - ref)) <= 1e-9 * float(ref)


def test_whitened_minimises_activation_error():
    """Catches a wrong whitening transform: on real activations X the whitened factors must reach the
    optimum of ||(W - AB) X||_F (rank-r truncation of W X via SVD in float64) and beat the plain SVD."""
    from slimspec.convert.factorize import factorize_whitened

    g = torch.Generator().manual_seed(7)
    w = _decaying(300, 24, seed=8)
    x = torch.randn(24, 500, generator=g, dtype=torch.float64) * torch.logspace(1, -1, 24, dtype=torch.float64)[:, None]
    up, down = factorize_whitened(w, 6, x @ x.T, ridge=0.0)
    ours = torch.linalg.norm((w - up @ down) @ x)
    best = torch.linalg.norm(w @ x - _reference(w @ x, 6))  # optimum over rank-6 maps of W X's column space
    assert abs(float(ours - best)) <= 1e-6 * float(best)
    up2, down2 = factorize(w, 6)
    assert float(torch.linalg.norm((w - up2 @ down2) @ x)) > float(ours) * 1.01


def test_whitened_factors_are_balanced_whatever_the_covariance_scale():
    """Catches the whitened start's factors carrying the covariance's scale (a sum over N calibration rows made
    ``w_up`` ~N^{1/4} too large and ``w_down`` as much too small: Adam then trained the two at very different
    relative rates, and 200 distillation steps ended at 0.84 held-out KL instead of 0.75). The product must not
    depend on the scale, each component's two norms must match, and the SVD split must stay as it was."""
    from slimspec.convert.factorize import balance_factors, factorize_whitened

    g = torch.Generator().manual_seed(9)
    w = _decaying(200, 16, seed=10)
    x = torch.randn(16, 300, generator=g, dtype=torch.float64)
    cov = x @ x.T
    up, down = factorize_whitened(w, 5, cov)
    up_big, down_big = factorize_whitened(w, 5, cov * 1e6)
    torch.testing.assert_close(up_big @ down_big, up @ down, rtol=1e-8, atol=1e-10)
    for a, b in ((up, down), (up_big, down_big)):
        torch.testing.assert_close(a.norm(dim=0), b.norm(dim=1), rtol=1e-10, atol=0.0)
    torch.testing.assert_close(up_big, up, rtol=1e-6, atol=1e-9)  # the same factors, not only the same product
    svd_up, svd_down = factorize(w, 5)
    again_up, again_down = balance_factors(svd_up, svd_down)
    torch.testing.assert_close(again_up, svd_up, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(again_down, svd_down, rtol=1e-10, atol=1e-12)
    zero_up, zero_down = balance_factors(torch.zeros(4, 2, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64))
    assert torch.isfinite(zero_up).all() and torch.equal(zero_down, torch.ones(2, 3, dtype=torch.float64))


def test_activation_covariance_chunked_matches_float64():
    """Catches the chunked accumulation of the whitening covariance dropping or double-counting rows at chunk
    edges, or letting zero-weight (prompt) rows in."""
    from types import SimpleNamespace

    from slimspec.distill.pipeline import activation_covariance

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(23, 3, 5, generator=g)
    weight = (torch.rand(23, 3, generator=g) > 0.3).float() * torch.rand(23, 3, generator=g)
    h, w = hidden.reshape(-1, 5).double(), weight.reshape(-1).double()
    expected = (h * w[:, None]).T @ h
    got = activation_covariance(SimpleNamespace(hidden=hidden, weight=weight), chunk=7)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
