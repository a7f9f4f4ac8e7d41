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

import functools
from bisect import bisect_right
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


def _render(tokenizer, messages, add_generation_prompt: bool, thinking: bool, tokenize=True):
    return chat_prompt(tokenizer, messages, thinking=thinking,
                       add_generation_prompt=add_generation_prompt, tokenize=tokenize)


def _messages(tokenizer, msgs, thinking: bool, content_only: bool = False):
    """Tokens of the conversation and the mask of its assistant turns, each turn's
    as `_turn` defines it, found in time linear in the conversation where the
    template allows (`_turns_of_one_render`, `_turns_of_one_text`)."""
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
    bounds = _turns_of_one_text(tokenizer, msgs, turns, tokens, thinking, content_only) or [
        _turn(tokenizer, msgs, tokens, i, thinking, content_only) for i in turns]
    scored = np.zeros(len(tokens), dtype=bool)
    for start, end in bounds:
        scored[start:end] = True
    if not scored.any():
        raise ValueError("the assistant turns have no content tokens to score")
    return tokens, scored


def _turn(tokenizer, msgs, tokens, i, thinking: bool, content_only: bool):
    """(start, end) of assistant turn i's scored tokens in the conversation's
    `tokens`, by the definition, each prefix rendered on its own: a turn's tokens
    run from where the conversation before it, with the generation prompt, stops
    matching, to the end of the conversation rendered up to it. Its content's
    tokens (`content_only`) are those where the turn rendered with its content and
    rendered with none differ: whatever the template puts around the content (the
    end-of-turn token, thinking markers) renders in both."""
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
    return start, end


# The turns `_turns_of_one_text` checks against `_turn`: the first two, the last.
CHECKED_TURNS = (0, 1, -1)


def _turns_of_one_text(tokenizer, msgs, turns, tokens, thinking: bool, content_only: bool):
    """`_turn`'s bounds of every turn from the conversation rendered once as text
    (and once more with each content a numbered mark, which shows where each
    content renders), or None where the template does not render that way (the
    caller then renders each prefix). What the template puts after a message's
    content when it ends the conversation (with the generation prompt or without)
    is taken from one render of the first conversation that ends in a message of
    its kind (role, tool calls), and must follow it in the whole wherever a turn
    ends. The text is tokenized in windows cut where each turn's message starts and
    ends, which must give the conversation's tokens; a prefix with the generation
    prompt, or a turn rendered empty, is then its windows' tokens and its last
    window's with what differs. The first two and the last turn are checked against
    `_turn`: what renders a message by its place, not by what it holds, is found
    there (or where its end differs) and rendered turn by turn."""
    if len(turns) <= len(CHECKED_TURNS) or turns[0] == 0:
        return None
    text = lambda ms, gen: _render(tokenizer, ms, gen, thinking, tokenize=False)  # noqa: E731
    whole = text(msgs, False)
    used = set(whole)  # a mark's delimiter is a private-use character the text lacks
    edge = next((chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used), None)
    if edge is None:
        return None
    marks = [f"{edge}{j}{edge}" for j in range(len(msgs))]
    marked = text([{**m, "content": marks[j]} for j, m in enumerate(msgs)], False)
    between, at = [], 0  # what the template renders between contents
    for mark in marks:
        k = marked.find(mark, at)
        if k < 0:
            return None
        between.append(marked[at:k])
        at = k + len(mark)
    between.append(marked[at:])
    spans, at = [], 0  # spans[j]: where message j's content renders in `whole`
    for m, piece, following in zip(msgs, between, between[1:]):
        if not following or not whole.startswith(piece, at):
            return None
        a = at + len(piece)  # the content as it renders (a template may trim it)
        b = a + len(m["content"]) if whole.startswith(m["content"] + following, a) \
            else whole.find(following, a)
        if b < 0:
            return None
        spans.append((a, b))
        at = b
    if whole[at:] != between[-1]:
        return None
    learned = {}

    def after(j, gen):  # what follows message j's content where it ends the conversation
        key = (msgs[j]["role"], bool(msgs[j].get("tool_calls")), gen)
        if key not in learned:
            t, b = text(msgs[: j + 1], gen), spans[j][1]
            learned[key] = t[b:] if t[:b] == whole[:b] else None
        return learned[key]

    stops, cuts = [], {0, len(whole)}  # where the conversation up to each turn ends
    for i in turns:
        tail, before = after(i, False), after(i - 1, False)
        if tail is None or after(i - 1, True) is None or not whole.startswith(tail, spans[i][1]) \
                or (stops and spans[i][1] + len(tail) <= stops[-1]):
            return None
        stops.append(spans[i][1] + len(tail))
        if before is not None and whole.startswith(before, spans[i - 1][1]):
            cuts.add(spans[i - 1][1] + len(before))  # where the turn's message starts
    cuts, first, pieces = sorted(cuts | set(stops)), {0: 0}, []
    encode = functools.lru_cache(None)(lambda s: tokenizer.encode(s, add_special_tokens=False))
    for a, b in zip(cuts, cuts[1:]):
        pieces += encode(whole[a:b])
        first[b] = len(pieces)
    if pieces != list(tokens):
        return None

    def window(pos, rest):  # whole[:pos] + rest: (the token its last window starts at, the
        m = common_prefix(whole[pos : pos + len(rest)], rest)  # window's tokens)
        w = cuts[bisect_right(cuts, pos + m) - 1]
        return first[w], encode(whole[w : pos + m] + rest[m:])

    bounds = []
    for i, stop in zip(turns, stops):
        t, asked = window(spans[i - 1][1], after(i - 1, True))
        start, end = t + common_prefix(tokens[t : t + len(asked)], asked), first[stop]
        if content_only:
            t, empty = window(spans[i][0], after(i, False))
            start = max(start, t + common_prefix(tokens[t:end], empty))
            end -= _common_suffix(tokens, end, t, empty)
        bounds.append((start, end))
    for k in CHECKED_TURNS:
        if bounds[k] != _turn(tokenizer, msgs, tokens, turns[k], thinking, content_only):
            return None
    return bounds


def _common_suffix(tokens, end, t, rest) -> int:
    """common_prefix of tokens[:end] and tokens[:t] + rest, both reversed."""
    n, i, j = 0, end - 1, t + len(rest) - 1
    while i >= 0 and j >= 0:
        if i == j and j < t:  # the same tokens from here back
            return n + i + 1
        if tokens[i] != (tokens[j] if j < t else rest[j - t]):
            break
        n, i, j = n + 1, i - 1, j - 1
    return n


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
