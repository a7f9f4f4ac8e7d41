"""How long a score job takes to prepare one `messages` line of N exchanges (its
tokens and the assistant turns' mask), with the test K3 tokenizer or, with --jinja, the
tests' Qwen tokenizer and its ChatML (Jinja) template: the rendering before the model is
used (docs/PERFORMANCE.md, "Preparing a conversation for `score`").

    python -m bench.studies.messages_prepare [--jinja] [N ...]     (default: 25 100 200)
"""

import sys
import tempfile
import time
from pathlib import Path


def conversation(exchanges: int) -> list:
    msgs = []
    for i in range(exchanges):
        msgs += [{"role": "user", "content": f"question {i} about the experts"},
                 {"role": "assistant", "content": f"answer {i}: they stream from disk"}]
    return msgs


def main(argv=None) -> int:
    from mlx_lm.utils import load_tokenizer

    from deltafin_mlx.jobs.batch_lines import Request
    from deltafin_mlx.jobs.score_lines import prepare
    from deltafin_mlx.testing.tokenizers import (write_bpe_tokenizer_files,
                                                 write_kimi_tokenizer_files)
    from deltafin_mlx.tokenizer.kimi import load_kimi_tokenizer

    args = list(sys.argv[1:] if argv is None else argv)
    jinja = "--jinja" in args
    sizes = [int(a) for a in args if a != "--jinja"] or [25, 100, 200]
    with tempfile.TemporaryDirectory() as tmp:
        if jinja:
            (Path(tmp) / "tok").mkdir()
            write_bpe_tokenizer_files(Path(tmp) / "tok", "qwen3_moe")
        else:
            write_kimi_tokenizer_files(Path(tmp) / "tok", flavor="k3")
        for n in sizes:
            tok = (load_tokenizer if jinja else load_kimi_tokenizer)(Path(tmp) / "tok")
            start, cpu = time.perf_counter(), time.process_time()
            item = prepare(Request("1", 1, 1, spec={"id": 1, "messages": conversation(n)}), tok)
            print(f"{n} exchanges: {len(item.tokens):,} tokens, {item.scored_tokens:,} scored, "
                  f"prepared in {time.perf_counter() - start:.2f} s "
                  f"({time.process_time() - cpu:.2f} s CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
