"""Small, format-faithful tokenizers for synthetic checkpoints and tests.

Kimi's (tiktoken.model and tokenizer_config.json, as K2 and K3 release them)
with a vocabulary learned here, and a byte-level BPE trained with the
`tokenizers` library in Qwen3's or Mixtral's layout.
"""

import base64
import json
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Dict, Tuple

import regex
from deltafin_mlx.tokenizer.kimi import KIMI_PATTERN, NUM_RESERVED_SPECIAL_TOKENS

# --- Kimi -------------------------------------------------------------------
# The real files' layout and special ids (shifted down to follow 768 ranks),
# a vocabulary learned from _TRAINING_TEXT.

# Named specials by offset from the first special id (163584 in the releases).
K3_SPECIAL_TOKENS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
K2_SPECIAL_TOKENS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}


# Kimi K2's chat template as released (moonshotai/Kimi-K2-Instruct, July 2025).
K2_CHAT_TEMPLATE = """\
{% if tools -%}
    {{ '<|im_system|>tool_declare<|im_middle|>' -}}
    {{- tools | tojson -}}
    {{ '<|im_end|>' -}}
{%- endif -%}

{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    {{ '<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>' }}
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    {{ '<|im_system|>system<|im_middle|>' }}
  {%- elif message['role'] == 'user' -%}
    {{ '<|im_user|>user<|im_middle|>' }}
  {%- elif message['role'] == 'assistant' -%}
    {{ '<|im_assistant|>assistant<|im_middle|>' }}
  {%- elif message['role'] == 'tool' -%}
    {{ '<|im_system|>tool<|im_middle|>' }}
  {%- endif -%}

  {%- if message['content'] is string -%}
    {{- message['content'] + '<|im_end|>' -}}
  {%- else -%}
    {%- for content in message['content'] -%}
      {%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
        {{ '<|media_start|>image<|media_content|><|media_pad|><|media_end|>' }}
      {%- else -%}
        {{ content['text'] }}
      {%- endif -%}
    {%- endfor -%}
    {{ '<|im_end|>' }}
  {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
  {{ '<|im_assistant|>assistant<|im_middle|>' }}
{%- endif -%}"""

# The fixture's ids: 768 base ranks then the 256 reserved specials, laid out
# like the release's 163584 + 256.
KIMI_TOKENIZER_SIZE = 1024
KIMI_BOS, KIMI_EOS, KIMI_END_OF_MSG, KIMI_MEDIA_PAD, KIMI_PAD = (
    768,
    769,
    770,
    789,
    1023,
)

# English, Chinese, emoji, numbers and code (the `def route` is text to learn
# from, not a function), so each of KIMI_PATTERN's branches gets merges.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog doesn't mind; it's
sleeping in the sun, and the fox is running through the forest again.
Mixture-of-experts models route every token to a few experts, so only a
small part of the weights is read for each token that the model generates.
We'll stream the experts from disk when they're needed and keep the rest of
the model in memory. Streaming, routing, reading, and caching: the model is
exact, and the results are the same as with all of the weights in memory.
Kimi K3 has 93 layers, 896 routed experts, 16 experts per token, and a
vocabulary of 163840 tokens; its context is 1048576 tokens long.
In 2024 and 2025 the numbers were 1, 2, 3, 10, 20, 30, 100, 200, 300, 123,
456, 789, 1000, 2048, 4096, 8192, 65536 and 3.14159; call 555-0123 at 09:30.

我们的模型从磁盘流式读取专家，只在需要的时候读取。模型很大，但是内存很小。
每个词元只会路由到少数几个专家，所以每一步只需要读取一小部分权重。
今天天气很好，我们一起去公园散步吧。中文、日本語和English可以混在一起写。
人工智能正在改变世界，语言模型可以写代码、翻译文章、回答问题。
北京、上海、广州和深圳都是中国的大城市。我们的模型在中国和世界各地都有用户。

Emoji: 🚀 launch, 🎉 party, 😀 smile, 👍 ok, ❤️ love, 🌍 world, 🔥 fire.
🚀🚀🚀 🎉🎉 😀😀 Unicode: café, naïve, résumé, Ünïcödé, Привет мир, Ελληνικά.

def route(scores, k=16):
    \"\"\"Return the top-k experts for each token.\"\"\"
    top = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
    return [(i, scores[i]) for i in top]

for layer in range(1, 93):
    experts = route(gate(hidden[layer]), k=16)
    if not experts:
        raise ValueError(f"layer {layer} has no experts")
    print(f"layer={layer} experts={len(experts)}")

{"model_type": "kimi_k3", "vocab_size": 163840, "num_experts": 896}
x += 1; y -= 2; z *= 3; return x == y and y != z || a <= b && c >= d;
"""


def _byte_pair_merge(parts, ranks):
    """tiktoken's BPE: merge the lowest-ranked adjacent pair until none is left."""
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


