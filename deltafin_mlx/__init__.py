"""Deltafin: run Mixture-of-Experts models far larger than memory, exactly, with MLX.

    import deltafin_mlx
    model, tokenizer = deltafin_mlx.load("path/to/converted", memory_budget="8GB")
    print(deltafin_mlx.generate(model, tokenizer, "Hello", max_tokens=64).text)
"""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

try:
    from deltafin_mlx.batch import batch_generate
    from deltafin_mlx.chat import ChatSession
    from deltafin_mlx.engine.load import load, open_tokenizer
    from deltafin_mlx.engine.runtime import find_runtime, runtime
    from deltafin_mlx.errors import DeltafinError
    from deltafin_mlx.format.model_dir import open_model_dir
    from deltafin_mlx.generate import Completion, RunStats, generate, stream_generate
    from deltafin_mlx.score.job import score
except KeyboardInterrupt:  # Ctrl-C while MLX and mlx-lm import (seconds): one line
    import sys

    print("\ndeltafin: interrupted", file=sys.stderr)
    raise SystemExit(130) from None

__all__ = ["load", "open_model_dir", "open_tokenizer", "runtime", "find_runtime", "generate", "stream_generate",
           "batch_generate", "score", "ChatSession", "Completion", "RunStats", "DeltafinError"]
