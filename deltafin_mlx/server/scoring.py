"""Prompts scored by `deltafin-run serve`, in the shapes their clients read:

- `echo` on /v1/completions (OpenAI's legacy API, vLLM, lm-eval's
  `local-completions`): the prompt's text before the reply's, and in `logprobs`
  the prompt's tokens (`tokens`, `token_logprobs` with the first null,
  `top_logprobs`, `text_offset`) followed by the generated ones.
- vLLM's `prompt_logprobs` (an int N), on both endpoints: per prompt position a map
  of token id to {logprob, rank, decoded_token} holding the prompt's token and the
  top N, the first position null; in the choice on /v1/completions, at the top of a
  chat's response.

The values are `score`'s: the prompts go through the generation thread's scoring
passes (server/generation.py `ResilientGenerator.score`, jobs/score.py's rule).
With `max_tokens` 0, or 1 decoded greedily, the reply needs no generation: its
token is the argmax after the prompt, read from the same pass (the prompt is
scored with one more position, a placeholder token whose own score is dropped).
OpenAI's logprobs blocks of generated tokens (`logprobs_block`) live here too.
"""

import functools
import time
import uuid
from itertools import accumulate
from typing import List

from deltafin_mlx.generation.engine import finished
from deltafin_mlx.generation.render import Render, opens_thinking
from deltafin_mlx.jobs.score_lines import ScoreItem

PLACEHOLDER = 0  # the token after a prompt whose next token is read from the pass


def token_texts(tokenizer):
    """A token id's text, each id decoded once (a block's ids repeat)."""
    return functools.lru_cache(maxsize=None)(lambda token: tokenizer.decode([int(token)]))


def logprobs_block(tokenizer, tokens, logprobs, top_tokens, legacy: bool):
    """OpenAI's logprobs of a reply: per generated token its own logprob and the
    top alternatives, best first (ties by id). `legacy`: /v1/completions' shape
    (tokens, token_logprobs, top_logprobs as {text: logprob}, text_offset), where
    alternatives that decode to the same text (pieces of one UTF-8 character all
    decode to U+FFFD) share one key, holding the best of their logprobs; every
    alternative, with its id, is in `top_tokens` (as chat's top_logprobs entries)."""
    tops = []
    for i in range(len(tokens)):
        top = top_tokens[i] if i < len(top_tokens) else ()
        tops.append(sorted(top, key=lambda t: (-t["logprob"], t["id"])))
    text_of = token_texts(tokenizer)
    texts = [text_of(t) for t in tokens]

    def entry(token, text, logprob):
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "id": token}

    if legacy:
        offsets = [0, *accumulate(map(len, texts))][:len(texts)]  # where each token's text starts
        alternatives = [[entry(x["id"], text_of(x["id"]), x["logprob"])
                         for x in top] for top in tops]
        merged = []
        for top in alternatives:
            by_text = {}
            for x in top:  # best first: a shared text keeps the best logprob
                by_text.setdefault(x["token"], x["logprob"])
            merged.append(by_text)
        return {"tokens": texts, "token_ids": list(tokens), "token_logprobs": list(logprobs),
                "top_logprobs": merged if any(tops) else None,
                "top_tokens": alternatives if any(tops) else None,
                "text_offset": offsets}

    return {"content": [
        {**entry(t, s, lp), "top_logprobs": [entry(x["id"], text_of(x["id"]),
                                                   x["logprob"]) for x in top]}
        for t, s, lp, top in zip(tokens, texts, logprobs, tops)]}


def answered_by_the_pass(request, default_temp: float) -> bool:
    """Whether the reply needs no generation: nothing to generate, or one token
    chosen greedily (the argmax, which nothing in the request moves)."""
    if request.max_tokens == 0:
        return True
    temp = default_temp if request.temperature is None else request.temperature
    return (request.max_tokens == 1 and temp == 0 and not request.logit_bias
            and not request.repetition_penalty and not request.presence_penalty
            and not request.frequency_penalty)


def items(prompts: List[List[int]], next_token: bool) -> List[ScoreItem]:
    """Each prompt's tokens scored (all but the first), with the placeholder after
    it where its next token is read from the pass."""
    return [ScoreItem.scored_from(i, [*t, *[PLACEHOLDER] * next_token], 1)
            for i, t in enumerate(prompts)]


def top_at(scored, position: int, k: int) -> list:
    """The top `k` at a position, best first, as {"id", "logprob"}."""
    if k == 0 or scored.top_ids is None:
        return []
    return [{"id": int(i), "logprob": float(v)}
            for i, v in zip(scored.top_ids[position][:k], scored.top_logprobs[position][:k])]


def prompt_logprobs(tokenizer, tokens: List[int], scored, k: int) -> list:
    """vLLM's `prompt_logprobs` of a prompt: per position its token and the top `k`,
    each {logprob, rank, decoded_token} by id (the top K ranked 1..K); the first
    position null."""
    out, text_of = [None], token_texts(tokenizer)
    for p in range(1, len(tokens)):
        own = {int(tokens[p]): {"logprob": float(scored.token_logprobs[p]),
                                "rank": int(scored.ranks[p]),
                                "decoded_token": text_of(tokens[p])}}
        for rank, x in enumerate(top_at(scored, p, k), 1):
            own.setdefault(x["id"], {"logprob": x["logprob"], "rank": rank,
                                     "decoded_token": text_of(x["id"])})
        out.append(own)
    return out


