"""The lm-evaluation-harness model "deltafin" (mlx_lm/evaluate.py is the model
adapter this follows): `pip install "deltafin[eval]"`, then

    deltafin-lm-eval --model deltafin --model_args model=DIR,budget=24GB --tasks hellaswag

`deltafin-lm-eval` (or `python -m deltafin_mlx.jobs.lm_eval_model`) is lm-eval's own
command line with this model registered: lm-eval 0.4 finds models in its own list
and in modules already imported, not in other packages' entry points, so the
stock `lm_eval` command cannot see it. In Python, import this module and call
`lm_eval.simple_evaluate(model="deltafin", model_args="model=DIR", ...)`.

The requests run through Deltafin's jobs, so the experts stream once per pass:
    loglikelihood          (context, continuation) pairs tokenized and scored as
                           the {"prompt", "completion"} lines of a score job are
                           (deltafin_mlx.score: the same values), many per pass,
                           the choices of one context packed one after another,
                           so they share passes
    loglikelihood_rolling  lm-eval's rolling windows of max_length tokens (every
                           token predicted once, with the most context a window
                           holds), scored many per pass as perplexity's windows are
    generate_until         batch_generate: decoded together, stop strings and
                           max_gen_toks per request

model_args: model (a directory written by deltafin-convert; `pretrained`, lm-eval's
key for hf and vllm, is taken for it), budget (as --budget),
context (tokens of KV cache per sequence, 4096), max_length (tokens per rolling
window; default: context), max_gen_toks (256, unless a task gives its own).

This module needs lm-eval; `import deltafin_mlx` never imports it.
"""

from typing import List, Optional, Tuple

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.errors import JobError, RequestError
from deltafin_mlx.generation.engine import untemplated
from deltafin_mlx.generation.request import MAX_TOKENS, integer
from deltafin_mlx.jobs.batch import batch_generate
from deltafin_mlx.jobs.score import ScoreOptions, Sizing, iter_passes, within
from deltafin_mlx.jobs.score_lines import ScoreItem, completion_item


KNOWN_ARGS = "model (or pretrained), budget, context, max_length, max_gen_toks, activation_dtype"


def tokens(name: str, value) -> int:
    """A model_args count of tokens: a whole number, at least 1."""
    try:
        return integer({name: value}, name, 1, MAX_TOKENS)
    except RequestError as e:
        raise JobError(f"deltafin model_args: {e}") from None


@register_model("deltafin")
class DeltafinLM(LM):
    def __init__(self, model: Optional[str] = None, pretrained: Optional[str] = None,
                 budget: Optional[str] = None,
                 context: int = 4096, max_length: Optional[int] = None, max_gen_toks: int = 256,
                 activation_dtype: str = "auto", batch_size=None, max_batch_size=None,
                 device=None, **unused):
        # lm-eval passes its --batch_size, --max_batch_size and --device to every
        # model: here the memory plan sizes passes and batches, and MLX picks the device.
        super().__init__()
        if unused:
            raise JobError(f"deltafin model_args: unknown {', '.join(sorted(unused))} "
                           f"(known: {KNOWN_ARGS})")
        if model is not None and pretrained is not None and str(model) != str(pretrained):
            raise JobError(f"deltafin model_args: model and pretrained name two models; give "
                           f"one (known: {KNOWN_ARGS})")
        model = model if model is not None else pretrained
        if model is None:
            raise JobError(f"deltafin model_args: model=DIR is missing, a directory written "
                           f"by deltafin-convert (known: {KNOWN_ARGS})")
        self.max_gen_toks = tokens("max_gen_toks", max_gen_toks)
        max_length = None if max_length is None else tokens("max_length", max_length)
        self.path = str(model)
        # as many sequences as the budget allows, for generate_until's batches; `load`
        # checks the budget and the context (plan/memory.py check_context)
        self.model, self.tokenizer = load(self.path, budget, context=context, sequences="auto",
                                          warm_start=False, activation_dtype=activation_dtype)
        self.context = context
        self.max_length = max_length or context

    @property
    def tokenizer_name(self) -> str:
        return self.path.replace("/", "__")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "has_chat_template", False):  # as run and serve do
            return untemplated(chat_history)
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    def _prefix_token(self) -> int:
        """What an empty context is: the tokenizer's BOS, or its EOS (lm-eval's EOT)."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    def _check(self, result: dict) -> dict:
        if "error" in result:
            raise JobError(f"deltafin: a request cannot run: {result['error']}")
        return result

    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        items, contexts = [], []
        limit = Sizing(self.model).limit
        for n, (context, continuation) in enumerate(r.args for r in requests):
            try:  # the tokens deltafin_mlx.score gives a {"prompt", "completion"} line
                if context:
                    item = completion_item(n, self.tokenizer, context, continuation)
                else:  # lm-eval's rule: the continuation given the end-of-text token alone
                    cont = self.tokenizer.encode(continuation, add_special_tokens=False)
                    item = ScoreItem.scored_from(n, [self._prefix_token(), *cont], 1)
                items.append(within(item, limit))
            except ValueError as e:
                raise JobError(f"deltafin: a request cannot run: line {n + 1}: {e}") from None
            contexts.append(context)
        out = [None] * len(requests)
        # a context's choices share passes
        for results, _ in iter_passes(self.model, items, ScoreOptions(), groups=contexts):
            for s in results:
                out[s.item.id] = (s.logprob, s.greedy)
        return out

    def loglikelihood_rolling(self, requests) -> List[float]:
        items, owner = [], []
        for n, (text,) in enumerate(r.args for r in requests):
            tokens = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
            windows = get_rolling_token_windows(token_list=tokens,
                                                prefix_token=self._prefix_token(),
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                items.append(ScoreItem.scored_from(len(items), [*context, *continuation],
                                                   len(context)))
                owner.append(n)
        totals = [0.0] * len(requests)
        for results, _ in iter_passes(self.model, items, ScoreOptions()):
            for s in results:
                totals[owner[s.item.id]] += s.logprob
        return totals

    def generate_until(self, requests) -> List[str]:
        lines = []
        for context, kwargs in (r.args for r in requests):
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temp = float(kwargs.get("temperature", 0.0) or 0.0)
            if not kwargs.get("do_sample", temp > 0):
                temp = 0.0
            lines.append({"prompt": context, "stop": until, "temp": temp,
                          "max_tokens": int(kwargs.get("max_gen_toks", self.max_gen_toks))})
        results = batch_generate(self.model, self.tokenizer, lines, raw=True,
                                 context=self.context,
                                 batch_size=runtime(self.model).plan.sequences)
        return [self._check(r)["text"] for r in results]


def main():
    """lm-eval's command line, with the "deltafin" model registered (above)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
