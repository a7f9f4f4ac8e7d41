"""Scoring input lines: what each line asks to score, as tokens and a mask.

    {"id": ..., "text": "..."}                      every token of the text (no template)
    {"id": ..., "prompt": "...", "completion": "..."}  the completion's tokens, given the prompt
    {"id": ..., "messages": [...]}                  the chat template applied; the
                                                    assistant turns' tokens scored

Lines are read as batch jobs read them (batch_requests.read_requests: JSON objects with a
string or integer id, duplicate ids refused before anything runs); a line that
cannot be scored becomes an error line, never a stopped job. The first token of a
sequence has no prediction, so it is never scored.
"""

from dataclasses import dataclass
from typing import List

import numpy as np

from deltafin_mlx.jobs.batch_lines import Request
from deltafin_mlx.generation.stream import chat_prompt, common_prefix
from deltafin_mlx.tokenizer.messages import chat_messages

TEXT_KEYS = ({"id", "text"}, {"id", "prompt", "completion"}, {"id", "messages"})


@dataclass
class ScoreItem:
    request: Request
    tokens: List[int]
    scored: np.ndarray  # (len(tokens),) bool: positions whose token is scored

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


def _messages(tokenizer, msgs, thinking: bool):
    """Tokens of the conversation and the mask of its assistant turns: a turn's
    tokens run from where the conversation before it, with the generation prompt,
    stops matching, to the end of the conversation rendered up to it."""
    msgs = chat_messages(msgs)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not turns:
        raise ValueError('"messages" has no assistant turn to score')
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError('"messages" need a chat template, which this tokenizer has none of')
    tokens = _render(tokenizer, msgs, False, thinking)
    scored = np.zeros(len(tokens), dtype=bool)
    for i in turns:
        upto = _render(tokenizer, msgs[: i + 1], False, thinking)
        if tokens[: len(upto)] != upto:
            raise ValueError("the chat template does not render the conversation up to an "
                             "assistant turn as a prefix of the whole; score it as \"text\"")
        start = common_prefix(tokens, _render(tokenizer, msgs[:i], True, thinking))
        scored[start : len(upto)] = True
    return tokens, scored


def prepare(req: Request, tokenizer, thinking: bool = True) -> ScoreItem:
    """The tokens and scored positions of one line; ValueError says why it cannot
    be scored."""
    spec = req.spec
    keys = set(spec)
    if keys not in TEXT_KEYS:
        raise ValueError('a line is {"id", "text"}, {"id", "prompt", "completion"} or '
                         f'{{"id", "messages"}} (got keys {", ".join(sorted(keys))})')
    if "text" in spec:
        tokens = list(tokenizer.encode(_string(spec, "text")))
        scored = np.ones(len(tokens), dtype=bool)
    elif "prompt" in spec:
        prompt = list(tokenizer.encode(_string(spec, "prompt")))
        completion = list(tokenizer.encode(_string(spec, "completion"),
                                           add_special_tokens=False))
        if not completion:
            raise ValueError('"completion" has no tokens')
        tokens = prompt + completion
        scored = np.arange(len(tokens)) >= len(prompt)
    else:
        tokens, scored = _messages(tokenizer, spec["messages"], thinking)
    if not tokens:
        raise ValueError("nothing to score: no tokens")
    scored[0] = False
    return ScoreItem(req, [int(t) for t in tokens], scored)
