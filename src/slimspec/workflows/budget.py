"""``--head-budget``: the screen-and-rescore head (rank r, shortlist K, hot rows N) that agrees most often with the
source head's greedy token on held-out calibration states, among those whose multiply-adds fit a budget.

The budget is a share of the full ``V x d`` head's multiply-adds (``0.06``) or the cost of a plain rank-``d/N`` pair
(``d/8``: ``(d/8) (V + d) / (V d)``). For each candidate rank, the shortlist takes what the pair leaves of the
budget; the pair is the whitened factorisation of the head (as the conversion's own start), measured untrained.
The plain pair at the largest rank the budget affords is measured beside them, so the choice says what the screen
buys.

Served at batch B, the pair and a trimmed head are read once for the whole batch, but each sequence rescores its own
shortlist: the head reads the pair and up to ``N + B K`` exact rows per step. With ``batch`` > 1 a candidate must
fit the budget in both multiply-adds and rows read (``read_share``), so shortlists shrink as B grows and the plain
pair is chosen where no screen measures better (``bench head`` times where that happens on the serving device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from slimspec.checkpoint.drafter import DrafterCheckpoint
from slimspec.checkpoint.target_model import TargetParts
from slimspec.convert.factorize import factorize_whitened
from slimspec.convert.rank import parse_rank
from slimspec.distill.pipeline import DataOptions, activation_covariance, hot_rows_of, teacher_for
from slimspec.distill.train import split_sequences, student_features, training_device
from slimspec.errors import OptionError, RankError
from slimspec.model import ScreenRescoreHead, drafter_model, screen_cost

__all__ = ["BudgetChoice", "budget_share", "choose_under_budget", "read_share", "screen_candidates"]

CANDIDATE_RANKS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Ranks tried (those below d whose pair leaves room for a shortlist of at least ``MIN_SHORTLIST``)."""
MIN_SHORTLIST = 32
HOT_SHARE = 0.25
"""Besides N = 0, each rank is tried with this share of its rescored rows given to always-rescored hot tokens."""


@dataclass(frozen=True)
class BudgetPoint:
    """One measured candidate: its sizes, multiply-add share and greedy agreement with the source head."""

    rank: int
    shortlist: int  # 0: the plain pair
    hot_rows: int
    share: float
    agreement: float
    read: float = 0.0  # head weights read per step at the planned batch, as a share of the full head's

    @property
    def name(self) -> str:
        if not self.shortlist:
            return f"plain pair r={self.rank}"
        return f"screen r={self.rank} K={self.shortlist}" + (f" N={self.hot_rows}" if self.hot_rows else "")


@dataclass(frozen=True)
class BudgetChoice:
    """The chosen screen, the budget it fits, and every candidate measured (best first)."""

    budget: float
    chosen: BudgetPoint
    points: tuple[BudgetPoint, ...]
    states: int
    batch: int = 1

    def summary(self) -> str:
        """One line: what was picked, its agreement, the runner-up and the plain pair."""
        plain = next((p for p in self.points if not p.shortlist), None)
        others = [p for p in self.points if p.shortlist and p != self.chosen][:1] + \
            ([plain] if plain and plain != self.chosen else [])
        beside = "; ".join(f"{p.name}: {p.agreement:.3f}" for p in others)
        served = f" at batch {self.batch} (multiply-adds and rows read)" if self.batch > 1 else ""
        return (f"head budget {self.budget:.3f} of the full head's multiply-adds{served}: {self.chosen.name} (share "
                f"{self.chosen.share:.3f}) agrees with the source head's greedy token on {self.chosen.agreement:.3f} "
                f"of {self.states:,} held-out calibration states" + (f" ({beside})" if beside else ""))

    def report(self) -> dict:
        return {"budget": self.budget, "batch": self.batch, "chosen": asdict(self.chosen), "states": self.states,
                "points": [asdict(p) for p in self.points]}


def budget_share(spec: str | float, vocab: int, hidden: int) -> float:
    """A head budget as a share of the full head's multiply-adds: ``d/N`` (the plain rank-d/N pair's cost) or a
    number in (0, 1)."""
    text = str(spec).strip().replace(" ", "")
    if text.startswith("d/"):
        try:
            return screen_cost(vocab, hidden, parse_rank(text, hidden), 0)
        except RankError:
            pass
    else:
        try:
            share = float(text)
        except ValueError:
            share = -1.0
        if 0.0 < share < 1.0:
            return share
    raise OptionError(f"{{head_budget}} takes d/N (N > 1: the cost of a plain rank-d/N pair) or a share of the full "
                      f"head's multiply-adds between 0 and 1, got {spec!r}", "head_budget")


def read_share(vocab: int, hidden: int, rank: int, shortlist: int, hot_rows: int = 0, batch: int = 1) -> float:
    """Head weights read per draft step at ``batch`` sequences, as a share of the full head's: the pair once, the
    hot rows once, and at most ``batch`` shortlists of distinct exact rows (a plain pair: ``shortlist`` 0)."""
    return screen_cost(vocab, hidden, rank, min(vocab, hot_rows + batch * shortlist))


