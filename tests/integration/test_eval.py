"""Reference speculative decoding: lossless at T=0 (token-identical) and in distribution at T>0."""

import json

import pytest
import torch
from click.testing import CliRunner

from slimspec.checkpoint import load_drafter
from slimspec.cli import main
from slimspec.evaluate.spec_decode import SpeculativeDecoder
from slimspec.model import Eagle3Drafter
from tests.layouts import Spec, write_drafter

pytestmark = pytest.mark.slow


def _tiny_llama(vocab: int, scale: float, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def _tiny_drafter(tmp_path, vocab: int, draft_vocab: int, seed: int = 3) -> Eagle3Drafter:
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=vocab, draft_vocab=draft_vocab, seed=seed))
    ckpt = load_drafter(tmp_path / "d")
    with torch.no_grad():
        ckpt.tensors["lm_head.weight"].mul_(20)
    return Eagle3Drafter.from_checkpoint(ckpt, embed_weight=torch.randn(vocab, 32))


def test_greedy_is_token_identical_to_target(tiny_target, tmp_path):
    """Catches any cache/position bookkeeping error: greedy speculative output must equal target.generate."""
    from slimspec.checkpoint.target_model import load_target_model

    target, _ = load_target_model(tiny_target)
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=target.config.vocab_size, draft_vocab=512))
    drafter = Eagle3Drafter.from_checkpoint(load_drafter(tmp_path / "d"),
                                            embed_weight=target.model.embed_tokens.weight.detach())
    for k in (1, 3):
        decoder = SpeculativeDecoder(target, drafter, (1, 2, 3), draft_tokens=k, eos_token_id=-1)
        for prompt in ([1, 9690, 198, 2683], [5, 6, 7, 8, 9, 10, 11]):
            out, stats = decoder.generate(prompt, 25)
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            assert out == ref
            assert stats.new_tokens == 25 and stats.rounds >= 25 // (k + 1)
            # every round commits accepted + 1 tokens; only the last can be cut short by max_new_tokens (by <= k)
            gap = stats.tau - (stats.new_tokens - 1) / stats.rounds
            assert -1e-9 <= gap <= k / stats.rounds + 1e-9, (gap, stats)


def test_parallel_drafter_is_lossless_and_drafts_in_one_pass(tiny_target, tmp_path, monkeypatch):
    """Catches a P-EAGLE drafter decoded as a chain (or with masked slots at the wrong positions, with the wrong
    token or hidden state, or left in the drafter's cache for the next round): every round's K drafts must be the
    argmaxes of ONE causal pass over the real positions and K-1 masked slots (vLLM's parallel_drafting), and the
    greedy output must still equal the target's."""
    from slimspec.checkpoint.target_model import load_target_model

    target, _ = load_target_model(tiny_target)
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=target.config.vocab_size, draft_vocab=512, parallel_token=11))
    drafter = Eagle3Drafter.from_checkpoint(load_drafter(tmp_path / "d"),
                                            embed_weight=target.model.embed_tokens.weight.detach())
    assert drafter.is_parallel
    k, prompt = 3, [1, 9690, 198, 2683]
    seen = []
    verify = SpeculativeDecoder._verify
    monkeypatch.setattr(SpeculativeDecoder, "_verify", lambda self, d, logits: seen.append(d) or verify(
        self, d, logits))
    decoder = SpeculativeDecoder(target, drafter, (1, 2, 3), draft_tokens=k, eos_token_id=-1)
    out, stats = decoder.generate(prompt, 25)
    ref = target.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref and stats.rounds == len(seen) >= 25 // (k + 1)
    with torch.no_grad():  # the drafts of every round, from scratch: committed tokens, then the slots
        hidden_states = target(torch.tensor([prompt + out]), output_hidden_states=True).hidden_states
        features = drafter.combine(torch.cat([hidden_states[i] for i in (1, 2, 3)], dim=-1))
        slot = drafter.combine(drafter.mask_hidden)[None].expand(1, k - 1, -1)
        m = len(prompt)
        for drafts in seen:
            tokens = torch.tensor([(prompt + out)[1:m + 1] + [11] * (k - 1)])
            h, _ = drafter(tokens, torch.cat([features[:, :m], slot], dim=1))
            expected = drafter.draft_to_target(drafter.logits(h[0, m - 1:]).argmax(-1)).tolist()
            assert drafts == expected, (m, drafts, expected)
            later = (prompt + out)[m + 1:m + 1 + k]  # what the target committed after x_m: drafts match a prefix
            m += next((j for j, d in enumerate(drafts) if j >= len(later) or d != later[j]), k) + 1


