"""Reading a directory's tokenizer, validated and checked against the model it is
for: what `deltafin-run` loads (through engine/load.py, after checking the files) and
what the converter reads from a source before any work."""

from pathlib import Path

from deltafin_mlx import compat
from deltafin_mlx.errors import ModelError, TokenizerError
from deltafin_mlx.model.config import eos_token_ids, text_config
from deltafin_mlx.tokenizer.coverage import check_tokenizer


def read_tokenizer(path: Path, kind: str, config: dict):
    """The tokenizer in `path` (kind "kimi_tiktoken" or "huggingface"), validated
    (tokenizer/kimi.py) and checked against the model (tokenizer/coverage.py: every
    byte encodable, no id beyond the embedding table). The converter reads a
    source's with it too, so a model that could not run is never written. Whatever
    a tokenizer library raises, Rust panics included, becomes one ModelError line."""
    eos = eos_token_ids(config)
    try:
        if kind == "kimi_tiktoken":
            from deltafin_mlx.tokenizer.kimi import load_kimi_tokenizer

            tokenizer = load_kimi_tokenizer(path, eos_token_ids=eos)
        else:
            from mlx_lm.tokenizer_utils import load as load_hf_tokenizer

            from deltafin_mlx.tokenizer.jinja import BoundedSandbox

            compat.bound_chat_templates(BoundedSandbox)  # every template's bounds
            # Remote code off, always: transformers would otherwise ask on a terminal
            # (or read the answer from stdin) and run a module the model carries.
            tokenizer = load_hf_tokenizer(Path(path), {"trust_remote_code": False},
                                          eos_token_ids=eos)
        check_tokenizer(tokenizer, text_config(config).get("vocab_size"), path)
        return tokenizer
    except (KeyboardInterrupt, SystemExit):
        raise
    except ModelError:
        raise
    except TokenizerError as e:
        raise ModelError(str(e)) from None
    except BaseException as e:  # tokenizers/tiktoken raise odd types (pyo3 panics)
        raise ModelError(f"{path}: cannot load the tokenizer ({type(e).__name__}: "
                         f"{str(e)[:200]})") from None
