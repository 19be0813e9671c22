"""Teacher data on a CUDA GPU against the same data on the CPU (``--device``; run by ``make gpu-bench``).

    python scripts/gpu_teacher_check.py              # needs a CUDA GPU
    python scripts/gpu_teacher_check.py --cpu-smoke  # the same code, both builds on the CPU (tests this script)

Builds a tiny random Llama target (hidden 64, 4 layers) with a character-level tokenizer and a chat template, so it
needs no download, then builds the teacher data of 12 prompts (greedy 24-token answers in float32, then in bfloat16,
the GPU default) twice each through ``build_teacher_data``: once on the device and once on the CPU. Checks: each
build ran the target's answering copy (in the asked dtype) and its feature forwards on the asked device, float32
answers agree (the same tokens but after a near-tie), and the features of sequences written alike agree within 1e-3
relative. Prints a table; exit 1 on a failure.
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
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         initializer_range=0.3)  # large random weights: answers that vary, not one token repeated
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def device_from_args(doc: str, script: str) -> str:
    """The device a GPU check compares with the CPU: ``--device`` (default cuda), or the CPU with ``--cpu-smoke``
    (both runs on the CPU: tests the script itself). Exits where the device is a GPU and PyTorch sees none."""
    import torch

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cpu-smoke", action="store_true", help="both runs on the CPU (no GPU needed)")
    args = parser.parse_args()
    device = "cpu" if args.cpu_smoke else args.device
    if device != "cpu" and not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (or --cpu-smoke); nothing was checked.")
    return device


def main() -> int:
    device = device_from_args(__doc__, "gpu_teacher_check.py")

    import torch

    import slimspec.distill.teacher as teacher
    from slimspec.distill.teacher import TeacherSettings, build_teacher_data
    from slimspec.prompts import Prompt
    seen: set[str] = set()  # "features@device" / "answers@device dtype" of the target's calls in one build
    forward, answer = teacher._features, teacher._generate

    def recording_features(model, ids, aux_layers):
        seen.add(f"features@{model.device}")
        return forward(model, ids, aux_layers)

    def recording_answers(model, tokenizer, prefixes, *args, **kwargs):
        if model is not None:
            seen.add(f"answers@{model.device} {str(model.dtype).removeprefix('torch.')}")
        return answer(model, tokenizer, prefixes, *args, **kwargs)

    teacher._features, teacher._generate = recording_features, recording_answers
    prompts = [Prompt(id=str(i), text=" ".join(CHARS[(i * 7 + j) % 26] * (1 + j % 3) for j in range(5 + i % 4)))
               for i in range(12)]
    failures: list[str] = []
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        target = tiny_target(Path(tmp) / "target")
        # float32 answers must agree across devices (but for a near-tie); bfloat16 (the GPU default) may differ
        # more, so only the features of the sequences both devices wrote alike are compared there
        for dtype, most_flips in (("float32", 1), ("bfloat16", None)):
            settings = TeacherSettings(max_new_tokens=24, aux_layers=(1, 2, 3), generation_dtype=dtype,
                                       generation_batch=4)
            timings, data = [], []  # the device's build, then the CPU's
            for n, where in enumerate((device, "cpu")):
                seen.clear()
                start = time.perf_counter()
                data.append(build_teacher_data(target, prompts, settings, cache_root=Path(tmp) / f"{dtype}-{n}",
                                               progress=False, device=where))
                timings.append(time.perf_counter() - start)
                want = torch.device(where)
                want = f"cuda:{want.index or 0}" if want.type == "cuda" else "cpu"
                expected = {f"features@{want}", f"answers@{want} {dtype}"}
                if seen != expected:
                    failures.append(f"{dtype} build on {where}: the target ran as {sorted(seen)}, "
                                    f"not {sorted(expected)}")
            a, b = data
            answered = int(a.response_ids().numel())
            if answered < len(a) * 4:
                failures.append(f"{dtype}: only {answered} answer tokens in {len(a)} sequences")
            same = [i for i in range(len(a)) if torch.equal(a.sequence(i)["input_ids"], b.sequence(i)["input_ids"])]
            worst = 0.0
            for i in same:
                for key in ("aux", "final"):
                    x, y = a.sequence(i)[key].double(), b.sequence(i)[key].double()
                    worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-12)))
            if most_flips is not None and len(same) < len(a) - most_flips:
                failures.append(f"{dtype}: only {len(same)} of {len(a)} sequences identical")
            if not same:
                failures.append(f"{dtype}: no sequence written alike on both devices: features not compared")
            if worst > 1e-3:
                failures.append(f"{dtype}: features differ by {worst:.2e} (relative) > 1e-3")
            rows.append(f"| {dtype} | {len(same)} / {len(a)} | {worst:.2e} | {answered} | "
                        f"{timings[0]:.2f} / {timings[1]:.2f} |")
    print(f"teacher data on {device} vs cpu (tiny Llama, 12 prompts x 24 tokens; features from the float32 copy)")
    print("| answers in | identical sequences | worst relative feature difference | answer tokens | "
          f"build seconds ({device} / cpu) |\n|---|---|---|---|---|")
    print("\n".join(rows))
    for failure in failures:
        print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
