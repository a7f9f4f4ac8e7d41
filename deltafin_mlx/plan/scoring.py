"""How big a scoring pass may be: the one rule for teacher-forced scoring's memory.

A scoring pass sends many texts through each layer before the next (engine/
streaming_moe reads each expert the pass routes to once), like a prefill pass, and
is sized by the same rule (plan/memory.py `pass_tokens`: the budget but what stays
resident through the pass), but it keeps nothing once a layer is done: no KV cache
(texts that fit in one attention call are scored without one) and no decode state.
What a prefill pass holds beside its tokens (the KV/state its prompt keeps, one
attention chunk) is free for the scoring pass's own two transient blocks, so a
scoring pass is never smaller than a prefill pass: attention takes groups of rows of
up to `attention_tokens` (bigger groups than a prefill chunk: fewer calls), and the
log-probs are computed a block of rows of logits at a time (`logit_rows`), so vocab
x tokens logits never sit in memory whole.
"""

from dataclasses import dataclass

import mlx.core as mx

from deltafin_mlx.model.config import text_config
from deltafin_mlx.plan.memory import (MemoryPlan, pass_bytes_per_token, pass_tokens,
                                      prefill_bytes, sequence_state)

# Shares, for the pass's two transient blocks, of what a prefill pass holds beside
# its tokens, each capped: past the caps bigger blocks only take tokens from the
# pass, which are what saves reads (uncapped, they took half of K3's pass tokens:
# docs/LEARNED.md). At small budgets the shares bind.
LOGIT_SHARE = 8  # one block of logits and its log-softmax
ATTENTION_SHARE = 3  # one attention call's activations
MAX_LOGIT_ROWS = 256  # positions: already one matrix product's worth of rows
MAX_ATTENTION_TOKENS = 1024  # rows of one attention call: many texts at once


@dataclass
class ScoringPlan:
    step: int  # tokens per attention call (the plan's attention chunk)
    pass_tokens: int  # tokens per pass, padding included, for texts within one attention call
    attention_tokens: int  # tokens per attention call of such a pass
    logit_rows: int  # positions whose logits are computed at once


def block_room(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype) -> int:
    """What a prefill pass holds beside its tokens (its prompt's KV/state, one
    attention chunk, and whatever its cap at the context leaves): the room a
    scoring pass's transient blocks take their shares of."""
    return (plan.pass_room()
            - plan.prefill_pass * pass_bytes_per_token(config, plan.moe, activation_dtype))


def logit_rows(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype) -> int:
    """Positions per block of logits: a block is float32 logits, their log-softmax
    and a sort's worth of scratch (4 copies of vocab floats per position)."""
    room = block_room(config, plan, activation_dtype) // LOGIT_SHARE
    return int(max(1, min(MAX_LOGIT_ROWS, room // _row_bytes(config))))


def _row_bytes(config: dict) -> int:
    return 16 * max(text_config(config).get("vocab_size", 1), 1)


def attention_tokens(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype,
                     longest: int) -> int:
    """Tokens per attention call in a scoring pass: rows are attended together
    (fewer, bigger calls: on the CPU K3's KDA recurrence loops over positions
    once per call, whatever the rows), as many as fit in ATTENTION_SHARE of the
    block room at the activations of a chunk of `longest` tokens' context, at
    most MAX_ATTENTION_TOKENS; at least the plan's attention chunk."""
    room = block_room(config, plan, activation_dtype) // ATTENTION_SHARE
    context = max(plan.prefill_step, longest)
    per_token = max(prefill_bytes(config, plan.moe, 1, context, activation_dtype), 1)
    return int(max(plan.prefill_step, min(room // per_token, MAX_ATTENTION_TOKENS)))


def scoring_pass_tokens(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype,
                        longest: int = 0) -> int:
    """Tokens one scoring pass may hold (rows x the longest text, padding counted).
    Texts within one attention call (`attention_tokens`) are attended in groups of
    rows with no cache; a pass of longer texts is attended a group of rows at a
    time, each in chunks of the plan's along its texts over a cache of its own
    (one layer's KV, dropped when the group is done), so its tokens cost that
    layer's KV too; its rows are as many as its tokens allow, not as an attention
    call's."""
    step = plan.prefill_step
    group = attention_tokens(config, plan, activation_dtype, longest)
    per_token = pass_bytes_per_token(config, plan.moe, activation_dtype)
    if longest > group:
        # A group of rows keeps one layer's KV for its texts while it is attended
        # (engine/chunked_attention), nothing after: a layer's share per token.
        recurrent, kv = sequence_state(config, longest, activation_dtype)
        layers = max(text_config(config).get("num_hidden_layers", 1), 1)
        per_token += -(-(recurrent + kv) // (longest * layers))
    held = (prefill_bytes(config, plan.moe, group, max(step, longest), activation_dtype)
            + logit_rows(config, plan, activation_dtype) * _row_bytes(config))
    return max(longest, pass_tokens(plan, held, per_token))


def long_text_tokens(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype,
                     length: int) -> int:
    """Tokens per pass of a text of `length` tokens scored across passes (jobs/
    score_sweep.run_long): the pass holds the text's whole KV/state (kept across
    its passes, the KV twice as it grows), one attention chunk's activations at its
    length and a block of logits; a multiple of the attention chunk. A text longer
    than this is scored across passes."""
    step = plan.prefill_step
    recurrent, kv = sequence_state(config, length, activation_dtype)
    # mlx-lm's KV cache grows by copying into a bigger buffer: twice the KV at peak.
    held = (recurrent + 2 * kv
            + prefill_bytes(config, plan.moe, step, max(step, length), activation_dtype)
            + logit_rows(config, plan, activation_dtype) * _row_bytes(config))
    tokens = pass_tokens(plan, held, pass_bytes_per_token(config, plan.moe, activation_dtype))
    return tokens // step * step


def scoring_plan(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype) -> ScoringPlan:
    return ScoringPlan(step=plan.prefill_step,
                       pass_tokens=scoring_pass_tokens(config, plan, activation_dtype),
                       attention_tokens=attention_tokens(config, plan, activation_dtype, 0),
                       logit_rows=logit_rows(config, plan, activation_dtype))
