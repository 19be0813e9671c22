"""Teacher caches in the "rows" layout: hidden states memory-mapped from raw row files, old shard caches still read."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slimspec.distill.teacher import (
    CACHE_VERSION,
    TeacherData,
    TeacherSettings,
    _write_teacher_folder,
    load_teacher_data,
)
from slimspec.errors import SlimSpecError


def _sequence(n: int, index: int, aux_width: int, final_width: int, seed: int = 0):
    """Sequence ``index``: (ids, split, aux, final) like the teacher builders yield them, float32 states (stored as
    bf16), from its own seed so any one can be regenerated without the others."""
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    ids = torch.randint(0, 1000, (n,), generator=gen).tolist()
    return ids, n // 3, torch.randn(n, aux_width, generator=gen), torch.randn(n, final_width, generator=gen)


def _sequences(lengths: list[int], aux_width: int, final_width: int, seed: int = 0):
    """The sequences of ``lengths``, one at a time (the builders stream them too)."""
    for index, n in enumerate(lengths):
        yield _sequence(n, index, aux_width, final_width, seed)


def _write(tmp_path: Path, lengths: list[int], aux_width: int, final_width: int, seed: int = 0,
           key: str = "k") -> TeacherData:
    return _write_teacher_folder(Path("target"), tmp_path, key, tmp_path / key, TeacherSettings(), 4,
                                 _sequences(lengths, aux_width, final_width, seed), len(lengths), torch.bfloat16,
                                 False, "content-sample", cleanup=lambda: None)


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_rows_round_trip_per_sequence(tmp_path):
    """Catches rows written out of step with the offsets (a sequence would read its neighbour's states), the
    loss mask's off-by-one (positions from split - 1 on), and short sequences (< 3 tokens) that must be dropped."""
    lengths = [7, 2, 11, 5]
    data = _write(tmp_path, lengths, aux_width=12, final_width=4)
    seqs = list(_sequences(lengths, aux_width=12, final_width=4))
    assert data.manifest["layout"] == "rows" and len(data) == 3 and data.num_tokens == 7 + 11 + 5
    for i, (ids, split, aux, final) in enumerate(s for s in seqs if len(s[0]) >= 3):
        got = data.sequence(i)
        assert got["input_ids"].tolist() == ids
        assert got["loss_mask"].tolist() == [j >= split - 1 for j in range(len(ids))]
        assert torch.equal(got["aux"], aux.to(torch.bfloat16)) and torch.equal(got["final"], final.to(torch.bfloat16))
    # the answers (VocabTrim counts, a new drafter's draft vocabulary) start at split, not at the mask's split - 1
    kept = [s for s in seqs if len(s[0]) >= 3]
    assert data.response_ids().tolist() == [t for ids, split, _, _ in kept for t in ids[split:]]
    again = load_teacher_data(tmp_path / "k")
    assert torch.equal(again.aux, data.aux) and torch.equal(again.final, data.final)


def test_rows_are_mapped_not_read_into_memory(tmp_path):
    """Catches a loader that reads the hidden states into RAM (a cache larger than memory would be killed):
    loading 256 MiB of rows must not grow the resident set by more than a fraction of that."""
    lengths = [1000] * 128  # 128k tokens x (896 + 128) bf16 = 256 MiB
    _write(tmp_path, lengths, aux_width=896, final_width=128, seed=1, key="big")
    assert (tmp_path / "big" / "aux.rows").stat().st_size == 128_000 * 896 * 2
    before = _rss_bytes()
    data = load_teacher_data(tmp_path / "big")
    grown = _rss_bytes() - before
    assert data.aux.shape == (128_000, 896) and data.aux.dtype == torch.bfloat16
    assert grown < 32 * 2**20, f"loading grew RSS by {grown / 2**20:.0f} MiB"
    _, _, aux, final = _sequence(1000, 127, 896, 128, seed=1)  # the mapped rows are the written ones
    last = data.sequence(127)
    assert torch.equal(last["aux"], aux.to(torch.bfloat16)) and torch.equal(last["final"], final.to(torch.bfloat16))


def test_damaged_rows_file_is_refused(tmp_path):
    """Catches a truncated row file (a killed copy, a full disk) read as if whole: it would map past the end."""
    _write(tmp_path, [6, 9], aux_width=8, final_width=4)
    rows = tmp_path / "k" / "aux.rows"
    rows.write_bytes(rows.read_bytes()[:-16])
    with pytest.raises(SlimSpecError, match="damaged"):
        load_teacher_data(tmp_path / "k")


def test_old_shard_caches_still_load(tmp_path):
    """Catches a loader that only knows the new layout: caches written before it (safetensors shards holding ids,
    mask and states) must load with the same values, so nobody regenerates hours of teacher data."""
    new = _write(tmp_path, [5, 8, 6], aux_width=6, final_width=3, seed=2)
    old = tmp_path / "old"
    old.mkdir()
    cut = int(new.starts[2])  # two shards, split between sequences
    names = []
    for i, (a, b) in enumerate([(0, cut), (cut, new.num_tokens)]):
        names.append(f"shard-{i:05d}.safetensors")
        save_file({"input_ids": new.input_ids[a:b].clone(), "loss_mask": new.loss_mask[a:b].clone(),
                   "aux": new.aux[a:b].clone(), "final": new.final[a:b].clone()}, str(old / names[-1]))
    manifest = {"version": CACHE_VERSION, "num_tokens": new.num_tokens, "starts": new.starts.tolist(), "shards": names,
                "hidden_size": 3}
    (old / "manifest.json").write_text(json.dumps(manifest))
    loaded = load_teacher_data(old)
    for key in ("input_ids", "loss_mask", "aux", "final", "starts"):
        assert torch.equal(getattr(loaded, key), getattr(new, key)), key
