"""How big a scoring pass may be: the one rule for teacher-forced scoring's memory.

A scoring pass sends many texts through each layer before the next (engine/
streaming_moe reads each expert the pass routes to once), like a prefill pass, but
it keeps nothing once a layer is done: no KV cache (texts that fit in one attention
call are scored without one) and no decode state. So the memory the plan reserves
for a sequence's KV/state, and whatever of the budget the plan left unused, is free
for the pass beside the prefill allowance. Each token of the pass holds
`pass_bytes_per_token`; attention takes groups of rows of up to `attention_tokens`
(bigger groups than a prefill chunk: fewer calls); the log-probs are computed a
block of rows of logits at a time (`logit_rows`), so vocab x tokens logits never
sit in memory whole.
"""

from dataclasses import dataclass

import mlx.core as mx

from deltafin_mlx.model.config import text_config
from deltafin_mlx.plan.memory import (MemoryPlan, WORKING_BYTES, pass_bytes_per_token,
                                      prefill_bytes, sequence_state)

MAX_SCORING_PASS = 65536  # tokens: past this a pass's bookkeeping outweighs a sweep saved
# Shares of the scoring allowance for the pass's two transient blocks, each capped:
# past the caps bigger blocks only take tokens from the pass, which are what saves
# reads (uncapped, they took half of K3's pass tokens: docs/LEARNED.md). At small
# budgets the shares bind, not the caps.
LOGIT_SHARE = 8  # one block of logits and its log-softmax
ATTENTION_SHARE = 3  # one attention call's activations
MAX_LOGIT_ROWS = 256  # positions: already one matrix product's worth of rows
MAX_ATTENTION_TOKENS = 1024  # rows of one attention call: many texts at once


@dataclass
class ScoringPlan:
    allowance: int  # bytes a scoring pass may use beyond the trunk and the expert cache
    step: int  # tokens per attention call (the plan's attention chunk)
    pass_tokens: int  # tokens per pass, padding included, for texts within one attention call
    attention_tokens: int  # tokens per attention call of such a pass
    logit_rows: int  # positions whose logits are computed at once


def scoring_allowance(plan: MemoryPlan) -> int:
    """The working buffers' prefill share (less the freed buffers MLX keeps for
    reuse, which the working buffers count: they stay in memory through a pass),
    the prefill activations beyond them, the KV/state reserved for decoding, which
    scoring never makes, whatever of the budget the plan left unused (a cache
    that holds every expert), the expert cache's slots, which it gives back
    during a pass but for the pass's own groups of experts (engine/pass_pool.py),
    and the pinned trunk layers such a pass streams (engine/trunk_pass.py)."""
    return (WORKING_BYTES - plan.buffer_cache_bytes + plan.prefill_bytes + plan.state_bytes
            + max(0, plan.budget - plan.used_bytes) + plan.pass_released_bytes
            + plan.pass_trunk_bytes)


def logit_rows(config: dict, allowance: int) -> int:
    """Positions per block of logits: a block is float32 logits, their log-softmax
    and a sort's worth of scratch (4 copies of vocab floats per position)."""
    return int(max(1, min(MAX_LOGIT_ROWS, allowance // LOGIT_SHARE // _row_bytes(config))))


def logits_bytes(config: dict, allowance: int) -> int:
    """What a block of `logit_rows` positions holds."""
    return logit_rows(config, allowance) * _row_bytes(config)


def _row_bytes(config: dict) -> int:
    return 16 * max(text_config(config).get("vocab_size", 1), 1)


def attention_tokens(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype,
                     longest: int) -> int:
    """Tokens per attention call in a scoring pass: rows are attended together
    (fewer, bigger calls: on the CPU K3's KDA recurrence loops over positions
    once per call, whatever the rows), as many as fit in ATTENTION_SHARE of the
    allowance at the activations of a chunk of `longest` tokens' context, at
    most MAX_ATTENTION_TOKENS; at least the plan's attention chunk."""
    room = scoring_allowance(plan) // ATTENTION_SHARE
    context = max(plan.prefill_step, longest)
    per_token = max(prefill_bytes(config, 1, context, activation_dtype), 1)
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
    allowance = scoring_allowance(plan)
    step = plan.prefill_step
    group = attention_tokens(config, plan, activation_dtype, longest)
    per_token = pass_bytes_per_token(config, activation_dtype)
    if longest > group:
        # A group of rows keeps one layer's KV for its texts while it is attended
        # (engine/chunked_attention), nothing after: a layer's share per token.
        recurrent, kv = sequence_state(config, longest, activation_dtype)
        layers = max(text_config(config).get("num_hidden_layers", 1), 1)
        per_token += -(-(recurrent + kv) // (longest * layers))
    room = (allowance - prefill_bytes(config, group, max(step, longest), activation_dtype)
            - logits_bytes(config, allowance))
    n = min(room // max(per_token, 1), MAX_SCORING_PASS)
    return int(max(max(longest, step), n))


def long_text_tokens(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype,
                     length: int) -> int:
    """Tokens per pass of a text of `length` tokens scored across passes (jobs/
    score_sweep.run_long): the allowance less the text's whole KV/state (kept
    across its passes, the KV twice as it grows), one attention chunk's
    activations at its length and a block of logits, over each token's activations; a multiple of the attention
    chunk, at least one. A text longer than this is scored across passes."""
    allowance = scoring_allowance(plan)
    step = plan.prefill_step
    recurrent, kv = sequence_state(config, length, activation_dtype)
    # mlx-lm's KV cache grows by copying into a bigger buffer: twice the KV at peak.
    room = (allowance - recurrent - 2 * kv - prefill_bytes(config, step, max(step, length),
                                                         activation_dtype)
            - logits_bytes(config, allowance))
    n = room // max(pass_bytes_per_token(config, activation_dtype), 1)
    return int(max(step, min(n, MAX_SCORING_PASS) // step * step))


def scoring_plan(config: dict, plan: MemoryPlan, activation_dtype: mx.Dtype) -> ScoringPlan:
    allowance = scoring_allowance(plan)
    return ScoringPlan(allowance=allowance, step=plan.prefill_step,
                       pass_tokens=scoring_pass_tokens(config, plan, activation_dtype),
                       attention_tokens=attention_tokens(config, plan, activation_dtype, 0),
                       logit_rows=logit_rows(config, allowance))
