"""Every use of mlx-lm's private API, in one place.

Deltafin runs mlx-lm's own model classes, generation, prompt caches and server; a
few of the hooks it needs are not public. PRIVATE lists every one the code reads
or overrides, and only this module touches them: its functions call or read them,
its mixins override them for the server's classes (server/generation.py,
server/handler.py), and it wraps them for the drop-in (dropin/guard.py).
tests/structure/test_mlx_lm_surface.py checks each against the installed mlx-lm,
so a release that renames one fails there, in one line naming it (`missing`).
Importing this module imports nothing of mlx-lm: each function imports it when
called, so the package's front door stays light. Checked against mlx-lm 0.32.x
(pyproject.toml pins `mlx-lm>=0.32.2,<0.33`).
"""

# (module, dotted name): mlx-lm's private or undocumented names Deltafin relies on.
# A name the class itself does not hold is an instance attribute its methods set
# (`self.NAME = ...`), which Deltafin reads or sets.
PRIVATE = (
    ("mlx_lm.utils", "_get_classes"),                   # model_classes
    ("mlx_lm.utils", "_decode_tagged_floats"),          # decode_tagged_floats
    ("mlx_lm.utils", "_FLOAT_TAG_KEY"),                 # its tag: FLOAT_TAG
    ("mlx_lm.tokenizer_utils", "TokenizerWrapper._tokenizer"),  # wrapped_tokenizer
    # server_prompt_tokens, gate_server_requests; the rest ResponseGeneratorHooks's:
    ("mlx_lm.server", "ResponseGenerator._tokenize"),
    ("mlx_lm.server", "ResponseGenerator._next_request"),
    ("mlx_lm.server", "ResponseGenerator._run_generate"),
    ("mlx_lm.server", "ResponseGenerator._generate"),
    ("mlx_lm.server", "ResponseGenerator._await_response"),
    ("mlx_lm.server", "ResponseGenerator._stop"),
    # server/generation.py overrides `generate` and ModelProvider.load, sets the
    # provider's fields; server/handler.py and dropin/guard.py read and override the
    # handler's (`_set_completion_headers`: set_completion_headers, CompletionStatusHook)
    ("mlx_lm.server", "ResponseGenerator.generate"),
    ("mlx_lm.server", "ResponseGenerator.generation_available"),
    ("mlx_lm.server", "ResponseGenerator.is_healthy"),
    ("mlx_lm.server", "ModelProvider.load"),
    ("mlx_lm.server", "ModelProvider.model_key"),
    ("mlx_lm.server", "ModelProvider.processor"),
    ("mlx_lm.server", "ModelProvider.draft_model"),
    ("mlx_lm.server", "ModelProvider.is_batchable"),
    ("mlx_lm.server", "APIHandler._set_completion_headers"),
    ("mlx_lm.server", "APIHandler.handle_completion"),
    ("mlx_lm.server", "APIHandler.validate_model_parameters"),
    ("mlx_lm.server", "APIHandler.generate_response"),
    ("mlx_lm.server", "APIHandler.completion_usage_response"),
    ("mlx_lm.server", "APIHandler.body"),
    ("mlx_lm.server", "APIHandler.stream"),
    ("mlx_lm.server", "APIHandler.max_tokens"),
    ("mlx_lm.server", "APIHandler.chat_template_kwargs"),
    ("mlx_lm.server", "APIHandler.response_generator"),
    ("mlx_lm.server", "BatchGenerator"),                # replaced: use_server_batch_generator
    ("mlx_lm.server", "stream_generate"),               # wrapped: use_server_stream_generate
    # BatchGeneratorTurns's; `prompt` wrapped by unread_logits_in_prompt_batches
    ("mlx_lm.generate", "BatchGenerator._next"),
    ("mlx_lm.generate", "BatchGenerator._generation_batch"),
    ("mlx_lm.generate", "BatchGenerator._prompt_batch"),
    ("mlx_lm.generate", "BatchGenerator._unprocessed_sequences"),
    ("mlx_lm.generate", "BatchGenerator._currently_processing"),
    ("mlx_lm.generate", "GenerationBatch.empty"),
    ("mlx_lm.generate", "PromptProcessingBatch.empty"),
    ("mlx_lm.generate", "PromptProcessingBatch.prompt"),
    ("mlx_lm.generate", "PromptProcessingBatch.model"),
    # transformers': its templates' sandbox class and compile cache (bound_chat_templates)
    ("transformers.utils.chat_template_utils", "ImmutableSandboxedEnvironment"),
    ("transformers.utils.chat_template_utils", "_compile_jinja_template"),
    # make_sampler's closure cells `sampling_methods` and `temp`: read by sampler_chain
    # (checked by tests/structure/test_mlx_lm_surface.py calling it)
    # generate_step's prefill loop, which never reads a chunk's logits: read by
    # prefill_chunk_follows (tests/engine/test_unread_last_layer.py runs it poisoned)
    # _tokenize's result, (prompt, segments, segment types, state, vision): read by
    # ResponseGeneratorHooks (tests/structure/test_mlx_lm_surface.py splits one)
)


