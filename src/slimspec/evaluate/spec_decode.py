"""Reference speculative decoding in plain PyTorch (gpt-fast style): target verifies drafter chains.

Bookkeeping per round: the committed tokens are x_0..x_m (x_m the target's last bonus token); target
features f_0..f_{m-1} are known. The drafter processes its missing positions t (features f_t, token
x_{t+1}, RoPE position t); its output at m-1 proposes d_1 (for x_{m+1}); each further chain step feeds
back its pre-norm output with the last drafted token at the next position. The target then runs
[x_m, d_1..d_K] in one forward: greedy accepts the longest prefix of d that matches its argmax. At
temperature > 0 the rule is vLLM's default (``draft_sample_method="greedy"``): the drafts are still the drafter's
argmax, a one-hot proposal, so d_j is accepted with probability p_j(d_j) and on rejection the token is drawn
from p_j with d_j removed (lossless in distribution, and the tau vLLM serves at that temperature).
Both KV caches are cropped back to committed positions; the drafter recomputes the accepted positions
from the target's real features next round. A P-EAGLE drafter (``Eagle3Drafter.is_parallel``) drafts as
vLLM's ``parallel_drafting`` does: its output at m-1 and K-1 masked slots at positions m..m+K-2, in one pass
whose slots leave no trace in the cache. Target and drafter share one device (a GPU or the CPU); the random
draws take CPU copies of the distributions, so a seed gives the same draws wherever the models run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slimspec.model import Eagle3Drafter, KVCache


@dataclass
class DecodeStats:
    """What one or more decodes measured: tau = mean accepted+1 per verification round."""

    rounds: int = 0
    accepted: int = 0
    draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    new_tokens: int = 0
    seconds: float = 0.0

    def add(self, other: DecodeStats) -> None:
        self.rounds += other.rounds
        self.accepted += other.accepted
        self.draft_tokens += other.draft_tokens
        self.new_tokens += other.new_tokens
        self.seconds += other.seconds
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        self.accepted_per_position = [x + y for x, y in zip(a, b, strict=True)]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else float("nan")

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of rounds whose j-th draft token was accepted (vLLM's accepted_per_pos / drafts)."""
        return [a / self.rounds for a in self.accepted_per_position] if self.rounds else []

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else float("nan")


def _crop(cache: KVCache | None, length: int) -> KVCache | None:
    return None if cache is None else (cache[0][:, :, :length], cache[1][:, :, :length])


