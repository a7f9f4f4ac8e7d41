"""Every use of mlx-lm's private API, in one place.

Deltafin runs mlx-lm's own model classes, generation, prompt caches and server; a
few of the hooks it needs are not public. Each one is reached through a function
here, so that an mlx-lm release that moves one breaks this file, not the runtime.
`deltafin-run serve` also subclasses mlx-lm's server classes and overrides
`ModelProvider._load`. Checked against mlx-lm 0.32.x (pyproject.toml pins `mlx-lm>=0.32.2,<0.33`).
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


def run_http_server(host, port, response_generator, handler_class):
    """mlx-lm's HTTP server loop with a handler class of our own."""
    import mlx_lm.server as server

    server._run_http_server(host, port, response_generator, handler_class=handler_class)


def send_completion_headers(handler, status: int):
    """The headers mlx-lm's handler sends before a completion body."""
    handler._set_completion_headers(status)


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
