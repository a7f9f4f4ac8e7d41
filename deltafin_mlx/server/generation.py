"""mlx-lm's server classes as `deltafin-run serve` runs them: its ModelProvider over
the model serve loaded, and:

`ResilientGenerator`: an exception inside mlx-lm's generation loop fails the
requests that loop had taken (known by their response queues; each gets the error,
answered HTTP 500) and the loop starts again, serving those still queued: one request
never stops generation for every client (mlx-lm's own thread dies, /health 503).
It also splits a chat prompt with no system message of its own where the chat
template's preamble ends (K3's opens every conversation with a long system message
of its own): mlx-lm's prompt cache keeps the state at a segment's end, so each new
conversation starts from the cached preamble. A prompt is always prefilled in the
same segments, cached or not, so a reply is the same either way. And it scores
prompts (`score`: echo, prompt_logprobs) on its own thread between generation
steps, so a scoring pass never runs beside a step on the same model: every request
waiting to be scored when the thread gets to them is packed into the same passes
(jobs/score.py `iter_passes`, the rule `score` runs by).

`TurnTakingBatchGenerator`: mlx-lm's batch generator runs a pass of the next prompt
in the same call as the decode step and hands the step's tokens out only after it,
so each client already generating would wait a whole pass per token, and a client
whose prompt was just prefilled one more for its first token; this one takes turns.
"""

import json
import logging
import threading
import weakref
from dataclasses import dataclass, field
from queue import Queue
from typing import List

from mlx_lm.generate import BatchGenerator
from mlx_lm.server import CompletionRequest, ModelProvider, ResponseGenerator

from deltafin_mlx import compat
from deltafin_mlx.generation.engine import batchable
from deltafin_mlx.generation.stream import common_prefix
from deltafin_mlx.jobs.score import ScoreOptions, iter_passes
from deltafin_mlx.jobs.score_lines import ScoreItem

log = logging.getLogger("deltafin_mlx.server")

PREAMBLES = 16  # preambles kept (one per set of template arguments and tools)


class GenerationFailed(RuntimeError):
    """The generation loop raised while this request was in it."""


class LoadedModelProvider(ModelProvider):
    """mlx-lm's ModelProvider over the model `deltafin-run serve` loaded: every
    request gets it, whatever model name the client sent."""

    def __init__(self, cli_args, model, tokenizer):
        super().__init__(cli_args)
        self.model_key = ("default_model", None, None)
        self.model, self.tokenizer = model, tokenizer
        self.processor, self.draft_model = None, None
        self.is_batchable = batchable(model)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        return self.model, self.tokenizer


@dataclass
class ScoreJob:
    """One request's texts to score, and where their scores (or the error) go."""
    items: List[ScoreItem]
    top_k: int
    answer: Queue = field(default_factory=Queue)


