"""The static-cache decoding loop against transformers' own ``generate`` and full forwards (float32 references)."""

import pytest
import torch

from slimspec.checkpoint.target_model import chat_ids, load_target_model
from slimspec.distill.static_decode import static_decode, supports
from slimspec.distill.teacher import TeacherSettings, build_teacher_data
from slimspec.prompts import Prompt

pytestmark = pytest.mark.slow
PROMPTS = ["Say hi.", "Count to three, slowly please, and then stop.", "Why is the sky blue? Answer briefly.", "Go"]


def _reference(model, prefix: list[int], new: int, eos: int, layers: tuple[int, ...]):
    """transformers' greedy answer (batch 1, no padding) and the features of prefix + answer from one forward."""
    ids = torch.tensor([prefix])
    answer = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                            pad_token_id=eos)[0, len(prefix):].tolist()
    if eos in answer:
        answer = answer[: answer.index(eos) + 1]
    out = model(input_ids=torch.tensor([prefix + answer]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
    return answer, aux, out.hidden_states[-1][0]


def _qwen3_target(folder, tokenizer):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, rope_scaling={"rope_type": "linear", "factor": 2.0})
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_static_decode_matches_generate_and_forward(arch, tiny_target, tmp_path):
    """Catches left-padding leaking into attention or RoPE positions (rows of a batch would answer differently
    than alone), a cache slot off by one, features taken at the wrong layer or before the final norm, the last
    answer token left without features, and (Qwen3) a skipped q/k norm or the model's RoPE scaling ignored."""
    target = tiny_target if arch == "llama" else _qwen3_target(tmp_path / "qwen3", load_target_model(tiny_target)[1])
    model, tokenizer = load_target_model(target)
    assert supports(model)
    layers = (1, 2, model.config.num_hidden_layers)
    prefixes = [chat_ids(tokenizer, p)[0] for p in PROMPTS]
    eos = tokenizer.eos_token_id
    results = static_decode(model, prefixes, 20, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                            capture=layers)
    for prefix, res in zip(prefixes, results, strict=True):
        answer, aux, final = _reference(model, prefix, 20, eos, layers)
        assert res.response == answer
        assert res.aux.shape == aux.shape and res.final.shape == final.shape
        torch.testing.assert_close(res.aux, aux, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(res.final, final, atol=1e-4, rtol=1e-4)


class _ScriptedHead(torch.nn.Module):
    """Row r answers token 100 + r until step r, then eos (a stand-in LM head with a step counter)."""

    def __init__(self, vocab: int, eos: int) -> None:
        super().__init__()
        self.vocab, self.eos, self.step = vocab, eos, 0

    def forward(self, h):
        rows = torch.arange(h.shape[0])
        token = torch.where(rows == self.step, self.eos, 100 + rows)
        self.step += 1
        return torch.nn.functional.one_hot(token, self.vocab).to(h.dtype)


def test_static_decode_stops_each_row_at_its_eos(tiny_target):
    """Catches rows that run on after their own eos (tokens or pads inside an answer), a batch that stops when
    the first row does, and features missing for the eos token itself."""
    model, tokenizer = load_target_model(tiny_target)
    prefixes = [chat_ids(tokenizer, p)[0] for p in PROMPTS]
    eos = tokenizer.eos_token_id
    head = _ScriptedHead(model.config.vocab_size, eos)
    model.get_output_embeddings = lambda: head
    results = static_decode(model, prefixes, 3, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
                            capture=(1,))
    expected = [[eos], [101, eos], [102, 102, eos], [103, 103, 103]]  # row 3 hits max_new_tokens first
    assert [r.response for r in results] == expected
    for prefix, res in zip(prefixes, results, strict=True):
        assert res.aux.shape[0] == res.final.shape[0] == len(prefix) + len(res.response)


def test_sampling_follows_the_generator(tiny_target):
    """Catches sampling that ignores the seeded generator (two runs must agree) or silently decodes greedily."""
    model, tokenizer = load_target_model(tiny_target)
    prefixes = [chat_ids(tokenizer, p)[0] for p in PROMPTS]
    kw = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    runs = [static_decode(model, prefixes, 12, temperature=1.0, generator=torch.Generator().manual_seed(7), **kw)
            for _ in range(2)]
    assert [r.response for r in runs[0]] == [r.response for r in runs[1]]
    greedy = static_decode(model, prefixes, 12, **kw)
    assert [r.response for r in greedy] != [r.response for r in runs[0]]


def test_static_engine_teacher_data(tiny_target, tmp_path, monkeypatch):
    """Catches the static engine storing features unlike the float32 engine's (same answers at float32
    generation), sequences out of prompt order, a cache key shared with the other engine, and a kill that
    loses finished batches (the rerun must decode only the rest)."""
    import slimspec.distill.static_decode as sd

    prompts = [Prompt(str(i), p) for i, p in enumerate(PROMPTS * 2)]
    common = {"max_new_tokens": 10, "aux_layers": (1, 2, 3), "generation_batch": 3, "generation_dtype": "float32"}
    plain = build_teacher_data(tiny_target, prompts, TeacherSettings(**common), cache_root=tmp_path / "a",
                               progress=False)
    calls = []
    real = sd.static_decode

    def dies_on_third(*args, **kwargs):
        calls.append(len(args[1]))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sd, "static_decode", dies_on_third)
    static = TeacherSettings(**common, engine="static")
    with pytest.raises(KeyboardInterrupt):
        build_teacher_data(tiny_target, prompts, static, cache_root=tmp_path / "a", progress=False)
    calls.clear()
    data = build_teacher_data(tiny_target, prompts, static, cache_root=tmp_path / "a", progress=False)
    assert calls == [2]  # 8 prompts in batches of 3: two finished before the kill, 2 prompts left
    leftovers = [p.name for p in (tmp_path / "a").glob(".*") if not p.name.endswith(".lock")]  # locks stay
    assert data.folder != plain.folder and not leftovers
    assert torch.equal(data.starts, plain.starts) and torch.equal(data.input_ids, plain.input_ids)
    assert torch.equal(data.loss_mask, plain.loss_mask)
    # both stored as bf16 (one rounding each) from float32 forwards that differ in summation order only
    torch.testing.assert_close(data.aux.float(), plain.aux.float(), atol=1e-3, rtol=8e-3)
    torch.testing.assert_close(data.final.float(), plain.final.float(), atol=1e-3, rtol=8e-3)


def test_cli_generation_engine_reaches_the_teacher(tiny_converted, tiny_target, tmp_path, monkeypatch):
    """Catches `--generation-engine static` dropped on the way from the CLI to the teacher data (the cache
    manifest records the engine that built it), and an unknown engine accepted silently."""
    import json

    from click.testing import CliRunner

    from slimspec.cli import main

    monkeypatch.setenv("SLIMSPEC_TEACHER_CACHE", str(tmp_path / "cache"))
    args = ["distill", str(tiny_converted), "-t", str(tiny_target), "--steps", "2", "--num-prompts", "3",
            "--max-new-tokens", "6", "--batch-tokens", "32", "-q", "--generation-engine", "static"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*/manifest.json")]
    assert [m["settings"]["engine"] for m in manifests] == ["static"]
    with pytest.raises(Exception, match="generation engine must be"):
        build_teacher_data(tiny_target, [Prompt("a", "hi")], TeacherSettings(engine="fast"), cache_root=tmp_path)


def test_batch_fingerprints_without_an_engine_are_unchanged():
    """Catches a new job key that changes every existing job's fingerprint (finished outputs would all rerun)."""
    from slimspec.workflows.batch import job_fingerprint

    job = {"drafter": "d", "target": "t", "rank": "d/8"}
    assert job_fingerprint(job) == job_fingerprint({**job, "generation_engine": "transformers"})
    assert job_fingerprint(job) != job_fingerprint({**job, "generation_engine": "static"})


def test_supports_only_what_it_models():
    """Catches the static loop taken for architectures it does not model (other layer layouts, or a sliding
    window shorter than the sequences): those must fall back to ``generate``."""
    from types import SimpleNamespace as NS

    base = NS(embed_tokens=1, layers=[], norm=1, rotary_emb=1)

    def model(**cfg):
        return NS(config=NS(**cfg), base_model=base)

    assert supports(model(model_type="llama"), 4096)
    assert not supports(model(model_type="gpt2"), 16)
    assert not supports(model(model_type="mistral", sliding_window=64), 100)
    assert supports(model(model_type="mistral", sliding_window=4096), 100)
    assert supports(model(model_type="qwen2", sliding_window=64, use_sliding_window=False), 100)
    assert not supports(NS(config=NS(model_type="llama"), base_model=NS(layers=[])), 16)


def test_both_engines_stop_at_every_eos_of_the_generation_config(tiny_target, tmp_path):
    """Catches the static engine stopping only at the tokenizer's eos while transformers' generate also stops at
    the generation config's other eos ids (Llama 3.1 Instruct lists three): the two engines' teacher answers
    would differ, and answers would run past an end-of-turn token."""
    import json
    import shutil

    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    model, tokenizer = load_target_model(target)
    prefix = chat_ids(tokenizer, PROMPTS[1])[0]
    answer = static_decode(model, [prefix], 10, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id)[0].response
    extra = answer[3]  # a token the target's greedy answer produces: make it an end-of-turn token
    assert tokenizer.eos_token_id not in answer[:4]
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config,
                                                               "eos_token_id": [tokenizer.eos_token_id, extra]}))
    prompts = [Prompt("0", PROMPTS[1])]
    common = {"max_new_tokens": 10, "aux_layers": (1, 2, 3), "generation_dtype": "float32"}
    datas = [build_teacher_data(target, prompts, TeacherSettings(**common, engine=engine), cache_root=tmp_path / engine,
                                progress=False) for engine in ("transformers", "static")]
    for data in datas:
        assert data.input_ids.tolist() == prefix + answer[: answer.index(extra) + 1]
