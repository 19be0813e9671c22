import pytest

from tests.layouts import Spec, write_drafter, write_target


@pytest.fixture
def tiny_pair(tmp_path):
    """An EAGLE-layout drafter and a matching tied target, as folders."""
    drafter, target = tmp_path / "drafter", tmp_path / "target"
    tensors = write_drafter(drafter, "eagle", Spec())
    head = write_target(target)
    return drafter, target, tensors, head


__all__ = ["Spec", "write_drafter", "write_target"]