def missing(names=PRIVATE) -> list:
    """The names of `names` the installed mlx-lm lacks, as "module:dotted.name"."""
    import importlib
    import inspect

    gone = []
    for module, dotted in names:
        try:
            obj = importlib.import_module(module)
        except ImportError:
            gone.append(f"{module}:{dotted}")
            continue
        *owners, name = dotted.split(".")
        for owner in owners:
            obj = getattr(obj, owner, None)
        if obj is None:
            gone.append(f"{module}:{dotted}")
        elif not hasattr(obj, name):
            # an instance attribute: one of the class's methods must set it
            source = inspect.getsource(obj) if inspect.isclass(obj) else ""
            if f"self.{name} =" not in source and f"self.{name}: " not in source:
                gone.append(f"{module}:{dotted}")
    return gone


def model_classes(config: dict):
    """(Model, ModelArgs) of the architecture config.json names (`model_type`)."""
    import mlx_lm.utils

    return mlx_lm.utils._get_classes(config)


FLOAT_TAG = "__float__"  # mlx_lm.utils._FLOAT_TAG_KEY (checked by the surface test)


def decode_tagged_floats(obj, raw: bytes = None):
    """config.json as mlx-lm's load_config decodes it (tagged non-finite floats).
    A config whose text `raw` holds no tag is returned as it is without importing
    mlx-lm, whose package imports its generation code and transformers: `list` and
    `plan` of a converted model stay light."""
    if raw is not None and FLOAT_TAG.encode() not in raw:
        return obj
    import mlx_lm.utils

    return mlx_lm.utils._decode_tagged_floats(obj)


def bound_chat_templates(sandbox):
    """Have transformers compile every chat template in `sandbox` (a subclass of its
    immutable sandbox: tokenizer/jinja.py's BoundedSandbox), rendering as before."""
    from transformers.utils import chat_template_utils

    if chat_template_utils.ImmutableSandboxedEnvironment is not sandbox:
        chat_template_utils.ImmutableSandboxedEnvironment = sandbox
        chat_template_utils._compile_jinja_template.cache_clear()


def prompt_cache_metadata(header_metadata: dict):
    """save_prompt_cache's metadata, from its file's safetensors header: the first of
    the [metadata, layer classes, scalars] it tree-flattens there."""
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(header_metadata.items()))[0]


def server_prompt_tokens(response_generator, tokenizer, request, args):
    """A server request's prompt tokens, built as mlx-lm's generation thread builds them."""
    from mlx_lm.server import ResponseGenerator

    return ResponseGenerator._tokenize(response_generator, tokenizer, request, args)[0]


def gate_server_requests(check):
    """Make mlx_lm.server's generation thread pass every request it takes to
    `check(response_generator, args)` first (once per process): a request `check`
    raises on (whatever it raises) is answered with that error (mlx-lm's handler reports it) and never
    reaches generation. Wraps ResponseGenerator._next_request, which hands the
    thread each (response queue, request, GenerationArguments)."""
    from mlx_lm.server import ResponseGenerator

    taken = ResponseGenerator._next_request
    if getattr(taken, "_deltafin_gate", False):
        return

    def next_request(self, timeout=None):
        item = taken(self, timeout)
        if item is not None:
            try:
                check(self, item[2])
            except Exception as e:  # noqa: BLE001 - the request gets it, never vanishes
                item[0].put(e)
                return None
        return item

    next_request._deltafin_gate = True
    ResponseGenerator._next_request = next_request


