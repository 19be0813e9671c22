"""Sizes, costs and peak memory of one conversion's stages, from shapes and counts alone (``convert --dry-run``).

Pure arithmetic: no tensor is made and no file is read. Each function returns parameters, FLOPs or bytes and its
docstring says what grows with what. Symbols (as in docs/development.md, "Planning a conversion"):

- ``V`` rows of the head being factorised: the draft vocabulary for ``--vocab draft``, the target's for ``full``
- ``d`` drafter hidden size, ``r`` rank, ``Vt`` / ``Ht`` / ``L`` the target's vocabulary, hidden size and layers
- ``P`` the target's parameter count, ``k`` TTT steps, ``n`` target states fc reads (3 in EAGLE-3)
- ``T`` tokens, ``M`` feature rows (answer positions, or every position for the drafter teacher), ``B`` batch tokens

Float32 is 4 bytes, float64 8; a stored tensor takes its dtype's size per element. Host (CPU) stages also count
:data:`RUNTIME_BYTES`, the process itself. Checked against the resident memory of conversions of stand-ins at the
real 8B and 70B widths and vocabularies (``scripts/rehearse.py``; BENCHMARKS.md, "8B- and 70B-shaped rehearsals").
"""

from __future__ import annotations

from slimspec.convert.factorize import DEFAULT_CHUNK_ROWS
from slimspec.convert.pipeline import STITCH_ROWS
from slimspec.distill.loss import BUFFER_BYTES
from slimspec.distill.train import IDENTITY_ROWS

FLOAT32 = 4
FLOAT64 = 8
CACHE_TOKEN_BYTES = 9
"""Teacher cache bytes per token besides the hidden states: an int64 token id and a bool loss mask."""
RUNTIME_BYTES = 256 * 2**20
"""The converting process before it reads a weight: Python with torch, transformers and slimspec imported (0.24 GiB
resident, measured)."""
TOKENIZER_TOKEN_BYTES = 2048
"""The target's fast tokenizer per vocabulary token, loaded for the teacher data and resident from then on (its
vocabulary and merge tables: 0.24 GiB for a 128,256-token tokenizer, 0.25 GiB for 151,936, measured; dropping it
gives none of it back)."""
FEATURE_ROW_EXTRA = 12
"""Bytes per (row, TTT step) of the student features besides the hidden state: an int64 teacher index and a float32
weight."""


def head_params(vocab: int, hidden: int) -> int:
    """Weights of the full head ``W (V x d)``: ``V*d``; grows with the vocabulary and the hidden size."""
    return vocab * hidden


def pair_params(vocab: int, hidden: int, rank: int) -> int:
    """Weights of the pair ``W_up (V x r)``, ``W_down (r x d)``: ``r*(V+d)``; linear in the rank."""
    return rank * (vocab + hidden)


def head_flops(vocab: int, hidden: int) -> int:
    """FLOPs of the full head per drafted token: ``2*V*d`` (one multiply and one add per weight)."""
    return 2 * head_params(vocab, hidden)


def pair_flops(vocab: int, hidden: int, rank: int) -> int:
    """FLOPs of the pair per drafted token: ``2*r*(V+d)`` (``h @ W_down.T``, then ``@ W_up.T``)."""
    return 2 * pair_params(vocab, hidden, rank)


def head_held_bytes(vocab: int, hidden: int, stored: int) -> int:
    """What the conversion holds once the head is read: ``runtime + stored + V*d*4``. ``stored``: the heads the
    conversion reads as stored on disk, memory-mapped and resident once read (the drafter's head; the target's
    head or tied embedding where its rows go into the head: ``--vocab full``, or a drafter without a head); the
    drafter's other weights are memory-mapped and become resident only when they are used (the drafter built for
    teacher data, the output written). ``V*d*4``: the head as one float32 matrix (drafter rows stitched into the
    target's for ``full``). Grows with the head vocabulary times the hidden size."""
    return RUNTIME_BYTES + stored + FLOAT32 * vocab * hidden