@lru_cache(maxsize=1)
def _learn_kimi_ranks(num_merges=512):
    """256 byte ranks, then num_merges merges learned from _TRAINING_TEXT.

    Words are split by KIMI_PATTERN, and after each merge they are encoded
    again the way tiktoken encodes (the new rank is the highest, so this only
    continues the last encoding), so every learned token is reachable: BPE on
    its own bytes ends in that one token.
    """
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(regex.findall(KIMI_PATTERN, _TRAINING_TEXT, flags=regex.V1))
    words = {tuple(bytes([b]) for b in w.encode()): n for w, n in words.items()}
    for _ in range(num_merges):
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            raise ValueError("the training text is too short for the merges")
        # Most frequent first; ties by bytes, so the result is deterministic.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        token = best[0] + best[1]
        ranks[token] = len(ranks)
        words = {
            tuple(_byte_pair_merge(list(w), ranks)) if _can_merge(w, token) else w: n
            for w, n in words.items()
        }
    return ranks


def _can_merge(word, token):
    # By bytes, as tiktoken merges: another split of the token's bytes counts.
    return any(a + b == token for a, b in zip(word, word[1:]))


def write_kimi_tokenizer_files(out_dir, flavor="k3"):
    """Write a small Kimi tokenizer (tiktoken.model, tokenizer_config.json).

    768 BPE ranks, then the 256 reserved special ids with the release's names
    at the release's offsets ("k3": XTML markers; "k2": K2's chat tokens and
    its Jinja chat template). Returns the vocabulary size, 1024.
    """
    if flavor not in ("k3", "k2"):
        raise ValueError(f"unknown flavor {flavor!r}; use 'k3' or 'k2'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = _learn_kimi_ranks()
    lines = [
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()
    ]
    (out_dir / "tiktoken.model").write_text("".join(lines))

    first = len(ranks)
    names = K3_SPECIAL_TOKENS if flavor == "k3" else K2_SPECIAL_TOKENS
    added_tokens = {
        str(first + offset): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, name in names.items()
    }
    config = {
        "added_tokens_decoder": added_tokens,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": (
            1048576 if flavor == "k3" else 1000000000000000019884624838656
        ),
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    if flavor == "k2":
        config["additional_special_tokens"] = [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "[EOT]",
            "<|im_system|>",
            "<|im_middle|>",
        ]
        config["chat_template"] = K2_CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return first + NUM_RESERVED_SPECIAL_TOKENS


# --- byte-level BPE (qwen3_moe, mixtral) --------------------------------------

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts routes each
token to a few of many feed-forward networks, so a model can hold far more
parameters than it spends on any one token. The router scores every expert,
keeps the top k, and mixes their outputs with the normalized scores.
Weights are stored in shards: safetensors files with a JSON header, then the
raw bytes of each tensor, one after another. An index maps every tensor name to
the shard that holds it.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536 3.14159 -7 +8 1e-5.
Punctuation and code: (a, b) = [x * 2 for x in range(10)]; {"key": "value"}!
def forward(self, x): return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))
Cafe, cafe, naive, resume; déjà vu, über, señor, 東京, 你好世界, Привет.
Questions? Answers! Lists: first, second, third. Tabs	and  spaces   too.
"""

# Qwen2/Qwen3's pre-tokenizer split.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MIXTRAL_SPECIALS = ("<unk>", "<s>", "</s>")
_QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_MIXTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def write_bpe_tokenizer_files(out: Path, arch: str) -> Tuple[int, Dict[str, int]]:
    """Train a small byte-level BPE and write tokenizer.json and
    tokenizer_config.json. Returns (vocab size, special token ids)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    # Qwen splits with its own regex first; GPT-2's built-in one otherwise.
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=arch != "qwen3_moe"
    )
    if arch == "qwen3_moe":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_QWEN_SPLIT), "isolated"), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Mixtral's specials come first (ids 0, 1, 2); Qwen's follow the vocab.
    specials = _MIXTRAL_SPECIALS if arch == "mixtral" else _QWEN_SPECIALS
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(specials) if arch == "mixtral" else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    if arch != "mixtral":
        tok.add_special_tokens(list(specials))
    ids = {s: tok.token_to_id(s) for s in specials}
    if arch == "mixtral":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ids["<s>"])]
        )
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s, i in ids.items()
    }
    if arch == "qwen3_moe":
        config = {
            "add_bos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added,
            "bos_token": None,
            "chat_template": _QWEN_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 40960,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
    else:
        config = {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": added,
            "bos_token": "<s>",
            "chat_template": _MIXTRAL_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": "</s>",
            "model_max_length": 32768,
            "pad_token": None,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "unk_token": "<unk>",
        }
    with open(out / "tokenizer_config.json", "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return tok.get_vocab_size(), ids
