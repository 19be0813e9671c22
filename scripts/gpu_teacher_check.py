"""Teacher data on a CUDA GPU against the same data on the CPU (``--device``; run by ``make gpu-bench``).

    python scripts/gpu_teacher_check.py              # needs a CUDA GPU
    python scripts/gpu_teacher_check.py --cpu-smoke  # the same code, both builds on the CPU (tests this script)

Builds a tiny random Llama target (hidden 64, 4 layers) with a character-level tokenizer and a chat template, so it
needs no download, then builds the teacher data of 12 prompts (greedy 24-token answers, float32) twice through
``build_teacher_data``: once on the device and once on the CPU. Checks: the device build ran on the device (the
target's forward saw CUDA tensors), the answers agree (greedy float32: the same tokens except after a near-tie), and
the features of sequences with the same tokens agree within 1e-3 relative. Prints a table; exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CHARS = "abcdefghijklmnopqrstuvwxyz .,?!"
SPECIALS = ["<pad>", "<s>", "</s>", "<user>", "<assistant>"]
TEMPLATE = ("{% for m in messages %}{{ '<user>' if m['role'] == 'user' else '<assistant>' }}{{ m['content'] }}"
            "{% if m['role'] != 'user' %}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>"
            "{% endif %}")


def tiny_target(folder: Path) -> Path:
    """A random Llama target with a character tokenizer (no download), saved as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        additional_special_tokens=["<user>", "<assistant>"])
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cpu-smoke", action="store_true", help="both builds on the CPU (no GPU needed)")
    args = parser.parse_args()

    import torch

    import slimspec.distill.teacher as teacher
    from slimspec.distill.prompts import Prompt
    from slimspec.distill.teacher import TeacherSettings, build_teacher_data

    device = "cpu" if args.cpu_smoke else args.device
    if device != "cpu" and not torch.cuda.is_available():
        sys.exit("gpu_teacher_check.py needs a CUDA GPU (or --cpu-smoke); nothing was checked.")
    seen: set[str] = set()
    forward = teacher._features

    def recording(model, ids, aux_layers):  # which device the target's feature forwards ran on
        seen.add(str(model.device))
        return forward(model, ids, aux_layers)

    teacher._features = recording
    prompts = [Prompt(id=str(i), text=" ".join(CHARS[(i * 7 + j) % 26] * (1 + j % 3) for j in range(5 + i % 4)))
               for i in range(12)]
    settings = TeacherSettings(max_new_tokens=24, aux_layers=(1, 2, 3), generation_dtype="float32",
                               generation_batch=4)
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        target = tiny_target(Path(tmp) / "target")
        timings, data = [], []  # the device's build, then the CPU's
        for n, where in enumerate((device, "cpu")):
            seen.clear()
            start = time.perf_counter()
            data.append(build_teacher_data(target, prompts, settings, cache_root=Path(tmp) / f"cache-{n}",
                                             progress=False, device=where))
            timings.append(time.perf_counter() - start)
            want = torch.device(where)
            want = f"cuda:{want.index or 0}" if want.type == "cuda" else "cpu"
            if sorted(seen) != [want]:
                failures.append(f"build on {where}: feature forwards ran on {sorted(seen)}, not {want}")
        a, b = data
        answered = int(a.response_ids().numel())
        if answered < len(a) * 4:
            failures.append(f"answers: only {answered} answer tokens in {len(a)} sequences")
        same = [i for i in range(len(a)) if torch.equal(a.sequence(i)["input_ids"], b.sequence(i)["input_ids"])]
        worst = 0.0
        for i in same:
            for key in ("aux", "final"):
                x, y = a.sequence(i)[key].double(), b.sequence(i)[key].double()
                worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-12)))
        if len(same) < len(a) - 1:  # greedy float32 answers: at most one near-tie flip among 12
            failures.append(f"answers: only {len(same)} of {len(a)} sequences identical")
        if worst > 1e-3:
            failures.append(f"features: relative difference {worst:.2e} > 1e-3")
    print(f"teacher data on {device} vs cpu (tiny Llama, 12 prompts x 24 tokens, float32)")
    print("| check | value |\n|---|---|")
    print(f"| identical sequences | {len(same)} / {len(a)} |")
    print(f"| worst relative feature difference | {worst:.2e} |")
    print(f"| answer tokens ({device} build) | {answered} |")
    print(f"| build seconds ({device} / cpu) | {timings[0]:.2f} / {timings[1]:.2f} |")
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
