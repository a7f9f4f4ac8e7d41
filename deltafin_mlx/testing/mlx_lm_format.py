"""A checkpoint in mlx-lm's own format, written by mlx-lm: what `mlx_lm.convert`
makes of a Hugging Face directory (the layout of every mlx-community repository).

Where mlx-lm can load the directory's tokenizer, `mlx_lm.convert` itself writes it.
Kimi's tiktoken tokenizer needs the release's remote code, which the synthetic
checkpoints do not ship, so for those the same steps are taken with mlx-lm's own
functions (load, cast, `quantize_model`, `save_model`, `save_config`) and the
tokenizer files are copied as they are.
"""

import shutil
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx.utils import tree_map_with_path


def write_mlx_lm_format(src, out, bits: Optional[int] = None, group_size: int = 64,
                        recipe: Optional[str] = None) -> Path:
    """`mlx_lm.convert` of `src` into `out`: float, or quantized at `bits` (affine,
    `group_size`), or with one of mlx-lm's mixed recipes ("mixed_3_6", ...)."""
    from mlx_lm.convert import convert, mixed_quant_predicate_builder
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src, out = Path(src), Path(out)
    quantize = bits is not None or recipe is not None
    if not (src / "tiktoken.model").exists():
        convert(str(src), str(out), quantize=quantize, q_bits=bits,
                q_group_size=group_size if quantize else None, quant_predicate=recipe)
        return out
    model, config = load_model(src, lazy=True)
    dtype = getattr(mx, config.get("torch_dtype") or config["text_config"]["dtype"])
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))
    if quantize:
        predicate = (mixed_quant_predicate_builder(recipe, model, group_size)
                     if recipe is not None else None)
        model, config = quantize_model(model, config, group_size, bits,
                                       quant_predicate=predicate)
    save_model(out, model, donate_model=True)
    save_config(config, config_path=out / "config.json")
    for p in src.iterdir():
        if p.is_file() and not p.name.startswith(("model", "config.json")):
            shutil.copy(p, out / p.name)
    return out
