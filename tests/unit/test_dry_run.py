"""The arithmetic of ``convert --dry-run`` (``workflows.memory``) against numbers worked out by hand at
Llama-3.1-8B's shapes, and the config-only reading of every drafter layout (``workflows.plan``).

Shapes: d = Ht = 4096, V = 128256 (target), Vd = 32000 (yuhuili's draft vocabulary), r = 512 (d/8), 32 layers,
8 key/value heads of 128, intermediate 14336, untied head: 8,030,261,248 parameters."""

import pytest

from slimspec import hardware
from slimspec.checkpoint.drafter import load_drafter
from slimspec.workflows import memory, plan
from tests.layouts import Spec, write_drafter

D, V, VD, R = 4096, 128256, 32000, 512
P_8B = 8_030_261_248


def test_head_parameters_and_flops_at_llama_8b():
    """Catches a head size or FLOP count built from the wrong vocabulary or a missing factor (V*d against
    r*(V+d); FLOPs count a multiply and an add per weight)."""
    assert memory.head_params(V, D) == 525_336_576
    assert memory.pair_params(V, D, R) == 67_764_224
    assert memory.head_params(VD, D) == 131_072_000
    assert memory.pair_params(VD, D, R) == 18_481_152
    assert memory.head_flops(V, D) == 1_050_673_152
    assert memory.pair_flops(V, D, R) == 135_528_448


def test_conversion_stage_memory_at_llama_8b():
    """Catches a stage formula that forgets what earlier stages leave in memory, or counts a tensor at the wrong
    width: the process 256 MiB, head 2.10 GB (+ 4096 of the drafter's rows as float32 at a time while stitched,
    67 MB, not all 32,000 of them),
    + Gram 134 MB and, beside it, the larger of two more float64 d x d and a float64 16,384-row chunk (537 MB),
    + factors 271 MB and the larger of the eigensolver's copy (134 MB) and the error's 16,384-row chunk in float32,
    float64 and squared (1.34 GB); verifying reads the written folder back beside the output tensors and makes
    both pairs float32."""
    runtime = 268_435_456
    assert memory.RUNTIME_BYTES == runtime
    assert memory.head_read_bytes(V, D, 0) == runtime + 2_101_346_304
    assert memory.head_read_bytes(V, D, 1000) == runtime + 2_101_347_304
    assert memory.head_read_bytes(V, D, 0, stitched_rows=VD) == runtime + 2_101_346_304 + 67_108_864
    assert memory.head_read_bytes(V, D, 0, stitched_rows=1000) == runtime + 2_101_346_304 + 16_384_000
    assert memory.gram_bytes(V, D, 0) == runtime + 2_101_346_304 + 134_217_728 + 536_870_912
    # 1000 rows: the chunk (32.8 MB) is smaller than the triangle's two d x d (268 MB)
    assert memory.gram_bytes(1000, D, 0) == runtime + 16_384_000 + 134_217_728 + 268_435_456
    assert memory.factorize_bytes(V, D, R, 0) == runtime + 2_506_620_928
    assert memory.eigensolver_bytes(D) == 134_217_728
    assert memory.error_bytes(V, D) == 1_342_177_280 and memory.error_bytes(1000, D) == 81_920_000
    assert memory.factorize_stage_bytes(V, D, R, 0) == runtime + 2_506_620_928 + 1_342_177_280
    # bf16 output: the pair (67,764,224 weights x 2) beside 10 bytes of other tensors and the held 2.5 GB
    assert memory.write_bytes(2_506_620_928, V, D, R, 2, 10) == 2_506_620_928 + 2 * (10 + 135_528_448)
    assert memory.verify_bytes(3_000_000_000, V, D, R, 2, 10) == 3_000_000_000 + 2 * (10 + 135_528_448) + \
        2 * 271_056_896


def test_teacher_data_memory_at_llama_8b():
    """Catches the target's copies added instead of taken one at a time (transformers engine), a key/value cache
    without its factor 2 (keys and values), and cache rows of the wrong width (3 aux states + the final state in
    bfloat16, plus 9 bytes of id and mask per token)."""
    features = memory.feature_pass_bytes(P_8B, 32, D, 1024)
    assert features == 32_674_693_120  # 32.1 GB of float32 weights + 33 hidden states of 1024 x 4096
    answering = memory.answering_bytes(P_8B, 2, 32, 8 * 128, 64, 1024, V)
    assert answering == 24_683_290_624  # 16.1 GB of bf16 weights + 8.6 GB cache + 33 MB of logits
    assert memory.teacher_target_bytes(features, answering, regenerate=True, static=False) == 32_674_693_120
    assert memory.teacher_target_bytes(features, answering, regenerate=False, static=False) == features
    assert memory.teacher_target_bytes(features, answering, regenerate=True, static=True, batch=1, tokens=2,
                                       states=3) == answering + 24
    assert memory.teacher_cache_bytes(1000, D, 3, 2) == 32_777_000
    assert memory.target_parts_bytes(V, D) == 4_202_692_608
    assert memory.target_parts_load_bytes(V, D, 2) == 2_101_346_304  # bf16 head and embedding while read
    assert memory.tokenizer_bytes(V) == 262_668_288
    assert memory.teacher_tokens(300, 84, 128, 1024) == 63_600
    assert memory.teacher_tokens(2, 1000, 128, 1024) == 2048


