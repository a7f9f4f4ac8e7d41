"""Deltafin: run Mixture-of-Experts models far larger than memory, exactly, with MLX.

    import deltafin_mlx
    model, tokenizer = deltafin_mlx.load("path/to/converted", memory_budget="8GB")
    print(deltafin_mlx.generate(model, tokenizer, "Hello", max_tokens=64).text)

The front door is lazy: importing the package loads nothing heavy (no MLX, no
mlx-lm); each name below imports its stage's module when it is first used.
"""

from deltafin_mlx._version import __version__

# name -> the module that defines it
_EXPORTS = {"load": "deltafin_mlx.engine.load",
            "open_tokenizer": "deltafin_mlx.engine.load",
            "runtime": "deltafin_mlx.engine.runtime",
            "find_runtime": "deltafin_mlx.engine.runtime",
            "open_model_dir": "deltafin_mlx.format.model_dir",
            "generate": "deltafin_mlx.generation.engine",
            "stream_generate": "deltafin_mlx.generation.stream",
            "Completion": "deltafin_mlx.generation.engine",
            "RunStats": "deltafin_mlx.generation.stream",
            "batch_generate": "deltafin_mlx.jobs.batch",
            "score": "deltafin_mlx.jobs.score",
            "ChatSession": "deltafin_mlx.chat.session",
            "DeltafinError": "deltafin_mlx.errors"}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltafin_mlx' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except KeyboardInterrupt:  # Ctrl-C while MLX and mlx-lm import (seconds): one line
        import sys

        print("\ndeltafin: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


class _MovedModules:
    """Model directories converted before the stage folders name the drop-in as
    `deltafin_mlx.mlx_lm_shim` in their deltafin_model.py (a file the manifest seals):
    that name still imports the drop-in (the same module object), so they load unchanged."""

    MOVED = {"deltafin_mlx.mlx_lm_shim": "deltafin_mlx.dropin.shim"}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in cls.MOVED:
            return None
        import importlib.machinery

        return importlib.machinery.ModuleSpec(name, cls)

    @classmethod
    def create_module(cls, spec):
        import importlib

        return importlib.import_module(cls.MOVED[spec.name])

    @staticmethod
    def exec_module(module):
        pass


def _install_moved_modules():
    import sys

    if not any(f is _MovedModules for f in sys.meta_path):
        sys.meta_path.append(_MovedModules)


_install_moved_modules()
