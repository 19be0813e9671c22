"""The teacher's answering copy runs in bf16 only where the CPU multiplies bf16 natively.

On a CPU with AVX2 but no AVX512-BF16/AMX, PyTorch emulates bf16 and the brief recipe's 300 answers took 20 min
instead of ~2.5 (``make demo`` broke its 15-minute budget); these tests pin the choice, its overrides, and that
it reaches the teacher's cache key on every path that builds teacher data."""

import pytest
from click.testing import CliRunner

from slimspec import hardware
from slimspec.distill.pipeline import DataOptions
from slimspec.distill.teacher import TeacherSettings, build_teacher_data, cache_key
from slimspec.errors import SlimSpecError
from slimspec.prompts import Prompt
from slimspec.workflows import batch

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 fma avx avx2 f16c\nbogomips\t: 4000\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"


@pytest.mark.parametrize(("cpuinfo", "expected"), [(AVX2_ONLY, "float32"), (ZEN4, "bfloat16"),
                                                   (SAPPHIRE, "bfloat16"), ("", "float32")])
def test_dtype_follows_the_cpu_flags(tmp_path, monkeypatch, cpuinfo, expected):
    """Catches bf16 chosen on an AVX2-only CPU (the 8x slower demo) or fp32 on one with native bf16 (2x slower)."""
    monkeypatch.delenv(hardware.GENERATION_DTYPE_ENV, raising=False)
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert hardware.default_generation_dtype(hardware.cpu_flags(path)) == expected


def test_unreadable_cpuinfo_means_no_flags(tmp_path):
    """Catches a crash on machines without /proc/cpuinfo (macOS): no flags, so float32."""
    assert hardware.cpu_flags(tmp_path / "absent") == set()


def test_environment_overrides_and_is_checked(monkeypatch):
    """Catches $SLIMSPEC_GENERATION_DTYPE ignored, or a typo in it passed on to torch as an attribute name."""
    monkeypatch.setenv(hardware.GENERATION_DTYPE_ENV, "bfloat16")
    assert hardware.default_generation_dtype({"avx2"}) == "bfloat16"
    assert TeacherSettings().generation_dtype == "bfloat16"
    monkeypatch.setenv(hardware.GENERATION_DTYPE_ENV, "bf16")
    with pytest.raises(SlimSpecError, match="SLIMSPEC_GENERATION_DTYPE"):
        hardware.default_generation_dtype()


def test_dtype_is_part_of_the_cache_key(tmp_path):
    """Catches a cache of bf16 answers reused as fp32 ones (greedy answers differ between the two dtypes)."""
    (tmp_path / "config.json").write_text("{}")
    prompts = [Prompt(id="a", text="hello")]
    keys = {cache_key(tmp_path, prompts, TeacherSettings(generation_dtype=d)) for d in ("bfloat16", "float32")}
    assert len(keys) == 2


def test_bad_dtype_is_a_clear_error(tmp_path):
    """Catches an unknown dtype reaching ``getattr(torch, ...)`` deep inside generation."""
    with pytest.raises(SlimSpecError, match="generation dtype"):
        build_teacher_data(tmp_path, [Prompt(id="a", text="hi")], TeacherSettings(generation_dtype="float64"),
                           cache_root=tmp_path / "cache", progress=False)


def test_data_options_default_to_the_machine_and_pin_when_asked(tmp_path, monkeypatch):
    """Catches ``DataOptions.generation_dtype`` dropped (the reference build pins bf16 so its caches keep the keys of
    the shipped answers) or the machine default not applied when it is unset."""
    monkeypatch.setenv(hardware.GENERATION_DTYPE_ENV, "float16")
    assert DataOptions().teacher_settings((2, 15, 27)).generation_dtype == "float16"
    assert DataOptions(generation_dtype="bfloat16").teacher_settings((2, 15, 27)).generation_dtype == "bfloat16"


def test_cli_and_batch_reach_the_teacher(tmp_path, monkeypatch):
    """Catches ``--generation-dtype`` or a manifest's ``generation_dtype`` lost before the teacher, and a batch
    fingerprint that changes for manifests that never named it (finished jobs would all run again)."""
    from slimspec.cli import main

    seen = []

    def fake_convert(job):
        seen.append(job.data_options.generation_dtype)
        raise SlimSpecError("stop here")

    monkeypatch.setattr("slimspec.workflows.convert.run_conversion", fake_convert)
    for flag, expected in (("float32", "float32"), ("auto", None)):
        result = CliRunner().invoke(main, ["convert", "some/drafter", "--generation-dtype", flag,
                                           "--distill-steps", "1", "-o", str(tmp_path / "out")])
        assert "stop here" in result.output and seen[-1] == expected

    with pytest.raises(SlimSpecError, match="stop here"):
        batch.run_job({"drafter": "d", "name": "j", "out": str(tmp_path / "j"), "generation_dtype": "bfloat16"})
    assert seen[-1] == "bfloat16"
    old = batch.job_fingerprint({"drafter": "d"})
    assert batch.job_fingerprint({"drafter": "d", "generation_dtype": "auto"}) == old
    assert batch.job_fingerprint({"drafter": "d", "generation_dtype": "float32"}) != old