def head_read_bytes(vocab: int, hidden: int, stored: int, stitched_rows: int = 0) -> int:
    """Reading the head: :func:`head_held_bytes` ``+ min(Vd, 4096)*d*4`` while ``stitched_rows`` (Vd) drafter rows
    are put into the target's head (``--vocab full``): they are made float32 4096 rows at a time
    (:data:`~slimspec.convert.pipeline.STITCH_ROWS`) as they are written in."""
    return head_held_bytes(vocab, hidden, stored) + FLOAT32 * min(stitched_rows, STITCH_ROWS) * hidden


def chunk_rows(vocab: int) -> int:
    """Rows of the head the Gram matrix, the centred spectrum and the reconstruction error take at a time."""
    return min(vocab, DEFAULT_CHUNK_ROWS)


def gram_bytes(vocab: int, hidden: int, stored: int) -> int:
    """The Gram matrix and both spectra: ``held + d*d*8 + max(2*d*d*8, c*d*8)``. ``W^T W`` is accumulated in float64
    (d x d) over row chunks of the float32 head, which stays. Beside them, once at a time: two more float64 d x d
    (the triangle's symmetric completion, ``triu`` and the sum with its transpose; the centring's outer product
    and its quotient) or the float64 copy of a ``c``-row chunk (c = min(V, 16384)) the centred spectrum's column
    sums are taken from. Quadratic in ``d``, then linear in ``d`` once V > 16384."""
    return head_held_bytes(vocab, hidden, stored) + FLOAT64 * hidden * hidden + max(
        2 * FLOAT64 * hidden * hidden, FLOAT64 * chunk_rows(vocab) * hidden)


def factorize_bytes(vocab: int, hidden: int, rank: int, stored: int) -> int:
    """What the conversion holds once factorised: ``held + d*d*8 + V*r*4 + r*d*4``: the float32 factors beside the
    head and the Gram matrix (kept for the report). The factors grow with the rank times ``V + d``."""
    return head_held_bytes(vocab, hidden, stored) + FLOAT64 * hidden * hidden + \
        FLOAT32 * pair_params(vocab, hidden, rank)


def eigensolver_bytes(hidden: int) -> int:
    """The factorisation's transient copies of the Gram matrix, ``d*d*8``: the float32 copy the top eigenpairs are
    solved on and LAPACK's copy of it (d >= 1024), or LAPACK's float64 copy (d < 1024); grows with ``d`` squared."""
    return FLOAT64 * hidden ** 2


def error_bytes(vocab: int, hidden: int) -> int:
    """The reconstruction error's transient over one ``c``-row chunk (c = min(V, 16384)), ``c*d*20``: the float32
    difference ``W - W_up W_down``, its float64 copy and that copy squared. After the factors (and again after
    distillation); linear in ``d`` once V > 16384."""
    return (FLOAT32 + 2 * FLOAT64) * chunk_rows(vocab) * hidden


def factorize_stage_bytes(vocab: int, hidden: int, rank: int, stored: int) -> int:
    """The factorisation's peak: :func:`factorize_bytes` and the larger of :func:`eigensolver_bytes` and
    :func:`error_bytes` (they run one after the other)."""
    return factorize_bytes(vocab, hidden, rank, stored) + max(eigensolver_bytes(hidden), error_bytes(vocab, hidden))


def write_bytes(held: int, vocab: int, hidden: int, rank: int, out_element: int, rest: int) -> int:
    """Writing the folder: ``held + 2*(rest + (V*r + r*d)*e)``: the output tensors (the drafter's other tensors,
    ``rest`` bytes, and the pair in the output dtype of ``e`` bytes) made beside what the conversion holds
    (``held``: :func:`factorize_bytes`), and the contiguous copy the writer hands to safetensors."""
    return held + 2 * (rest + out_element * pair_params(vocab, hidden, rank))


def verify_bytes(held: int, vocab: int, hidden: int, rank: int, out_element: int, rest: int) -> int:
    """Verifying the folder: ``held + 2*(rest + (V*r + r*d)*e) + 2*(V*r + r*d)*4``: the output tensors (the writer's
    copy is gone) and the folder read back (memory-mapped, every tensor compared), then both pairs as float32 to
    compare their logits."""
    return held + 2 * (rest + out_element * pair_params(vocab, hidden, rank)) + \
        2 * FLOAT32 * pair_params(vocab, hidden, rank)


