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

from slimspec.distill.loss import BUFFER_BYTES

FLOAT32 = 4
FLOAT64 = 8
CACHE_TOKEN_BYTES = 9
"""Teacher cache bytes per token besides the hidden states: an int64 token id and a bool loss mask."""
RUNTIME_BYTES = 256 * 2**20
"""The converting process before it reads a weight: Python with torch, transformers and slimspec imported (0.24 GiB
resident, measured)."""
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


def head_read_bytes(vocab: int, hidden: int, stored: int) -> int:
    """Reading the head: ``runtime + stored + V*d*4``. ``stored``: the heads as stored on disk (the drafter's head,
    and the target's head or tied embedding when a target is given), which stay in memory through the conversion;
    the drafter's other weights are memory-mapped and become resident only when they are used (the drafter built
    for teacher data, the output written). ``V*d*4``: the head as one float32 matrix (drafter rows stitched into
    the target's for ``full``). Grows with the head vocabulary times the hidden size."""
    return RUNTIME_BYTES + stored + FLOAT32 * vocab * hidden


def gram_bytes(vocab: int, hidden: int, stored: int) -> int:
    """The Gram matrix and its eigendecomposition: ``head_read + d*d*8``. ``W^T W`` is accumulated in float64
    (d x d) over row chunks of the float32 head, which stays; quadratic in ``d``, independent of ``V``."""
    return head_read_bytes(vocab, hidden, stored) + FLOAT64 * hidden * hidden


def factorize_bytes(vocab: int, hidden: int, rank: int, stored: int) -> int:
    """What the conversion holds once factorised: ``gram + V*r*4 + r*d*4``: the float32 factors beside the head and
    the Gram matrix (kept for the report). The factors grow with the rank times ``V + d``."""
    return gram_bytes(vocab, hidden, stored) + FLOAT32 * pair_params(vocab, hidden, rank)


def eigensolver_bytes(hidden: int) -> int:
    """The factorisation's transient working copies of the Gram matrix (its float32 copy, LAPACK's workspace, the
    products with the basis): ``4*d*d*8``, freed once the factors are made (measured at the 70B head: 10.3 GiB
    against 9.6 planned with them); grows with ``d`` squared."""
    return 4 * FLOAT64 * hidden ** 2


def write_bytes(held: int, vocab: int, hidden: int, rank: int, out_element: int, rest: int) -> int:
    """Writing the folder: ``held + 2*(rest + (V*r + r*d)*e)``: the output tensors (the drafter's other tensors,
    ``rest`` bytes, and the pair in the output dtype of ``e`` bytes) made beside what the conversion holds
    (``held``: :func:`factorize_bytes`), and the copy the writer hands to safetensors (measured at the 70B head:
    12.45 GiB against 12.39 planned)."""
    return held + 2 * (rest + out_element * pair_params(vocab, hidden, rank))


def verify_bytes(written: int, vocab: int, hidden: int, rank: int, out_element: int, rest: int) -> int:
    """Verifying the folder: ``written + rest + (V*r + r*d)*e``: the output read back (memory-mapped) beside the
    tensors just written, to compare its logits with the factorised head's."""
    return written + rest + out_element * pair_params(vocab, hidden, rank)


def target_parts_bytes(target_vocab: int, target_hidden: int) -> int:
    """The target's head and token embedding as float32, held on the host while teacher data is made and the pair
    distilled: ``2*Vt*Ht*4`` (both, also where they are tied); grows with the target's vocabulary."""
    return 2 * FLOAT32 * target_vocab * target_hidden


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


def teacher_table_bytes(rows: int, steps: int, vocab: int, element: int) -> int:
    """The teacher's log-probabilities of every feature row and TTT step over the head vocabulary: ``M*k*V*e``
    (e: 4 for float32, 2 for float16, 0 where no table fits its budget, a third of the free memory); the largest
    term of a long run at a large vocabulary."""
    return rows * steps * vocab * element


def distill_step_bytes(batch_tokens: int, steps: int, hidden: int, vocab: int, rank: int, teacher_width: int,
                       table_element: int) -> int:
    """One distillation step beside the features and the table: the batch's states ``B*k*(d*4 + 12)``, its rows of
    the table ``B*k*V*e``, the KL's logit buffers ``min(2*B*k*V*4, 256 MiB)``, the pair with its gradient and two
    Adam moments ``4*r*(V+d)*4``, and the teacher's head ``V*w*4`` (``w``: Ht for the target teacher, d+1 for the
    drafter teacher). Grows with the batch tokens times the vocabulary."""
    tokens = batch_tokens * steps
    return (student_feature_bytes(batch_tokens, steps, hidden) + tokens * vocab * table_element
            + min(2 * FLOAT32 * tokens * vocab, BUFFER_BYTES) + 4 * FLOAT32 * pair_params(vocab, hidden, rank)
            + FLOAT32 * vocab * teacher_width)


def teacher_tokens(prompts: int, prompt_tokens: int, answer_tokens: int, max_length: int) -> int:
    """Tokens of the teacher data: ``prompts * min(max_length, prompt + answer tokens)``."""
    return prompts * min(max_length, prompt_tokens + answer_tokens)


def dense_params(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, tied: bool) -> int:
    """Parameters of a dense Llama-style decoder from its config, where the sizes of its weight files are unknown:
    ``V*H*(1 or 2) + L*(2*H*heads*hd + 2*H*kv*hd + 3*H*I + 2*H) + H``."""
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return vocab * hidden * (1 if tied else 2) + layers * (per_layer + 2 * hidden) + hidden