def test_greedy_accepts_when_drafter_agrees(tmp_path):
    """Catches an acceptance rule that never accepts: a drafter whose head copies the target's next-token
    choice for the tokens it sees must get tau > 1 on a peaked target."""
    target = _tiny_llama(40, scale=1.0)
    drafter = _tiny_drafter(tmp_path, 40, 40)
    decoder = SpeculativeDecoder(target, drafter, (1, 2, 3), draft_tokens=2, eos_token_id=-1)
    out, _ = decoder.generate([1, 2, 3], 30)
    favourite = max(set(out), key=out.count)
    # a constant drafter: all-zero logits make draft id 0 the argmax, and d2t maps it to the favourite token
    with torch.no_grad():
        drafter.lm_head.weight_up.zero_()
    drafter.d2t = torch.zeros(40, dtype=torch.long)
    drafter.d2t[0] = favourite
    out2, stats = decoder.generate([1, 2, 3], 30)
    assert out2 == out
    expected = sum(1 for i in range(1, len(out)) if out[i] == favourite) > 0
    assert expected and stats.tau > 1.0


def _sampled_counts(decoder, prompt: list[int], vocab: int, n: int) -> torch.Tensor:
    """How often each token came at new positions 2 and 3 (the ones the accept/resample rule decides)."""
    counts = torch.zeros(2, vocab)
    for _ in range(n):
        out, _ = decoder.generate(prompt, 3)
        counts[0, out[1]] += 1
        counts[1, out[2]] += 1
    return counts / n


def test_sampling_is_lossless_in_distribution(tmp_path, monkeypatch):
    """Catches a wrong accept/resample rule (e.g. accepting a draft with probability other than p(d), drawing the
    rejected token without removing the draft, the wrong p at draft position 2, or the bonus token from the wrong
    position): new tokens 2 and 3 (draft positions 1 and 2 of the first round, or a later round's) must follow the
    target's own marginals, although the drafter's argmax proposals (a trimmed 16-token vocabulary) are far from
    p. Token 1 comes from the prefill alone and decides nothing here."""
    vocab, n = 24, 3000
    target = _tiny_llama(vocab, scale=6.0, seed=1)
    drafter = _tiny_drafter(tmp_path, vocab, 16)
    decoder = SpeculativeDecoder(target, drafter, (1, 2, 3), draft_tokens=2, temperature=1.0, eos_token_id=-1,
                                 seed=0)
    prompt = [3, 1, 4, 1, 5]
    freq = _sampled_counts(decoder, prompt, vocab, n)
    with torch.no_grad():  # the target's marginals, float64, by enumerating every continuation
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
        one = torch.tensor([prompt + [t] for t in range(vocab)])
        cond2 = torch.softmax(target(one).logits[:, -1].double(), -1)  # [t1, t2]
        two = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        cond3 = torch.softmax(target(two).logits[:, -1].double(), -1).view(vocab, vocab, vocab)  # [t1, t2, t3]
    joint12 = p1[:, None] * cond2
    p2 = joint12.sum(0)
    p3 = (joint12[:, :, None] * cond3).sum((0, 1))
    tv2 = 0.5 * float((freq[0].double() - p2).abs().sum())
    tv3 = 0.5 * float((freq[1].double() - p3).abs().sum())
    assert tv2 < 0.05 and tv3 < 0.05, (tv2, tv3)
    # the test can fail: a decoder that accepts every draft samples token 2 from the drafter, not the target
    monkeypatch.setattr(SpeculativeDecoder, "_verify",
                        lambda self, drafts, logits: (len(drafts), int(logits[len(drafts)].argmax())))
    wrong = _sampled_counts(decoder, prompt, vocab, 600)
    assert 0.5 * float((wrong[0].double() - p2).abs().sum()) > 0.15