def target_parts_bytes(target_vocab: int, target_hidden: int) -> int:
    """The target's head and token embedding as float32, held on the host while teacher data is made and the pair
    distilled: ``2*Vt*Ht*4`` (both, also where they are tied); grows with the target's vocabulary."""
    return 2 * FLOAT32 * target_vocab * target_hidden


def tokenizer_bytes(target_vocab: int) -> int:
    """The target's tokenizer, from the teacher data on: ``Vt * 2 KiB`` (:data:`TOKENIZER_TOKEN_BYTES`)."""
    return TOKENIZER_TOKEN_BYTES * target_vocab


def target_parts_load_bytes(target_vocab: int, target_hidden: int, stored_element: int) -> int:
    """Reading the target's head and embedding: both as stored (``s`` bytes each), memory-mapped and resident
    while they are made float32, ``2*Vt*Ht*s`` beside :func:`target_parts_bytes` (their own mappings, also where
    the conversion read the head already or they are tied)."""
    return 2 * stored_element * target_vocab * target_hidden


def feature_pass_bytes(params: int, layers: int, target_hidden: int, tokens: int, element: int = FLOAT32) -> int:
    """The target taking the drafter's features in the feature dtype (``e`` bytes: float32 4, bf16 2), one sequence
    at a time: ``P*e + (L+1)*T*Ht*e`` (its weights, then every layer's hidden state of a ``T``-token sequence);
    grows with the target's size."""
    return element * params + element * (layers + 1) * tokens * target_hidden


def answering_bytes(params: int, element: int, layers: int, kv_width: int, batch: int, tokens: int,
                    target_vocab: int) -> int:
    """The copy of the target that writes the answers, in the generation dtype (``e`` bytes): ``P*e +
    2*L*batch*T*kv*e + batch*Vt*4``: weights, the key/value cache of ``batch`` sequences of ``T`` tokens
    (``kv`` = key/value heads x head size per layer) and one step's float32 logits."""
    return element * params + 2 * element * layers * batch * tokens * kv_width + FLOAT32 * batch * target_vocab


def teacher_target_bytes(features: int, answering: int, *, regenerate: bool, static: bool, batch: int = 0,
                         tokens: int = 0, states: int = 0) -> int:
    """The target while it makes teacher data. Answers regenerated by ``generate``: ``max(features, answering)``,
    as the answering copy is freed before the float32 copy is loaded (one copy at a time; one copy when the
    generation dtype is float32). The static engine: the answering copy alone, whose passes also give the
    features (plus ``batch*T*states*4`` of float32 states, ``states`` = (n+1)*Ht). Answers not regenerated: the
    float32 copy alone."""
    if not regenerate:
        return features
    if static:
        return answering + FLOAT32 * batch * tokens * states
    return max(features, answering)


def teacher_cache_bytes(tokens: int, target_hidden: int, aux_states: int, store_element: int) -> int:
    """The teacher cache on disk (memory-mapped when read): per token ``n*Ht`` aux states and ``Ht`` final states
    in the store dtype (``s`` bytes, bfloat16: 2) plus 9 bytes of id and mask: ``T*((n+1)*Ht*s + 9)``; linear in the
    tokens and the target's hidden size."""
    return tokens * ((aux_states + 1) * target_hidden * store_element + CACHE_TOKEN_BYTES)


def student_feature_bytes(rows: int, steps: int, hidden: int) -> int:
    """The frozen drafter's float32 states at every feature row and TTT step, with their teacher index and weight:
    ``M*k*(d*4 + 12)``; linear in the rows (so in the prompts and answer length) and in ``k``."""
    return rows * steps * (FLOAT32 * hidden + FEATURE_ROW_EXTRA)


