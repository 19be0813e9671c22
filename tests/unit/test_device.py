"""`--device`: where the target computes the teacher data. This machine has no GPU, so these tests check the choice
of device, the clear errors, and that the target's inputs follow the model's device (a fake model on the meta
device stands in for a GPU); scripts/gpu_teacher_check.py compares a real GPU build with a CPU one."""

import pytest
import torch

from slimspec.distill.teacher import TeacherSettings, _features, _generate, uses_static_engine
from slimspec.errors import SlimSpecError
from slimspec.hardware import default_generation_dtype, resolve_device


def test_auto_picks_a_gpu_only_when_there_is_one(monkeypatch, pretend_gpus):
    """Catches a default that ignores the GPU (hours of an 8B target on CPU cores) or needs one."""
    pretend_gpus(0)
    assert resolve_device(None) == torch.device("cpu") == resolve_device("auto")
    pretend_gpus(2)
    assert resolve_device(None) == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device(" CPU ") == torch.device("cpu")
    monkeypatch.setenv("SLIMSPEC_DEVICE", "cpu")  # what auto means where it is set; a named device wins
    assert resolve_device("auto") == torch.device("cpu") == resolve_device(None)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_unusable_devices_are_clear_errors(pretend_gpus):
    """Catches a CUDA request on a machine without one (or a GPU index past the last) failing deep in a build."""
    pretend_gpus(0)
    with pytest.raises(SlimSpecError, match="no CUDA GPU"):
        resolve_device("cuda")
    pretend_gpus(1)
    with pytest.raises(SlimSpecError, match="only 1 CUDA GPU"):
        resolve_device("cuda:1")
    for bad in ("tpu", "gpu0", "mps", "meta"):
        with pytest.raises(SlimSpecError, match="device"):
            resolve_device(bad)


def test_answers_default_to_bf16_on_a_gpu(monkeypatch, pretend_gpus):
    """Catches float32 answers on a GPU by default (bf16 is native there) and a GPU choice leaking into CPU runs."""
    monkeypatch.delenv("SLIMSPEC_GENERATION_DTYPE", raising=False)
    pretend_gpus(1)
    assert default_generation_dtype(set(), device="auto") == "bfloat16"
    assert default_generation_dtype(set(), device="cpu") == "float32"
    assert default_generation_dtype(set()) == "float32"  # no device named: the CPU's choice, as before
    pretend_gpus(0)
    assert default_generation_dtype(set(), device="auto") == "float32"
    monkeypatch.setenv("SLIMSPEC_GENERATION_DTYPE", "float16")
    pretend_gpus(1)
    assert default_generation_dtype(set(), device="auto") == "float16"


def test_static_engine_runs_on_the_cpu_only():
    """Catches the CPU-only static engine (CPU caches and masks) being run with a model on a GPU."""
    static = TeacherSettings(engine="static")
    assert uses_static_engine(static, torch.device("cpu"))
    assert not uses_static_engine(static, torch.device("cuda"))
    assert not uses_static_engine(TeacherSettings(engine="static", responses="reference"), torch.device("cpu"))
    assert not uses_static_engine(TeacherSettings(), torch.device("cpu"))


class _FakeTarget:
    """Stands in for a target on an accelerator: its inputs must be on its device; it answers with CPU tensors
    (as .cpu() of device tensors would be) so the callers' results can be checked."""

    device = torch.device("meta")

    def __init__(self, hidden: int = 3, layers: int = 4):
        self.hidden, self.layers, self.seen = hidden, layers, []
        self.base_model = self._forward

    def _forward(self, input_ids, output_hidden_states, use_cache):
        self.seen.append(input_ids.device)
        t = input_ids.shape[1]
        states = tuple(torch.full((1, t, self.hidden), float(i)) for i in range(self.layers + 1))
        return type("Out", (), {"hidden_states": states})()

    def generate(self, input_ids, attention_mask, **kwargs):
        self.seen += [input_ids.device, attention_mask.device]
        b, width = input_ids.shape
        return torch.cat([torch.zeros(b, width, dtype=torch.long), torch.tensor([[5, 6, 2, 0]] * b)], dim=1)


class _Tokenizer:
    pad_token_id, eos_token_id = 0, 2


def test_target_inputs_follow_the_model_device():
    """Catches CPU input ids handed to a target on a GPU (a device-mismatch crash on the first forward) and device
    tensors leaking into the CPU-side teacher data."""
    model = _FakeTarget()
    aux, final = _features(model, [1, 2, 3], (1, 3))
    assert model.seen == [torch.device("meta")]
    assert aux.shape == (3, 6) and torch.equal(final, torch.full((3, 3), 4.0))
    model.seen.clear()
    answers = _generate(model, _Tokenizer(), [[1, 7], [1, 8, 9]], TeacherSettings(max_new_tokens=4),
                        lambda n, tokens: None)
    assert set(model.seen) == {torch.device("meta")}
    assert answers == [[5, 6, 2], [5, 6, 2]]  # cut at the eos, as on the CPU


