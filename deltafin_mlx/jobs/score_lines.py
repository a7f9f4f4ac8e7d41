"""Scoring input lines: what each line asks to score, as tokens and a mask.

    {"id": ..., "text": "..."}                      every token of the text (no template)
    {"id": ..., "prompt": "...", "completion": "..."}  the completion's tokens, given the prompt
    {"id": ..., "messages": [...]}                  the chat template applied; the
                                                    assistant turns' tokens scored (with
                                                    content_only, their content's alone)
    {"id": ..., "tokens": [...]}                    token ids as they are, every one scored
                                                    (a text already tokenized)

Lines are read as batch jobs read them (batch_lines.read_requests: JSON objects with a
string or integer id, duplicate ids refused before anything runs); a line that
cannot be scored becomes an error line, never a stopped job. The first token of a
sequence has no prediction, so it is never scored.
"""

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from deltafin_mlx.jobs.batch_lines import Request
from deltafin_mlx.generation.engine import chat_prompt
from deltafin_mlx.generation.stream import common_prefix
from deltafin_mlx.tokenizer.messages import chat_messages
from deltafin_mlx.units import is_int

TEXT_KEYS = ({"id", "text"}, {"id", "prompt", "completion"}, {"id", "messages"}, {"id", "tokens"})


@dataclass
class ScoreItem:
    """Tokens to score: a line of a job (`id` its id) or what a caller tokenized
    itself (perplexity's windows, lm-eval's requests: `id` its own index)."""

    id: object
    tokens: List[int]
    scored: np.ndarray  # (len(tokens),) bool: positions whose token is scored
    line: Optional[int] = None  # the job input's line number it answers (1-based)

    @classmethod
    def scored_from(cls, id, tokens: List[int], start: int) -> "ScoreItem":
        """`tokens` scored from `start` on, never the first (it has no prediction)."""
        scored = np.arange(len(tokens)) >= max(start, 1)
        return cls(id, [int(t) for t in tokens], scored)

    @property
    def scored_tokens(self) -> int:
        return int(self.scored.sum())


def _string(spec, name):
    v = spec[name]
    if not isinstance(v, str):
        raise ValueError(f'"{name}" must be a string')
    return v


def _render(tokenizer, messages, add_generation_prompt: bool, thinking: bool) -> List[int]:
    return chat_prompt(tokenizer, messages, thinking=thinking,
                       add_generation_prompt=add_generation_prompt)


def _messages(tokenizer, msgs, thinking: bool, content_only: bool = False):
    """Tokens of the conversation and the mask of its assistant turns: a turn's
    tokens run from where the conversation before it, with the generation prompt,
    stops matching, to the end of the conversation rendered up to it. Its content's
    tokens (`content_only`) are those where the turn rendered with its content and
    rendered with none differ: whatever the template puts around the content (the
    end-of-turn token, thinking markers) renders in both."""
    msgs = chat_messages(msgs)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise ValueError('"messages" has no assistant turn to score')
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError('"messages" need a chat template, which this tokenizer has none of')
    rendered = getattr(tokenizer, "render_turns", lambda *a, **k: None)(msgs, thinking=thinking)
    if rendered is not None:
        return _turns_of_one_render(tokenizer, msgs, turns, rendered, thinking, content_only)
    tokens = _render(tokenizer, msgs, False, thinking)
    scored = np.zeros(len(tokens), dtype=bool)
    for i in turns:
        upto = _render(tokenizer, msgs[: i + 1], False, thinking)
        if tokens[: len(upto)] != upto:
            raise ValueError("the chat template does not render the conversation up to an "
                             "assistant turn as a prefix of the whole; score it as \"text\"")
        start = common_prefix(tokens, _render(tokenizer, msgs[:i], True, thinking))
        end = len(upto)
        if content_only:
            empty = _render(tokenizer, msgs[:i] + [{**msgs[i], "content": ""}], False, thinking)
            start = max(start, common_prefix(upto, empty))
            end -= common_prefix(upto[::-1], empty[::-1])
        scored[start:end] = True
    if not scored.any():
        raise ValueError("the assistant turns have no content tokens to score")
    return tokens, scored


def _turns_of_one_render(tokenizer, msgs, turns, rendered, thinking: bool, content_only: bool):
    """`_messages`'s tokens and mask from one render that says where each message
    starts (KimiTokenizer.render_turns), in time linear in the conversation: the
    conversation up to message i is its tokens before `at[i]`, so a turn starts
    where the generation prompt after them stops matching and ends at `at[i + 1]`;
    with `content_only`, the turn alone rendered with no content (an assistant
    turn renders the same whatever comes before it) trims what it shares."""
    tokens, at, gen = rendered
    scored = np.zeros(len(tokens), dtype=bool)
    for i in turns:
        start = at[i] + common_prefix(tokens[at[i] : at[i] + len(gen)], gen)
        end = at[i + 1]
        if content_only:
            alone, a, _ = tokenizer.render_turns([{**msgs[i], "content": ""}], thinking=thinking)
            empty, turn = alone[a[0] :], tokens[at[i] : end]
            start = max(start, at[i] + common_prefix(turn, empty))
            end -= common_prefix(turn[::-1], empty[::-1])
        scored[start:end] = True
    if not scored.any():
        raise ValueError("the assistant turns have no content tokens to score")
    return tokens, scored


def _token_ids(v, vocab: Optional[int]) -> List[int]:
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise ValueError('"tokens" must be a list of token ids (integers)')
    bad = [t for t in v if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ValueError(f'"tokens" has id {bad[0]}, outside the vocabulary (0 to '
                         f'{(vocab or 1) - 1})')
    return v


def prepare(req: Request, tokenizer, thinking: bool = True, content_only: bool = False,
            vocab: Optional[int] = None) -> ScoreItem:
    """The tokens and scored positions of one line; ValueError says why it cannot
    be scored. `vocab`: the model's embedding rows, which "tokens" must index."""
    spec = req.spec
    keys = set(spec)
    if keys not in TEXT_KEYS:
        raise ValueError('a line is {"id", "text"}, {"id", "prompt", "completion"}, '
                         '{"id", "messages"} or {"id", "tokens"} (got keys '
                         f'{", ".join(sorted(keys))})')
    if "tokens" in spec:
        item = ScoreItem.scored_from(req.id, _token_ids(spec["tokens"], vocab), 0)
    elif "text" in spec:
        item = ScoreItem.scored_from(req.id, tokenizer.encode(_string(spec, "text")), 0)
    elif "prompt" in spec:
        item = completion_item(req.id, tokenizer, _string(spec, "prompt"),
                               _string(spec, "completion"))
    else:
        tokens, scored = _messages(tokenizer, spec["messages"], thinking, content_only)
        scored[0] = False
        item = ScoreItem(req.id, [int(t) for t in tokens], scored)
    if not item.tokens:
        raise ValueError("nothing to score: no tokens")
    item.line = req.line
    return item


def completion_item(id, tokenizer, prompt: str, completion: str) -> ScoreItem:
    """A completion's tokens scored given its prompt's: the prompt encoded as a text
    is, the completion on its own with no special tokens (lm-eval's rule)."""
    prompt = list(tokenizer.encode(prompt))
    completion = list(tokenizer.encode(completion, add_special_tokens=False))
    if not completion:
        raise ValueError('"completion" has no tokens')
    return ScoreItem.scored_from(id, prompt + completion, len(prompt))
