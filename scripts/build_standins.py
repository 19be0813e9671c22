"""Write stand-ins of real EAGLE-3 pairs: the published configs, random (seeded) weights, fewer target layers.

    .venv/bin/python scripts/build_standins.py --family llama3-8b --out out/standins/llama3-8b --target-layers 2

Families (configs as published on the Hub):

- ``llama3-8b``: Llama-3.1-8B-Instruct (hidden 4096, vocab 128,256, GQA 32/8, llama3 RoPE scaling) and
  EAGLE3-LLaMA3.1-Instruct-8B (yuhuili layout: ``pytorch_model.bin`` in fp16, 1 layer, fc 3x4096 -> 4096,
  draft vocab 32,000 with d2t/t2d).
- ``qwen3-8b``: Qwen3-8B (vocab 151,936, q/k norms, head_dim 128) and AngelSlim/Qwen3-8B_eagle3 (a Llama-style
  drafter, ``pytorch_model.bin``, draft vocab 32,000).
- ``llama3-70b-head``: the LM head of Llama-3.3-70B-Instruct (d = 8192, V = 128,256) in its own shard (the only
  weight written: a conversion without teacher data reads nothing else) and EAGLE3-LLaMA3.3-Instruct-70B's shape
  (1 layer, intermediate 28,672, draft vocab 32,000). For factorising and writing a 70B-sized head
  (``--vocab full``); it cannot make teacher data.

Targets are written as the Hub writes them: bf16 safetensors shards with ``model.safetensors.index.json``, the LM
head in its own last shard, a ``generation_config.json`` and a tokenizer folder. The tokenizer is a byte-level BPE
trained offline on the shipped calibration prompts, filled with unreachable tokens and the family's special tokens
to exactly the real tokenizer's size (128,256 for Llama 3; 151,669 for Qwen3, whose embedding is padded to 151,936
as the real one is), with the family's chat template, so token ids, template and vocabulary size agree.

Aux layers: a real drafter reads the target states entering layers {2, L//2, L-3} (L = 32 or 36), which a 2-layer
stand-in does not have. The drafter's config names ``eagle_aux_hidden_state_layer_ids: [0, L//2, L]`` (the input
convention: the embedding output, the middle and the last layer's output; [0, 1, 2] for L = 2), so any
``--target-layers`` >= 1 works and nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0",
    "use_cache": True, "vocab_size": 128256}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
              "num_hidden_layers": 80}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
EAGLE3_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 2048,
    "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1,
    "pad_token_id": 0, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "float16", "use_cache": True, "vocab_size": 128256, "draft_vocab_size": 32000}
EAGLE3_QWEN = {
    "architectures": ["Eagle3LlamaForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 151936, "draft_vocab_size": 32000, "target_model_type": "qwen3"}

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>"
    "\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>"
    "\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
FAMILIES = {
    "llama3-8b": {"target": LLAMA3_8B, "drafter": EAGLE3_LLAMA, "bpe": 128000, "specials": LLAMA3_SPECIALS,
                  "reserved": 256, "template": LLAMA3_TEMPLATE, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
    "qwen3-8b": {"target": QWEN3_8B, "drafter": EAGLE3_QWEN, "bpe": 151643, "specials": QWEN3_SPECIALS,
                 "reserved": 0, "template": CHATML_TEMPLATE, "bos": None, "eos": "<|im_end|>"},
    "llama3-70b-head": {"target": LLAMA3_70B,
                        "drafter": {**EAGLE3_LLAMA, "hidden_size": 8192, "num_attention_heads": 64,
                                    "intermediate_size": 28672},
                        "bpe": 128000, "specials": LLAMA3_SPECIALS, "reserved": 256, "template": LLAMA3_TEMPLATE,
                        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
}
STD = 0.02
SHARD_BYTES = 5 * 2**30


def calibration_texts() -> list[str]:
    """The shipped calibration prompts' turns (the tokenizer's training text)."""
    text = resources.files("slimspec").joinpath("data/calibration.jsonl").read_text(encoding="utf-8")
    return [turn for line in text.splitlines() if line.strip() for turn in json.loads(line)["turns"]]


def build_tokenizer(family: dict, folder: Path) -> tuple[int, list[int]]:
    """A byte-level BPE of exactly the family's size with its special tokens and chat template, saved to
    ``folder``; returns its size and the ids the BPE can produce (bytes and learned merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=family["bpe"], min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(calibration_texts(), trainer)
    learned = json.loads(tok.to_str())["model"]
    vocab, merges = dict(learned["vocab"]), learned["merges"]
    reachable = sorted(vocab.values())
    for i in range(len(vocab), family["bpe"]):  # unreachable fillers: real ids, never produced by the merges
        vocab[f"\u0120<unused_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                                    for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(family["specials"])
    specials += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + family["reserved"] - len(specials))]
    tok.add_special_tokens(specials)
    size = tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family["bos"], eos_token=family["eos"],
                                   pad_token=family["eos"], chat_template=family["template"])
    fast.save_pretrained(folder)
    return size, reachable


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Seeded normal weights of std 0.02, made in ``dtype`` (no float32 copy)."""
    return torch.empty(*shape, dtype=dtype).normal_(0.0, STD, generator=generator)


def target_layer(config: dict, i: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer's weights under the Hub's names."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    p = f"model.layers.{i}."
    t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
         p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
         p + "self_attn.q_proj.weight": randn(g, heads * hd, h), p + "self_attn.k_proj.weight": randn(g, kv * hd, h),
         p + "self_attn.v_proj.weight": randn(g, kv * hd, h), p + "self_attn.o_proj.weight": randn(g, h, heads * hd),
         p + "mlp.gate_proj.weight": randn(g, inter, h), p + "mlp.up_proj.weight": randn(g, inter, h),
         p + "mlp.down_proj.weight": randn(g, h, inter)}
    if config["model_type"] == "qwen3":
        t[p + "self_attn.q_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
        t[p + "self_attn.k_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
    return t


def write_target(config: dict, folder: Path, layers: int, seed: int, head_only: bool) -> None:
    """Sharded bf16 safetensors with the Hub's index; the head alone in the last shard."""
    g = torch.Generator().manual_seed(seed)
    h, vocab = config["hidden_size"], config["vocab_size"]
    groups: list[dict[str, torch.Tensor]] = []
    if not head_only:
        current = {"model.embed_tokens.weight": randn(g, vocab, h)}
        for i in range(layers):
            layer = target_layer(config, i, g)
            if sum(t.nbytes for t in current.values()) + sum(t.nbytes for t in layer.values()) > SHARD_BYTES:
                groups.append(current)
                current = {}
            current.update(layer)
        current["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        groups.append(current)
    groups.append({"lm_head.weight": randn(g, vocab, h)})
    weight_map, total = {}, 0
    for n, tensors in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def drafter_tensors(config: dict, target_hidden: int, draft_ids: torch.Tensor, vocab: int, seed: int
                    ) -> dict[str, torch.Tensor]:
    """EAGLE-3 drafter tensors under EAGLE's names, in the drafter's stored dtype."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if config["torch_dtype"] == "float16" else torch.bfloat16
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    ones = torch.ones(h, dtype=dtype)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return {
        "fc.weight": randn(g, h, 3 * target_hidden, dtype=dtype),
        "midlayer.input_layernorm.weight": ones.clone(), "midlayer.hidden_norm.weight": ones.clone(),
        "midlayer.post_attention_layernorm.weight": ones.clone(),
        "midlayer.self_attn.q_proj.weight": randn(g, heads * hd, 2 * h, dtype=dtype),
        "midlayer.self_attn.k_proj.weight": randn(g, kv * hd, 2 * h, dtype=dtype),
        "midlayer.self_attn.v_proj.weight": randn(g, kv * hd, 2 * h, dtype=dtype),
        "midlayer.self_attn.o_proj.weight": randn(g, h, heads * hd, dtype=dtype),
        "midlayer.mlp.gate_proj.weight": randn(g, inter, h, dtype=dtype),
        "midlayer.mlp.up_proj.weight": randn(g, inter, h, dtype=dtype),
        "midlayer.mlp.down_proj.weight": randn(g, h, inter, dtype=dtype),
        "norm.weight": ones.clone(),
        "lm_head.weight": randn(g, draft_ids.numel(), h, dtype=dtype),
        "d2t": draft_ids - torch.arange(draft_ids.numel()),
        "t2d": t2d,
    }


def draft_vocabulary(reachable: list[int], size: int, vocab: int, specials: range, seed: int) -> torch.Tensor:
    """``size`` target ids, sorted: every id the tokenizer produces and the special tokens first, then random
    others (a real draft vocabulary is the most frequent tokens of its training answers)."""
    chosen = set(reachable[:size]) | {i for i in specials if len(reachable) < size}
    g = torch.Generator().manual_seed(seed)
    for i in torch.randperm(vocab, generator=g).tolist():
        if len(chosen) >= size:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen)[:size], dtype=torch.long)


def build(family_name: str, out: Path, target_layers: int, seed: int, intermediate: int | None) -> dict:
    """Write ``out/target`` and ``out/drafter``; return what was written."""
    family = FAMILIES[family_name]
    head_only = family_name == "llama3-70b-head"
    tconfig = {**family["target"], "num_hidden_layers": family["target"]["num_hidden_layers"] if head_only
               else target_layers}
    dconfig = dict(family["drafter"])
    if intermediate:
        tconfig["intermediate_size"] = dconfig["intermediate_size"] = intermediate
    layers = tconfig["num_hidden_layers"]
    dconfig["eagle_aux_hidden_state_layer_ids"] = [0, layers // 2, layers]
    target, drafter = out / "target", out / "drafter"
    target.mkdir(parents=True, exist_ok=True)
    drafter.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    size, reachable = build_tokenizer(family, target)
    if size > tconfig["vocab_size"]:
        raise SystemExit(f"tokenizer of {size} tokens > vocab {tconfig['vocab_size']}")
    (target / "config.json").write_text(json.dumps(tconfig, indent=2))
    eos = tconfig["eos_token_id"]
    (target / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tconfig["bos_token_id"], "eos_token_id": eos, "do_sample": False}, indent=2))
    write_target(tconfig, target, layers, seed, head_only)
    ids = draft_vocabulary(reachable, dconfig["draft_vocab_size"], tconfig["vocab_size"],
                           range(family["bpe"], size), seed + 1)
    tensors = drafter_tensors(dconfig, tconfig["hidden_size"], ids, tconfig["vocab_size"], seed + 2)
    torch.save(tensors, drafter / "pytorch_model.bin")
    (drafter / "config.json").write_text(json.dumps(dconfig, indent=2))
    return {"family": family_name, "target": str(target), "drafter": str(drafter), "target_layers": layers,
            "tokenizer_size": size, "vocab": tconfig["vocab_size"], "hidden": tconfig["hidden_size"],
            "draft_vocab": int(ids.numel()), "aux_layer_ids": dconfig["eagle_aux_hidden_state_layer_ids"],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="writes OUT/target and OUT/drafter")
    parser.add_argument("--target-layers", type=int, default=2, help="decoder layers of the target (default 2)")
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width of target and drafter (default: the published one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(build(args.family, args.out, args.target_layers, args.seed, args.intermediate)))


if __name__ == "__main__":
    main()
