"""--rank parsing: d/N, integers, energy:F, and every out-of-range or malformed spec."""

import pytest
import torch

from slimspec.convert.rank import energy_curve, parse_rank
from slimspec.errors import RankError


@pytest.mark.parametrize(("spec", "d", "expected"), [("d/8", 4096, 512), ("d/4", 576, 144), ("d/16", 576, 36),
                                                      ("100", 576, 100), (64, 576, 64), (" d / 8 ", 4096, 512),
                                                      ("d/2.5", 100, 40)])
def test_parse(spec, d, expected):
    assert parse_rank(spec, d) == expected


def test_energy_picks_smallest_rank():
    """Catches an off-by-one in the energy search: smallest r with cumulative share >= F."""
    s2 = torch.tensor([50.0, 30.0, 10.0, 5.0, 3.0, 2.0], dtype=torch.float64)
    assert parse_rank("energy:0.5", 6, s2) == 1
    assert parse_rank("energy:0.8", 6, s2) == 2
    assert parse_rank("energy:0.81", 6, s2) == 3
    assert parse_rank("energy:0.95", 6, s2) == 4
    assert torch.allclose(energy_curve(s2)[-1], torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("spec", ["d/1", "0", "576", "1000", "d/0", "energy:1.0", "energy:0", "abc", "d/x", "-3",
                                  "energy:", "d8", "energy:0.99999999"])
def test_rejects(spec):
    s2 = torch.tensor([1.0] * 576, dtype=torch.float64)
    with pytest.raises(RankError):
        parse_rank(spec, 576, s2)


def test_energy_needs_spectrum():
    with pytest.raises(RankError):
        parse_rank("energy:0.9", 64)
