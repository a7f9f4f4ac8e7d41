"""Every use of mlx-lm's private API, in one place.

Deltafin runs mlx-lm's own model classes, generation, prompt caches and server; a
few of the hooks it needs are not public. Each one is reached through a function
here, so that an mlx-lm release that moves one breaks this file, not the runtime.
`deltafin-run serve` (deltafin_mlx/server/) also subclasses mlx-lm's server
classes: it overrides `ModelProvider._load`, `APIHandler._set_completion_headers`,
`ResponseGenerator._run_generate`, `_next_request` and `_tokenize` (reading its
`requests` queue, `_stop` flag and `_generation_thread`), and BatchGenerator's
`_next` (use_server_batch_generator). Checked against mlx-lm 0.32.x (pyproject.toml pins `mlx-lm>=0.32.2,<0.33`).
"""

import mlx_lm.utils as _utils

CHECKED_VERSIONS = ">=0.32.2,<0.33"


def model_classes(config: dict):
    """(Model, ModelArgs) of the architecture config.json names (`model_type`)."""
    return _utils._get_classes(config)


def decode_tagged_floats(obj):
    """config.json as mlx-lm's load_config decodes it (tagged non-finite floats)."""
    return _utils._decode_tagged_floats(obj)


def server_prompt_tokens(response_generator, tokenizer, request, args):
    """A server request's prompt tokens, built as mlx-lm's generation thread builds them."""
    from mlx_lm.server import ResponseGenerator

    return ResponseGenerator._tokenize(response_generator, tokenizer, request, args)[0]


def gate_server_requests(check):
    """Make mlx_lm.server's generation thread pass every request it takes to
    `check(response_generator, args)` first (once per process): a request `check`
    raises on is answered with that error (mlx-lm's handler reports it) and never
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
            except ValueError as e:
                item[0].put(e)
                return None
        return item

    next_request._deltafin_gate = True
    ResponseGenerator._next_request = next_request


def use_server_batch_generator(cls):
    """Make mlx_lm.server's generation loop build its batches with `cls`, a
    BatchGenerator subclass (server/generation.py's turn_taking, which overrides
    `_next` and reads `_generation_batch`, `_unprocessed_sequences`,
    `_currently_processing` and `_counters`): the loop names the class that
    mlx_lm.server imported."""
    import mlx_lm.server as server

    server.BatchGenerator = cls


def server_generation_loop(response_generator):
    """mlx-lm's generation loop (its thread's body), run in the calling thread."""
    response_generator._generate()



def body_and_head(model):
    """(body, head) of an mlx-lm language model: `body(inputs, cache)` is its
    decoder stack up to the final norm, `head(h)` the logits, composed exactly as
    the model's own `__call__` composes them (a tied embedding as the head where
    there is no `lm_head`; K3 keeps both under `language_model`)."""
    lm = getattr(model, "language_model", model)
    body = lm.model
    head = getattr(lm, "lm_head", None)
    if head is None:
        head = body.embed_tokens.as_linear
    return body, head