def test_cli_eval_json_with_baseline(tiny_converted, tiny_target, tmp_path):
    result = CliRunner().invoke(main, ["eval", str(tiny_converted), "-t", str(tiny_target), "--num-prompts", "2",
                                       "--max-new-tokens", "12", "--baseline", str(tmp_path / "drafter"), "--json",
                                       "-q"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    for key in ("tau", "acceptance_per_position", "tokens_per_second", "num_prompts"):
        assert key in report and key in report["baseline"]
    assert report["rho_tau"] == pytest.approx(report["tau"] / report["baseline"]["tau"])
    assert report["outputs_identical_to_baseline"] is True  # both are lossless greedy decodes
    assert report["device"] == "cpu"  # tests/conftest.py pins the CPU (auto would take a GPU)


def test_cli_eval_says_which_drafter_drafts_in_parallel(tiny_target, tmp_path):
    """Catches an eval table that hides how each drafter drafted: a P-EAGLE drafter measured beside a chain
    drafter must be reported as "parallel" (one pass, K-1 masked slots), the other as "chain"."""
    from slimspec.checkpoint.target_model import load_target_model

    vocab = load_target_model(tiny_target)[0].config.vocab_size
    write_drafter(tmp_path / "p", "eagle", Spec(vocab=vocab, draft_vocab=512, parallel_token=11))
    write_drafter(tmp_path / "c", "eagle", Spec(vocab=vocab, draft_vocab=512))
    args = ["eval", str(tmp_path / "p"), "-t", str(tiny_target), "--num-prompts", "1", "--max-new-tokens", "6",
            "-k", "2", "--baseline", str(tmp_path / "c"), "-q"]
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0, table.output
    assert [line.split() for line in table.stdout.splitlines() if line.startswith("drafting")] == [
        ["drafting", "parallel", "chain"]]
    report = json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)
    assert (report["drafting"], report["baseline"]["drafting"]) == ("parallel", "chain")


def test_eval_device_errors_before_loading_and_one_device_for_both_models(tiny_target, tmp_path, monkeypatch):
    """Catches `eval --device cuda` on a machine without a GPU failing deep in a model load (or running on the CPU
    silently), and a decoder whose drafter sits on another device than its target (a mismatch crash in the
    first draft step, or CPU drafting beside a GPU target)."""
    import slimspec.evaluate.acceptance as acceptance
    from slimspec.checkpoint.target_model import load_target_model

    monkeypatch.setattr(acceptance, "load_for_eval", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    result = CliRunner().invoke(main, ["eval", str(tmp_path / "any"), "--device", "cuda", "-q"])
    assert result.exit_code == 2 and "no CUDA GPU" in result.output, result.output
    target, _ = load_target_model(tiny_target)
    write_drafter(tmp_path / "d", "eagle", Spec(vocab=target.config.vocab_size, draft_vocab=512))
    drafter = Eagle3Drafter.from_checkpoint(load_drafter(tmp_path / "d"),
                                            embed_weight=target.model.embed_tokens.weight.detach())
    with pytest.raises(ValueError, match="the drafter is on meta, the target on cpu"):
        SpeculativeDecoder(target, drafter.to("meta"), (1, 2, 3))


def test_sampling_with_a_16_bit_drafter_and_no_tokens_asked(tmp_path):
    """Catches the drafter's q built in its own dtype (a bf16 drafter crashed at T > 0: float32 logits written
    into a bf16 tensor), and max_new_tokens = 0 returning the target's first token anyway."""
    vocab = 24
    target = _tiny_llama(vocab, scale=6.0, seed=1)
    drafter = _tiny_drafter(tmp_path, vocab, 16).to(torch.bfloat16)
    decoder = SpeculativeDecoder(target, drafter, (1, 2, 3), draft_tokens=2, temperature=0.8, eos_token_id=-1,
                                 seed=0)
    out, stats = decoder.generate([3, 1, 4, 1, 5], 10)
    assert len(out) == 10 and stats.new_tokens == 10 and stats.rounds > 0
    assert decoder.generate([3, 1, 4], 0)[0] == []


def test_gpu_eval_frees_its_models_before_returning(monkeypatch):
    """Catches a reference eval on a GPU that keeps its float32 target cached on the device after it returns:
    `eval --engine vllm` then starts vLLM beside it, and vLLM refuses to start for want of free GPU memory."""
    import gc
    import weakref

    import slimspec.evaluate.acceptance as acceptance

    held = {}

    class Model:
        pass

    def decoding(drafter, target, baseline, prompts, where, **kwargs):
        model = Model()
        held["model"] = weakref.ref(model)
        held["where"] = where
        stats = {"tau": 1.5, "acceptance_per_position": [0.5], "tokens_per_second": 1.0, "num_prompts": 1}
        return {"drafter": stats}, {"drafter": [[1]]}, "t", "/t"

    freed = []
    monkeypatch.setattr(acceptance, "_decode_runs", decoding)
    monkeypatch.setattr(acceptance, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(held["model"]() is None))
    gc.disable()  # the model must be gone by reference counting or by the eval's own collection, not by chance
    try:
        report = acceptance.evaluate("d", "t", num_prompts=1, progress=False, device="cuda")
    finally:
        gc.enable()
    assert freed == [True] and report["device"] == "cuda" and held["where"] == torch.device("cuda")


def test_one_hot_rejection_sampling_gives_the_target_distribution():
    """Catches a verify rule at temperature > 0 whose first new token does not follow p exactly: a rejected draft
    drawn again (the residual keeping it), or acceptance with other than p(d). The rule is vLLM's with greedy
    drafts, so a draft the target finds likely and one it finds unlikely both come out at p's rates."""
    decoder = object.__new__(SpeculativeDecoder)
    decoder.temperature, decoder.generator = 1.0, torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    logits = p.log().float().expand(3, 4).contiguous()
    n = 20000
    for draft in (0, 3):
        counts = torch.zeros(4)
        for _ in range(n):
            accepted, token = decoder._verify([draft, 1], logits)
            counts[draft if accepted else token] += 1
        tv = 0.5 * float((counts.double() / n - p).abs().sum())
        assert tv < 0.015, (draft, tv, counts / n)


def test_no_speculation_round_is_one_line(tiny_converted, tiny_target):
    """Catches `eval --max-new-tokens 1` (every prompt ends at its first token: no verification round) crashing
    the table with an IndexError, and --json printing tau NaN (not JSON)."""
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(main, ["eval", str(tiny_converted), "-t", str(tiny_target), "--num-prompts", "1",
                                           "--max-new-tokens", "1", "-q", *extra])
        assert result.exit_code == 2 and "no speculation round ran" in result.stderr, result.output
        assert "Traceback" not in result.output and "NaN" not in result.stdout


def test_vllm_engine_missing_fails_before_the_reference_decode(tiny_converted, tiny_target, monkeypatch):
    """Catches `eval --engine vllm` finding vLLM missing only after the whole reference decode (minutes to hours on
    a real target)."""
    import slimspec.evaluate.acceptance as acceptance

    decoded = []
    monkeypatch.setattr(acceptance, "_decode_runs", lambda *a, **k: decoded.append(1) or 1 / 0)
    monkeypatch.setenv("SLIMSPEC_VLLM_PYTHON", "/nonexistent/python")
    result = CliRunner().invoke(main, ["eval", str(tiny_converted), "-t", str(tiny_target), "--num-prompts", "1",
                                       "--engine", "vllm", "-q"])
    assert result.exit_code == 2 and "/nonexistent/python does not exist" in result.stderr, result.output
    assert decoded == []


def test_kappa_of_a_multi_layer_drafter(tiny_target, tmp_path):
    """Catches measure_kappa's random drafter cache holding one layer's kv heads: a 2-layer drafter (whose cache
    stacks its layers on dim 1) crashed with a size mismatch in `bench --kappa`."""
    from transformers import AutoModelForCausalLM

    from slimspec.evaluate.cost import measure_kappa

    write_drafter(tmp_path / "d2", "eagle", Spec(vocab=49152, draft_vocab=512, hidden=32, target_hidden=32, layers=2))
    target = AutoModelForCausalLM.from_pretrained(tiny_target)
    drafter = Eagle3Drafter.from_checkpoint(load_drafter(tmp_path / "d2"),
                                            embed_weight=target.model.embed_tokens.weight.detach())
    assert drafter.config.num_layers == 2
    result = measure_kappa(target, drafter, context=16, repeats=2)
    assert result["kappa"] > 0 and result["drafter_layer_s"] > 0