class ResilientGenerator(compat.ResponseGeneratorHooks, ResponseGenerator):
    """mlx-lm's ResponseGenerator whose loop restarts after an exception (the
    requests it had taken get GenerationFailed) and whose chat prompts are split
    after the template's preamble (compat.ResponseGeneratorHooks)."""

    def __init__(self, model_provider, prompt_cache, on_restart=None):
        # The requests the running loop has taken, by their response queues: a
        # queue nobody holds any more (its request is over) drops out by itself.
        self.taken = weakref.WeakSet()
        self.taken_lock = threading.Lock()
        self.on_restart = on_restart
        self.preambles = {}  # (template arguments, tools) -> the preamble's tokens
        self.score_jobs = []  # ScoreJobs not yet taken by the generation thread
        self.score_lock = threading.Lock()
        super().__init__(model_provider, prompt_cache)

    def score(self, items: List[ScoreItem], top_k: int) -> list:
        """Each item's Scored (jobs/score_sweep.py), in order, from passes the
        generation thread runs between its steps, shared with every other
        request waiting to be scored then."""
        job = ScoreJob(items, top_k)
        if not self.generation_available():
            raise self.thread_stopped()
        with self.score_lock:
            self.score_jobs.append(job)
        self.wake_for_side_work()
        answer = self._await_response(job.answer)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def side_work(self):
        """The scoring jobs waiting, their texts packed into passes together (on
        the generation thread); a failure fails those jobs only."""
        with self.score_lock:
            jobs, self.score_jobs = self.score_jobs, []
        if not jobs:
            return
        items, owner = [], []
        for j, job in enumerate(jobs):
            for i, it in enumerate(job.items):
                items.append(ScoreItem((j, i), it.tokens, it.scored))
                owner.append(j)
        answers = [[None] * len(job.items) for job in jobs]
        try:
            opts = ScoreOptions(top_logprobs=max(job.top_k for job in jobs))
            for done, _ in iter_passes(self.model_provider.model, items, opts):
                for s in done:
                    j, i = s.item.id
                    answers[j][i] = s
        except Exception as e:  # noqa: BLE001 - the requests get it, generation goes on
            log.error("scoring failed (%s: %s)", type(e).__name__, str(e)[:300])
            failed = GenerationFailed(f"scoring failed ({type(e).__name__}); other requests "
                                      "are unaffected")
            for job in jobs:
                job.answer.put(failed)
            return
        for job, answer in zip(jobs, answers):
            job.answer.put(answer)

    def request_taken(self, response_queue):
        with self.taken_lock:
            self.taken.add(response_queue)

    def loop_failed(self, error):
        log.error("generation failed (%s: %s); its requests get the error and "
                  "generation goes on", type(error).__name__, str(error)[:300])
        with self.taken_lock:
            taken = list(self.taken)
            self.taken.clear()
        failed = GenerationFailed(f"generation failed ({type(error).__name__}); "
                                  "other requests are unaffected")
        for response_queue in taken:
            response_queue.put(failed)
        if self.on_restart is not None:
            self.on_restart()

    def thread_stopped(self):
        return GenerationFailed("the generation thread has stopped")

    def generate(self, request, generation_args, progress_callback=None):
        """mlx-lm's generate; a stopped generation thread is a GenerationFailed."""
        if not self.generation_available():
            raise self.thread_stopped()
        return super().generate(request, generation_args, progress_callback)

    def split_prompt(self, tokenizer, request, args, segments, types):
        """A chat whose first message is the user's: its first segment split where
        the template's preamble ends, so the prompt cache keeps the preamble."""
        if request.request_type == "chat" and types[0] == "user":
            n = common_prefix(self.preamble(tokenizer, request, args), segments[0])
            if 0 < n < len(segments[0]):
                return [segments[0][:n], segments[0][n:], *segments[1:]], ["system", *types]
        return segments, types

    def preamble(self, tokenizer, request, args):
        """What the template puts before a conversation's first user message
        and its text: the template rendered for one empty user message."""
        key = json.dumps([args.chat_template_kwargs, request.tools], sort_keys=True, default=str)
        if key not in self.preambles:
            empty = CompletionRequest("chat", "", [{"role": "user", "content": ""}],
                                      request.tools, request.role_mapping)
            prompt = compat.server_prompt_tokens(self, tokenizer, empty, args)
            if len(self.preambles) >= PREAMBLES:
                self.preambles.clear()
            self.preambles[key] = prompt
        return self.preambles[key]


class TurnTakingBatchGenerator(compat.BatchGeneratorTurns, BatchGenerator):
    """mlx-lm's BatchGenerator whose `next()` does either one decode step of the
    sequences generating or one prefill pass of the prompt being admitted, in
    turns, when there are both; so a decode step's tokens reach their clients
    before the next pass runs. Each step is mlx-lm's own (compat.BatchGeneratorTurns)."""

    decode_next = True  # after a prefill pass: its first token goes out at once

    def turn(self, generating: int, prefilling: bool, full: bool) -> str:
        if not generating or not prefilling or full:
            self.decode_next = True
            return "both"
        step = "decode" if self.decode_next else "prefill"
        self.decode_next = not self.decode_next
        return step