def use_server_batch_generator(cls):
    """Make mlx_lm.server's generation loop build its batches with `cls`, a
    BatchGenerator subclass (server/generation.py's TurnTakingBatchGenerator): the
    loop names the class that mlx_lm.server imported."""
    import mlx_lm.server as server

    server.BatchGenerator = cls


def wrapped_tokenizer(tokenizer):
    """The tokenizer mlx-lm's TokenizerWrapper wraps (its `_tokenizer`: names
    beginning with `_` are not forwarded to it), or `tokenizer` itself."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def set_completion_headers(handler, status: int):
    """mlx-lm's APIHandler starting a JSON answer with `status` (its CORS headers too)."""
    handler._set_completion_headers(status)


def use_server_stream_generate(wrap):
    """Make mlx_lm.server's single-sequence path (a model whose caches cannot be
    batched) call `wrap(stream_generate)` in place of mlx-lm's stream_generate,
    which mlx_lm.server imported by name (once per process)."""
    import mlx_lm.server as server

    current = server.stream_generate
    if getattr(current, "_deltafin_wrapped", False):
        return
    wrapped = wrap(current)
    wrapped._deltafin_wrapped = True
    wrapped.__wrapped__ = current
    server.stream_generate = wrapped


def prefill_chunk_follows(processed: int, total: int) -> bool:
    """Whether mlx-lm's `generate_step`, having reported `processed` of `total` prompt
    tokens to its prompt_progress_callback, next calls the model on a prefill chunk
    whose logits it never reads: its loop prefills while more than one token
    remains and evaluates only the caches; the last token goes through `_step`,
    whose logits it samples (checked against the installed mlx-lm by
    tests/engine/test_unread_last_layer.py, with poisoned outputs, for every MoE type)."""
    return total - processed > 1


def unread_logits_in_prompt_batches(set_unread):
    """Make mlx-lm's BatchGenerator tell the engine that nothing reads the logits of
    its prompt chunks (once per process): `PromptProcessingBatch.prompt` runs every
    chunk of every prompt but the last token, which its GenerationBatch decodes, and
    evaluates only the caches. The wrapper calls `set_unread(model, True)` before
    and `set_unread(model, False)` after, however the chunk ends (checked with
    poisoned outputs by tests/engine/test_unread_last_layer.py)."""
    from mlx_lm.generate import PromptProcessingBatch

    prompt = PromptProcessingBatch.prompt
    if getattr(prompt, "_deltafin_unread", False):
        return

    def wrapped(self, *args, **kwargs):
        set_unread(self.model, True)
        try:
            return prompt(self, *args, **kwargs)
        finally:
            set_unread(self.model, False)

    wrapped._deltafin_unread = True
    wrapped.__wrapped__ = prompt
    PromptProcessingBatch.prompt = wrapped


# What mlx-lm's classes call their token-embedding table, most common first:
# bailing's `word_embeddings`, phixtral's `wte`, nemotron_h's `embeddings`.
EMBEDDING_NAMES = ("embed_tokens", "word_embeddings", "wte", "embeddings")


def embedding_path(model):
    """The path of the table token ids index (where they enter the model), or None."""
    paths = [path for path, _ in model.named_modules()]
    return next((path for name in EMBEDDING_NAMES for path in paths
                 if path == name or path.endswith("." + name)), None)


def body_and_head(model):
    """(body, head) of an mlx-lm language model: `body(inputs, cache)` is its
    decoder stack up to the final norm, `head(h)` the logits, composed exactly as
    the model's own `__call__` composes them (a tied embedding as the head where
    there is no `lm_head`; K3 keeps both under `language_model`). A model whose
    `__call__` does more between them (phixtral builds its mask there) is its own
    body, with the logits as they come."""
    import functools

    lm = getattr(model, "language_model", model)
    body = getattr(lm, "model", None) or getattr(lm, "backbone", None)  # nemotron_h's
    if body is None:
        return (lambda inputs, cache: lm(inputs, cache=cache)), (lambda logits: logits)
    head = getattr(lm, "lm_head", None)
    if head is None:
        head = functools.reduce(getattr, embedding_path(body).split("."), body).as_linear
    return body, head