def screen_candidates(budget: float, vocab: int, hidden: int, batch: int = 1) -> list[tuple[int, int, int]]:
    """(r, K, N) of every candidate screen under ``budget`` at ``batch`` sequences: per rank, the rescored rows the
    rest of the budget pays for, all in the shortlist, or a ``HOT_SHARE`` of them as hot rows; at ``batch`` > 1 the
    shortlist shrinks until the rows ``batch`` shortlists read fit it too (:func:`read_share`)."""
    found = []
    for rank in (r for r in CANDIDATE_RANKS if r < hidden):
        rows = min(vocab, int((budget * vocab * hidden - rank * (vocab + hidden)) // hidden))
        hot = int(rows * HOT_SHARE)
        for hot_rows in (0, hot) if hot else (0,):
            shortlist = (rows - hot_rows) // batch
            if shortlist >= MIN_SHORTLIST:
                found.append((rank, shortlist, hot_rows))
    if not found and batch > 1:
        return []  # no screen fits this batch: the plain pair alone is measured
    if not found:
        raise OptionError(f"{{head_budget}} {budget:.4f} leaves no room for a screen (rank {CANDIDATE_RANKS[0]} and "
                          f"{MIN_SHORTLIST} rescored rows cost {screen_cost(vocab, hidden, 4, MIN_SHORTLIST):.4f} of "
                          "the full head): raise it", "head_budget")
    return found


def choose_under_budget(ckpt: DrafterCheckpoint, weight: torch.Tensor, target: TargetParts, options: DataOptions,
                        budget: float, eval_every_nth: int = 0, ttt_steps: int = 3, progress: bool = True,
                        batch: int = 1) -> BudgetChoice:
    """Measure every candidate under ``budget`` at serving ``batch`` on the calibration data's held-out sequences
    (the teacher data the conversion reads, ``ttt_steps`` steps of each position as its distillation; the pairs are
    whitened on the rest) and return the one of highest agreement (ties: cheaper); at batch 1 always a screen, at
    larger batches the plain pair where it agrees more than every screen that fits."""
    vocab, hidden = weight.shape
    device = training_device(options.device)
    teacher = teacher_for(ckpt, target, options, progress)
    drafter = drafter_model(ckpt, target).to(device)
    train_idx, eval_idx = split_sequences(teacher, eval_every_nth)
    with torch.no_grad():
        covariance = activation_covariance(student_features(drafter, teacher, train_idx, ttt_steps))
        held = student_features(drafter, teacher, eval_idx, ttt_steps)
        states = held.hidden[held.weight > 0].float()
        exact = weight.float().to(states.device)
        wanted = torch.cat([(states[a:a + 4096] @ exact.T).argmax(-1) for a in range(0, len(states), 4096)])
        points = _measure(weight, exact, covariance, states, wanted, budget,
                          lambda count: hot_rows_of(ckpt, teacher, vocab, count), batch)
    ranked = sorted(points, key=lambda p: (-p.agreement, p.share))  # best first; ties: cheaper
    return BudgetChoice(budget, _pick(ranked, batch), tuple(ranked), int(states.shape[0]), batch)


def _pick(ranked: list[BudgetPoint], batch: int) -> BudgetPoint:
    """The first of ``ranked`` (best first); at batch 1 the first screen, whatever the plain pair measured."""
    return next(p for p in ranked if p.shortlist or batch > 1)


def _measure(weight: torch.Tensor, exact: torch.Tensor, covariance: torch.Tensor, states: torch.Tensor,
             wanted: torch.Tensor, budget: float, hot_rows: Callable[[int], torch.Tensor], batch: int = 1
             ) -> list[BudgetPoint]:
    """Agreement of each candidate screen at ``batch``, and of the plain pair at the largest rank under the budget
    (``exact``: ``weight`` in float32 on the states' device; ``hot_rows(N)``: the N always-rescored rows)."""
    vocab, hidden = weight.shape
    by_rank: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def pair(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        if rank not in by_rank:
            up, down = factorize_whitened(weight.float(), rank, covariance)
            by_rank[rank] = (up.float().to(states.device), down.float().to(states.device))
        return by_rank[rank]

    points = []
    for rank, shortlist, hot in screen_candidates(budget, vocab, hidden, batch):
        up, down = pair(rank)
        head = ScreenRescoreHead(up, down, exact, shortlist, hot_rows(hot).to(states.device) if hot else None)
        agree = _share_equal(head.greedy, states, wanted)
        points.append(BudgetPoint(rank, shortlist, hot, screen_cost(vocab, hidden, rank, shortlist, hot), agree,
                                  read_share(vocab, hidden, rank, shortlist, hot, batch)))
    plain = max(1, min(hidden - 1, int(budget * vocab * hidden // (vocab + hidden))))
    up, down = pair(plain)
    agree = _share_equal(lambda h: ((h @ down.T) @ up.T).argmax(-1), states, wanted)
    cost = screen_cost(vocab, hidden, plain, 0)
    points.append(BudgetPoint(plain, 0, 0, cost, agree, cost))
    return points


def _share_equal(greedy: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor, wanted: torch.Tensor,
                 chunk: int = 4096) -> float:
    """Share of ``states`` whose ``greedy`` token is ``wanted``'s, ``chunk`` states at a time."""
    same = sum(int((greedy(states[a:a + chunk]) == wanted[a:a + chunk]).sum()) for a in range(0, len(states), chunk))
    return same / max(1, len(states))