def student_model_bytes(drafter_params: int, target_vocab: int, target_hidden: int) -> int:
    """The float32 drafter the features come from (its own weights and the target's token embedding it reads):
    ``(drafter params + Vt*Ht)*4``. On the host the drafter shares the target's float32 embedding (``Vt`` = 0
    here: :func:`target_parts_bytes` counts it)."""
    return FLOAT32 * (drafter_params + target_vocab * target_hidden)


def covariance_bytes(features: int, hidden: int) -> int:
    """The whitened start: the student features and their float64 covariance, ``features + d*d*8``."""
    return features + FLOAT64 * hidden * hidden


def whitened_bytes(vocab: int, hidden: int, rank: int) -> int:
    """Solving for the whitened start, beside the covariance: ``5*d*d*8 + max(2*d*d*8, V*r*12)``: the covariance
    made symmetric with its ridge, its eigenvectors, its square root and inverse square root and the head's Gram
    matrix (float64 d x d, held until the factors are made); at first the product ``S G S`` and its intermediate
    (two more), at the end the new float32 up factor and its float64 copy (the factors' balancing)."""
    return 5 * FLOAT64 * hidden * hidden + max(2 * FLOAT64 * hidden * hidden, (FLOAT32 + FLOAT64) * vocab * rank)


def teacher_head_bytes(vocab: int, width: int) -> int:
    """The teacher's head the KLs and the steps multiply by, float32, held from the step-0 KLs on: ``V*w*4``
    (``w``: Ht for the target teacher, d+1 for the drafter teacher, 0 where the host's float32 target head is
    it)."""
    return FLOAT32 * vocab * width


def run_identity_bytes(vocab: int, width: int, from_device: bool = False) -> int:
    """The distillation's start: the float64 copy of one 4096-row block of the teacher head
    (:data:`~slimspec.distill.train.IDENTITY_ROWS`) its checksum is taken from (what a resumed run must share) on
    the host, ``min(V, 4096)*w*8`` (``w``: Ht for the target teacher, d+1 for the drafter teacher); from a head on a
    GPU (``from_device``) also the block's float32 copy it is converted from on the host, ``min(V, 4096)*w*4``."""
    return (FLOAT64 + (FLOAT32 if from_device else 0)) * min(vocab, IDENTITY_ROWS) * width


def teacher_table_bytes(rows: int, steps: int, vocab: int, element: int) -> int:
    """The teacher's log-probabilities of every feature row and TTT step over the head vocabulary: ``M*k*V*e``
    (e: 4 for float32, 2 for float16, 0 where no table fits its budget, a third of the free memory); the largest
    term of a long run at a large vocabulary."""
    return rows * steps * vocab * element


def distill_step_bytes(batch_tokens: int, steps: int, hidden: int, vocab: int, rank: int,
                       table_element: int) -> int:
    """One distillation step beside the features, the table and the teacher's head (:func:`teacher_head_bytes`):
    the batch's states ``B*k*(d*4 + 12)``, its rows of the table ``B*k*V*e``, the KL's logit buffers
    ``min(2*B*k*V*4, 256 MiB)``, the pair with its gradient and two Adam moments ``4*r*(V+d)*4``. Grows with the
    batch tokens times the vocabulary."""
    tokens = batch_tokens * steps
    return (student_feature_bytes(batch_tokens, steps, hidden) + tokens * vocab * table_element
            + min(2 * FLOAT32 * tokens * vocab, BUFFER_BYTES) + 4 * FLOAT32 * pair_params(vocab, hidden, rank))


def teacher_tokens(prompts: int, prompt_tokens: int, answer_tokens: int, max_length: int) -> int:
    """Tokens of the teacher data: ``prompts * min(max_length, prompt + answer tokens)``."""
    return prompts * min(max_length, prompt_tokens + answer_tokens)


def dense_params(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, tied: bool) -> int:
    """Parameters of a dense Llama-style decoder from its config, where the sizes of its weight files are unknown:
    ``V*H*(1 or 2) + L*(2*H*heads*hd + 2*H*kv*hd + 3*H*I + 2*H) + H``."""
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return vocab * hidden * (1 if tied else 2) + layers * (per_layer + 2 * hidden) + hidden