def sampler_chain(sampler):
    """(filters, temperature) of a sampler mlx-lm's `make_sampler` made: the
    filter steps it closed over, in its order, and the temperature of its final
    draw; (None, None) for its greedy sampler. A mlx-lm release that builds its
    sampler otherwise fails here, by name, never samples differently."""
    from mlx_lm.sample_utils import greedy_sampler

    if sampler is greedy_sampler:
        return [], None
    cells = dict(zip(sampler.__code__.co_freevars, (c.cell_contents for c in
                                                    sampler.__closure__ or ())))
    if "sampling_methods" not in cells or "temp" not in cells:
        raise RuntimeError("mlx_lm.sample_utils.make_sampler no longer closes over "
                           "'sampling_methods' and 'temp': generation/sampling.py's "
                           "KeyedSampler needs updating for this mlx-lm")
    return list(cells["sampling_methods"]), cells["temp"]


# --- mixins: each goes before mlx-lm's class in a server class's bases --------------


class ResponseGeneratorHooks:
    """For a mlx_lm.server.ResponseGenerator subclass defining `loop_failed(error)`
    (then mlx-lm's loop, `_generate`, runs again until `stop_and_join`),
    `request_taken(response_queue)` (each request the loop takes),
    `thread_stopped()` (the error raised where mlx-lm's `_await_response` finds its
    thread stopped) and `split_prompt(tokenizer, request, args, segments, types)`
    (a prompt's segments, where mlx-lm's prompt cache keeps state, unless it holds
    images; `_tokenize` returns (prompt, segments, types, state, vision)) and
    `side_work()` (run on mlx-lm's generation thread between its steps, once
    `wake_for_side_work()` has asked for it)."""

    _SIDE_WORK = ("side work",)  # on mlx-lm's queue of requests: not a request

    def wake_for_side_work(self):
        self.requests.put(self._SIDE_WORK)

    def _run_generate(self):
        while not self._stop:
            try:
                self._generate()
                return
            except Exception as e:  # noqa: BLE001 - the subclass decides
                self.loop_failed(e)

    def _next_request(self, timeout=None):
        item = super()._next_request(timeout)
        if item is self._SIDE_WORK:
            self.side_work()
            return None
        if item is not None:
            self.request_taken(item[0])
        return item

    def _await_response(self, response_queue):
        try:
            return super()._await_response(response_queue)
        except RuntimeError:  # mlx-lm's only one: its thread is not running
            raise self.thread_stopped() from None

    def _tokenize(self, tokenizer, request, args):
        prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
        if vision is None:
            segments, types = self.split_prompt(tokenizer, request, args, segments, types)
        return prompt, segments, types, state, vision


class BatchGeneratorTurns:
    """For a mlx_lm.generate.BatchGenerator subclass defining `turn(generating,
    prefilling, full)` -> "decode", "prefill" or "both": each step (`_next`) is
    mlx-lm's own, with the prompts set aside for a decode step alone and the
    generating sequences for a prefill pass alone (a prompt that finishes joins
    them). `full`: mlx-lm's step would only decode."""

    def _next(self):
        generating = self._generation_batch
        prefilling = bool(self._unprocessed_sequences or self._currently_processing)
        full = not self._currently_processing and len(generating) >= self.completion_batch_size
        step = self.turn(len(generating), prefilling, full)
        if step == "decode":
            return self.decode_alone()
        return self.prefill_alone() if step == "prefill" else super()._next()

    def decode_alone(self):
        from collections import deque

        from mlx_lm.generate import PromptProcessingBatch

        prompts = self._prompt_batch, self._unprocessed_sequences, self._currently_processing
        self._prompt_batch = PromptProcessingBatch.empty(self.model, self.sampler)
        self._unprocessed_sequences, self._currently_processing = deque(), []
        try:
            return super()._next()
        finally:
            self._prompt_batch, self._unprocessed_sequences, self._currently_processing = prompts

    def prefill_alone(self):
        from mlx_lm.generate import GenerationBatch

        generating = self._generation_batch
        self._generation_batch = GenerationBatch.empty(self.model, self.sampler)
        try:
            return super()._next()[0], []
        finally:
            joined, self._generation_batch = self._generation_batch, generating
            if len(joined):
                generating.extend(joined)


class CompletionStatusHook:
    """For a mlx_lm.server.APIHandler subclass defining `completion_status(status)`:
    the status its JSON answers start with (mlx-lm answers 404 to a request its
    generation refused)."""

    def _set_completion_headers(self, status_code: int = 200):
        super()._set_completion_headers(self.completion_status(status_code))