def echo_logprobs(tokenizer, tokens: List[int], scored, k: int, generated: List[int]):
    """The legacy logprobs block of the prompt's tokens (the first with none)
    followed by `generated` (at most the one token read from the pass)."""
    positions = range(len(tokens) + len(generated))
    block = logprobs_block(
        tokenizer, [*tokens, *generated],
        [None, *(float(scored.token_logprobs[p]) for p in positions[1:len(tokens)]),
         *(float(scored.top_logprobs[len(tokens)][0]) for _ in generated)],
        [[], *(top_at(scored, p, k) for p in positions[1:])], legacy=True)
    for key in ("top_logprobs", "top_tokens"):
        if block[key] is not None:
            block[key][0] = None
    return block


def joined(echo: dict, reply: dict, shift: int) -> dict:
    """Two legacy blocks one after the other: the prompt's, then the reply's
    (its text offsets after the prompt's `shift` characters)."""
    out = {}
    for key, first in echo.items():
        second = reply.get(key)
        if key == "text_offset":
            second = [o + shift for o in second]
        out[key] = None if first is None or second is None else [*first, *second]
    return out


def greedy_reply(tokenizer, request, prompt: List[int], token: int):
    """(answer, thinking, finish_reason) of a reply of one token after `prompt`,
    ended as generation ends it (engine.py `finished`): the model's stop token
    shows nothing and says "stop", as does a stop string; else "length"."""
    render = Render(tokenizer, opens_thinking(tokenizer, prompt), request.stop or ())
    pieces, reason = finished(render, token, "stop" if token in tokenizer.eos_token_ids
                              else "length")
    answer = "".join(p for c, p in pieces if c == "answer")
    return answer, "".join(p for c, p in pieces if c != "answer"), reason


def pass_response(handler, request, chat: bool, prompts: list, tokens: List[List[int]],
                  scored: list, next_token: bool) -> dict:
    """The whole response of prompts answered by the pass (answered_by_the_pass)."""
    tok, want = handler.settings.tokenizer, request.top_logprobs if request.logprobs else 0
    choices, entries = [], []
    for i, (prompt, t, s) in enumerate(zip(prompts, tokens, scored)):
        generated = [int(s.top_ids[len(t)][0])] if next_token else []
        reply, thinking, reason = (greedy_reply(tok, request, t, generated[0]) if generated
                                   else ("", "", "length"))
        if request.prompt_logprobs is not None:
            entries.append(prompt_logprobs(tok, t, s, request.prompt_logprobs))
        if chat:
            lp = None
            if request.logprobs and generated:
                lp = logprobs_block(tok, generated, [float(s.top_logprobs[len(t)][0])],
                                    [top_at(s, len(t), want)], legacy=False)
            message = {"role": "assistant", "content": reply,
                       **({"reasoning": thinking} if thinking else {})}  # as mlx-lm's
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": reason})
            continue
        text = (prompt if isinstance(prompt, str) else tok.decode(t)) if request.echo else ""
        lp = None
        if request.logprobs:
            lp = (echo_logprobs(tok, t, s, want, generated) if request.echo else
                  logprobs_block(tok, generated, [float(s.top_logprobs[len(t)][0])] *
                                 len(generated), [top_at(s, len(t), want)] * len(generated),
                                 legacy=True))
        choice = {"index": i, "text": text + reply, "logprobs": lp, "finish_reason": reason}
        if entries:
            choice.update(prompt_logprobs=entries[-1], prompt_token_ids=t)
        choices.append(choice)
    prompt_count = sum(map(len, tokens))
    reply_count = len(tokens) * next_token
    response = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": handler.settings.model_id,
                "system_fingerprint": handler.system_fingerprint, "choices": choices,
                "usage": {"prompt_tokens": prompt_count, "completion_tokens": reply_count,
                          "total_tokens": prompt_count + reply_count}}
    if chat and entries:
        response.update(prompt_logprobs=entries[0], prompt_token_ids=tokens[0])
    return response


def attach(response: dict, tokenizer, request, chat: bool, prompt: str, tokens: List[int],
           scored):
    """A generated response (mlx-lm's) with its prompt's scores: `prompt_logprobs`,
    and with `echo` the prompt before the reply's text and logprobs."""
    choice = response["choices"][0]
    if request.prompt_logprobs is not None:
        entries = prompt_logprobs(tokenizer, tokens, scored, request.prompt_logprobs)
        (response if chat else choice).update(prompt_logprobs=entries, prompt_token_ids=tokens)
    if request.echo:
        if choice.get("logprobs"):
            want = request.top_logprobs if request.logprobs else 0
            choice["logprobs"] = joined(echo_logprobs(tokenizer, tokens, scored, want, []),
                                        choice["logprobs"], len(prompt))
        choice["text"] = prompt + choice["text"]
    return response
