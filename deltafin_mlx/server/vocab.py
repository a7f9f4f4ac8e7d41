"""The served model's vocabulary size: rows of its embedding table, which token
ids index (a tokenizer may know more ids than the model has rows)."""


def model_vocab(model) -> int:
    from deltafin_mlx.model.modules import find_path, get_module

    embed = get_module(model, find_path(model, "embed_tokens"))
    return getattr(type(embed), "vocab_size", None) or embed.weight.shape[0]