def test_distillation_memory_at_llama_8b():
    """Catches a teacher table or feature store sized without the TTT steps, a KL buffer not capped at 256 MiB, a
    step that forgets the pair's gradient and Adam moments, a teacher head of the wrong width (Ht for the target,
    d + 1 for the drafter), the distillation's checksum block of it (4096 rows in float64, and in float32 too
    from a GPU; not a float64 copy of the whole head, 4.2 GB), and the whitened solve's five float64 d x d
    beside the larger of two more and the up factor in float32 and float64."""
    assert memory.teacher_table_bytes(10_000, 3, V, 4) == 15_390_720_000
    assert memory.teacher_table_bytes(10_000, 3, V, 0) == 0
    assert memory.student_feature_bytes(10_000, 3, D) == 491_880_000
    assert memory.covariance_bytes(0, D) == 134_217_728
    # 6144 rows: states 100.7 MB, KL buffers 256 MiB, pair + gradient + Adam 1.08 GB
    assert memory.distill_step_bytes(2048, 3, D, V, R, 0) == 1_453_400_064
    assert memory.distill_step_bytes(2048, 3, D, V, R, 2) == 1_453_400_064 + 6144 * V * 2
    assert memory.teacher_head_bytes(V, D) == 2_101_346_304
    assert memory.teacher_head_bytes(VD, D + 1) == 524_416_000
    assert memory.run_identity_bytes(V, D) == 134_217_728
    assert memory.run_identity_bytes(V, D, from_device=True) == 201_326_592
    assert memory.run_identity_bytes(1000, D + 1) == 32_776_000  # fewer rows than a block
    assert memory.whitened_bytes(V, D, R) == 671_088_640 + 788_004_864
    assert memory.whitened_bytes(VD, D, R) == 671_088_640 + 268_435_456


def test_dense_parameter_count_of_llama_8b():
    """Catches a config-based count that misses the untied head or the grouped key/value projections: Llama-3.1-8B
    has 8,030,261,248 parameters."""
    assert memory.dense_params(V, D, 32, 32, 8, 128, 14336, tied=False) == P_8B
    # SmolLM2-135M (the embedded target): tied, 9 heads, 3 key/value heads of 64, 30 layers
    assert memory.dense_params(49152, 576, 30, 9, 3, 64, 1536, tied=True) == 134_515_008


@pytest.mark.parametrize("layout", ["eagle", "specforge", "speculators", "modelopt", "angelslim"])
def test_config_only_shapes_match_the_loader(tmp_path, layout):
    """Catches the plan reading a layout's config where the loader does not (speculators nests the layer, ModelOpt
    shards its weights): hidden size, both vocabularies and the head agree with ``load_drafter``'s."""
    spec = Spec(hidden=32, target_hidden=48, vocab=301, draft_vocab=97)
    write_drafter(tmp_path / "d", layout, spec)
    shape = plan.drafter_shape(plan.local_facts("d", tmp_path / "d", "local"))
    cfg = load_drafter(tmp_path / "d").config
    assert (shape.hidden, shape.vocab, shape.draft_vocab) == (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size)
    assert shape.has_head and shape.aux_states == cfg.num_aux_hidden_states
    assert shape.target_hidden in (None, cfg.target_hidden_size)  # a .bin without target_hidden_size tells none


def test_a_drafter_sharing_the_targets_head_is_seen_from_its_index(tmp_path):
    """Catches a plan that takes a ModelOpt drafter without lm_head (gpt-oss: draft_vocab_size null) for one with a
    head of its own, and so would not plan reading the target's."""
    write_drafter(tmp_path / "d", "modelopt", Spec(no_head=True, draft_vocab=None))
    shape = plan.drafter_shape(plan.local_facts("d", tmp_path / "d", "local"))
    assert not shape.has_head and shape.draft_vocab == 301


def test_free_memory_reads_memavailable(tmp_path):
    """Catches a free-memory reader that reports total or free memory instead of the available (page cache
    counts as available), or 0 (every plan refused)."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemFree:  5 kB\nMemAvailable:  42 kB\n")
    assert hardware.host_available(meminfo) == 42 * 1024
    assert hardware.host_available(tmp_path / "missing") > 0  # elsewhere: the free pages
    assert plan.free_memory("cpu") > 0
