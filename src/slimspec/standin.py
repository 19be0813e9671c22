"""A stand-in EAGLE-3 drafter for a target: real EAGLE (yuhuili) layout, untrained backbone.

Until the trained reference drafter exists, the demo converts this one. Its head is the target's
head restricted to the draft vocabulary (the tokens most frequent in the shipped calibration prompts),
so the head has a realistic spectrum; the decoder layer is randomly initialised and predicts nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from pathlib import Path

import torch

from slimspec.checkpoint.target import load_target_head
from slimspec.checkpoint.writer import atomic_folder


def calibration_prompts() -> list[dict]:
    """The prompts shipped in ``slimspec/data/calibration.jsonl``."""
    text = resources.files("slimspec").joinpath("data/calibration.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def frequent_tokens(target_folder: Path, count: int) -> torch.Tensor:
    """The ``count`` target token ids most frequent in the chat-formatted calibration prompts, sorted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_folder)
    counts: Counter[int] = Counter()
    for row in calibration_prompts():
        messages = [{"role": "user", "content": row["turns"][0]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        counts.update(int(i) for i in ids)
    vocab = load_target_head(target_folder).vocab_size
    ranked = sorted(range(vocab), key=lambda i: (-counts.get(i, 0), i))
    return torch.tensor(sorted(ranked[:count]), dtype=torch.long)


def build_standin_drafter(target_folder: Path, out: Path, *, draft_vocab: int = 8192, seed: int = 0) -> Path:
    """Write an EAGLE-layout drafter (fp16 ``pytorch_model.bin``, trimmed vocab with d2t/t2d) for a target."""
    target_folder = Path(target_folder)
    config = json.loads((target_folder / "config.json").read_text())
    head = load_target_head(target_folder)
    h, vocab = head.hidden_size, head.vocab_size
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads", heads))
    hd = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    ids = frequent_tokens(target_folder, draft_vocab)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).half()

    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rnd(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h).half(),
        "midlayer.hidden_norm.weight": torch.ones(h).half(),
        "midlayer.post_attention_layernorm.weight": torch.ones(h).half(),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": torch.ones(h).half(),
        "lm_head.weight": head.weight[ids].half().clone(),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    drafter_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": float(config.get("rms_norm_eps", 1e-5)),
        "rope_theta": float(config.get("rope_theta", 10000.0)),
        "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "torch_dtype": "float16",
        "tie_word_embeddings": False,
    }
    with atomic_folder(Path(out), overwrite=True) as tmp:
        torch.save(tensors, tmp / "pytorch_model.bin")
        (tmp / "config.json").write_text(json.dumps(drafter_config, indent=2) + "\n")
        (tmp / "README.md").write_text(
            "# Stand-in EAGLE-3 drafter (untrained)\n\nEAGLE layout, draft vocabulary of the "
            f"{draft_vocab} tokens most frequent in slimspec's calibration prompts; head rows copied from "
            "the target's head, decoder layer randomly initialised. For demos and tests of conversion only.\n")
    return Path(out)
