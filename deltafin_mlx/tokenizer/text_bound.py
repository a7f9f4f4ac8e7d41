"""How much text a context can hold, known before anything is tokenized: no token
of the vocabulary is longer than `longest_token_bytes`, so text of more UTF-8 bytes
than the context times that cannot fit. `serve` bounds request bodies with it,
`batch` each line's prompt and `score` each line, so a huge prompt is refused before the tokenizer (and
its memory) ever sees it."""


def longest_token_bytes(tokenizer, vocab: int) -> int:
    """The most UTF-8 bytes one token's text can have (a token that is part of
    a character decodes to U+FFFD, 3 bytes: an overestimate, which only loosens
    the bound)."""
    longest = 4
    decode = tokenizer.decode
    for i in range(vocab):
        try:
            longest = max(longest, len(decode([i]).encode("utf-8", "surrogatepass")))
        except Exception:  # noqa: BLE001 - ids the tokenizer does not map
            continue
    return longest


def max_text_bytes(tokenizer, vocab: int, context: int) -> int:
    """UTF-8 bytes of text beyond which a prompt cannot fit `context` tokens."""
    return context * longest_token_bytes(tokenizer, vocab)


JSON_ESCAPE = 6  # the most bytes JSON spends on one byte of text (\u0001)
JSON_SLACK = 64 << 10  # JSON structure around the text


def max_json_bytes(text_limit: int) -> int:
    """The most bytes a JSON request (a serve body, a job's line) holding at most
    `text_limit` bytes of text can take: a longer one is refused unread."""
    return text_limit * JSON_ESCAPE + JSON_SLACK


def text_bytes(value) -> int:
    """UTF-8 bytes of every string value in a JSON value."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total