def test_distributed_distillation_refuses_a_gpu(monkeypatch):
    """Catches a torchrun run sent to a GPU: its gradient reduction and teacher tables are CPU-only (gloo, host
    memory); it must stop with a clear error before any work, not crash in the first all-reduce."""
    import slimspec.distill.train as train

    monkeypatch.setattr(train, "_world", lambda: (0, 2))
    drafter = torch.nn.Module()
    drafter.fc = torch.nn.Linear(2, 2)
    with pytest.raises(SlimSpecError, match="distributed distillation .* runs on the CPU"):
        train.train_drafter(drafter, None, torch.zeros(3, 2), train.DistillConfig(), device="cuda")


def test_teacher_table_budget_on_a_gpu_is_its_free_memory(monkeypatch):
    """Catches a GPU run whose teacher table is sized by the host's RAM (a table larger than the GPU's free memory:
    out of memory after the features were computed) or ignores $SLIMSPEC_TEACHER_TABLE_BYTES."""
    from slimspec.distill.teacher_table import table_budget

    monkeypatch.delenv("SLIMSPEC_TEACHER_TABLE_BYTES", raising=False)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (3_000_000, 80_000_000))
    assert table_budget("cuda:1") == 1_000_000 and asked == [torch.device("cuda", 1)]
    assert table_budget(torch.device("cpu")) != 1_000_000  # the host's memory
    monkeypatch.setenv("SLIMSPEC_TEACHER_TABLE_BYTES", "5e6")
    assert table_budget("cuda") == 5_000_000


def test_teacher_rows_follow_the_student_device():
    """Catches the target's states (a CPU cache) handed to a head on a GPU, or GPU row indices used on the CPU
    cache: both device-mismatch crashes in the first step of a GPU distillation (the meta device stands in)."""
    from types import SimpleNamespace

    from slimspec.distill.train import teacher_hidden

    cache = SimpleNamespace(final=torch.arange(40, dtype=torch.float16).reshape(10, 4))
    hidden = torch.empty(3, 4, device="meta")
    rows = teacher_hidden(hidden, torch.tensor([1, 5, 9]), cache, "target")
    assert rows.device == torch.device("meta") and rows.dtype == torch.float32 and rows.shape == (3, 4)
    cpu_rows = teacher_hidden(torch.zeros(3, 4), torch.tensor([1, 5, 9]), cache, "target")
    assert torch.equal(cpu_rows, cache.final[[1, 5, 9]].float())
    # the drafter teacher: [h, 1] of the student's own rows, where they are
    own = teacher_hidden(hidden, torch.tensor([1, 5, 9], device="meta"), cache, "drafter")
    assert own.device == torch.device("meta") and own.shape == (3, 5)


class _Loaded:
    """What a patched ``from_pretrained`` hands back: records ``.to`` calls."""

    def __init__(self):
        self.moves = []

    def eval(self):
        return self

    def to(self, device):
        self.moves.append(device)
        return self


def test_target_loads_straight_onto_the_gpu(monkeypatch, tmp_path):
    """Catches a GPU load that materialises the whole target on the host first (an 8B float32 target: 32 GB of host
    memory on the way to the GPU) where accelerate could place the weights directly, and a load without accelerate
    that forgets to move the model (the target then runs on CPU cores)."""
    import importlib.util

    import transformers

    import slimspec.distill.teacher as teacher

    calls = []

    def loading(path, **kwargs):
        calls.append(kwargs)
        return _Loaded()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: "tokenizer")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    model, tokenizer = teacher.load_target_model(tmp_path, torch.bfloat16, "cuda")
    assert calls[-1] == {"dtype": torch.bfloat16, "device_map": {"": torch.device("cuda", 0)}}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name))
    model, _ = teacher.load_target_model(tmp_path, torch.float32, "cuda:1")
    assert calls[-1] == {"dtype": torch.float32} and model.moves == [torch.device("cuda", 1)]
    model, _ = teacher.load_target_model(tmp_path, torch.float32)
    assert calls[-1] == {"dtype": torch.float32} and model.moves == []  # the CPU: no device_map, no move


def test_full_head_factors_sit_on_the_head_device():
    """Catches the identity `down` factor of a full head built on the CPU beside a head on a GPU: the first KL of
    `distill --from-scratch` (full head) or of distilling a plain EAGLE-3 drafter crashed with a device mismatch."""
    from types import SimpleNamespace

    from slimspec.distill.train import head_factors
    from slimspec.model import FullHead

    down, up = head_factors(SimpleNamespace(lm_head=FullHead(torch.empty(10, 4, device="meta"))))
    assert down.device == up.device == torch.device("meta") and down.shape == (4, 4)
    down, up = head_factors(SimpleNamespace(lm_head=FullHead(torch.randn(10, 4))))
    assert torch.equal(down, torch.eye(4)) and up.shape == (10, 4)