class SpeculativeDecoder:
    """A target (transformers causal LM) and an EAGLE-3 drafter decoding one prompt at a time."""

    def __init__(self, target, drafter: Eagle3Drafter, aux_layers: tuple[int, ...], draft_tokens: int = 4,
                 temperature: float = 0.0, eos_token_id: int | list[int] | None = None, seed: int = 0) -> None:
        self.target, self.drafter = target, drafter
        self.aux_layers = tuple(aux_layers)
        self.k = draft_tokens
        self.temperature = temperature
        eos = eos_token_id if eos_token_id is not None else target.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.generator = torch.Generator().manual_seed(seed)  # CPU draws (see the module docstring)
        self.device = next(target.parameters()).device
        if drafter.fc.weight.device != self.device:
            raise ValueError(f"the drafter is on {drafter.fc.weight.device}, the target on {self.device}: "
                             "speculative decoding needs both on one device")

    def _target_step(self, ids: list[int], cache):
        from transformers import DynamicCache

        cache = cache if cache is not None else DynamicCache(config=self.target.config)
        out = self.target(input_ids=torch.tensor([ids], device=self.device), past_key_values=cache, use_cache=True,
                          output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in self.aux_layers], dim=-1)
        return out.logits[0].float(), aux, out.past_key_values

    def _pick(self, logits: Tensor) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / self.temperature, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self.generator))

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], DecodeStats]:
        """New tokens after ``prompt_ids`` (at most ``max_new_tokens``, stopping at EOS) and their stats."""
        stats = DecodeStats(accepted_per_position=[0] * self.k)
        if max_new_tokens <= 0:
            return [], stats
        start = time.perf_counter()
        drafter, dtype, device = self.drafter, self.drafter.fc.weight.dtype, self.device
        logits, feats, tcache = self._target_step(list(prompt_ids), None)
        tokens = list(prompt_ids) + [self._pick(logits[-1])]
        features = [feats]  # target features of committed positions 0..m-1 (m = len(tokens) - 1)
        dcache: KVCache | None = None
        done = 0  # drafter positions computed from real features
        while len(tokens) - len(prompt_ids) < max_new_tokens and tokens[-1] not in self.eos:
            m = len(tokens) - 1
            f = torch.cat(features)[done:m]
            ids = torch.tensor([tokens[done + 1:m + 1]], device=device)
            positions = torch.arange(done, m, device=device)[None]
            h, dcache = drafter(input_ids=ids, hidden=drafter.combine(f[None].to(dtype)), positions=positions,
                                past_key_values=dcache)
            done = m
            h = h[:, -1:]
            parallel = drafter.is_parallel and self.k > 1
            if parallel:  # P-EAGLE: K-1 masked slots after position m-1, all K drafts from one pass
                emb, hid = drafter.masked_slots(1, self.k - 1)
                slots, _ = drafter(inputs_embeds=emb, hidden=hid, past_key_values=dcache,
                                   positions=torch.arange(m, m + self.k - 1, device=device)[None])
                h = torch.cat([h, slots], dim=1)
            drafts = []
            chain_cache = dcache
            for j in range(self.k):  # the greedy token at every temperature, as vLLM drafts by default (a
                # screen-and-rescore head's is the exact argmax over its shortlist)
                best = drafter.draft_ids(h[:, j:j + 1] if parallel else h)[0, -1]
                d = int(drafter.draft_to_target(best.view(1)))
                drafts.append(d)
                if j + 1 < self.k and not parallel:
                    h, chain_cache = drafter(input_ids=torch.tensor([[d]], device=device),
                                             hidden=drafter.next_hidden(h),
                                             positions=torch.tensor([[m + j]], device=device),
                                             past_key_values=chain_cache)
            logits, feats, tcache = self._target_step([tokens[-1]] + drafts, tcache)
            accepted, next_token = self._verify(drafts, logits)
            stats.rounds += 1
            stats.draft_tokens += self.k
            stats.accepted += accepted
            for j in range(accepted):
                stats.accepted_per_position[j] += 1
            committed = drafts[:accepted] + [next_token]
            room = max_new_tokens - (len(tokens) - len(prompt_ids))
            for tok in committed[:room]:
                tokens.append(tok)
                if tok in self.eos:
                    break
            kept = len(tokens) - 1  # positions whose target features are valid
            features.append(feats[: kept - (m)])
            extra = tcache.get_seq_length() - kept
            if extra > 0:
                tcache.crop(-extra)
            dcache = _crop(dcache, done)
        stats.new_tokens = len(tokens) - len(prompt_ids)
        stats.seconds = time.perf_counter() - start
        return tokens[len(prompt_ids):], stats

    def _verify(self, drafts: list[int], logits: Tensor) -> tuple[int, int]:
        """(number of accepted drafts, the token the target adds after them). At temperature > 0, rejection
        sampling against a one-hot proposal (vLLM's rejection sampler without draft probabilities)."""
        if self.temperature <= 0:
            target_ids = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target_ids[accepted]:
                accepted += 1
            return accepted, target_ids[accepted]
        ps = torch.softmax(logits / self.temperature, dim=-1).cpu()
        for j, d in enumerate(drafts):
            p = ps[j]
            if float(torch.rand((), generator=self.generator)) < float(p[d]):
                continue
            residual = p.clone()
            residual[d] = 0.0
            total = float(residual.sum())
            token = int(torch.multinomial(residual / total if total > 0 else p, 1, generator=self.generator))
            return j, token
        return len(drafts), int(torch.multinomial(ps[len(drafts)], 1, generator=self.generator))


NO_ROUND = ("no speculation round ran: every prompt ended at its first new token (--max-new-tokens 1, or the "
            "target's end-of-turn first); tau is undefined: give more new tokens or other prompts")
