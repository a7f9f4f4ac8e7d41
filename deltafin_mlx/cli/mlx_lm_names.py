"""mlx-lm's flag names, for the users who type them out of habit: each is answered
with what Deltafin calls the same thing, in the one usage-error line (options.Parser).

A flag that means the same here is an alias instead (`--max-tokens`, `--top-k`);
a row is a name mlx-lm's commands take that no Deltafin command takes as such."""

# (mlx-lm's names, the commands the row is for (None: all), what to type instead)
MLX_LM_FLAGS = (
    (("--model", "--hf-path"), {"deltafin-convert"}, "SRC is the first argument, not an option"),
    (("--model", "--hf-path"), None, "MODEL is the first argument, not an option"),
    (("--mlx-path",), None, "OUT is deltafin-convert's second argument, not an option"),
    (("--prompt", "-p"), {"bench"}, "--prompt-tokens"),
    (("--prompt", "-p"), None, "the prompt is the argument after MODEL: "
     "deltafin-run MODEL \"PROMPT\""),
    (("-m",), {"serve"}, "--max-tokens"),
    (("-m",), None, "-n (or --max-tokens)"),
    (("--generation-tokens", "-g"), None, "-n (the tokens decoded per run)"),
    (("--num-trials",), None, "--repeats (bench's -n is the tokens decoded per run, not "
     "mlx_lm.benchmark's trials)"),
    (("--system-prompt",), None, "--system"),
    (("--ignore-chat-template",), None, "--raw"),
    (("--max-kv-size",), None, "--context N (the tokens of KV cache to reserve)"),
    (("-q", "--quantize"), None, "deltafin-convert quantizes float weights by default "
     "(--bits, --expert-bits; --no-trunk-quant keeps the trunk in float)"),
    (("--q-bits",), None, "--bits (the trunk) and --expert-bits (the experts)"),
    (("--q-group-size",), None, "--group-size (the trunk) and --expert-group-size (the "
     "experts)"),
    (("--trust-remote-code",), None, "Deltafin runs no code a model carries: drop it"),
)


def mlx_lm_hint(prog: str, message: str) -> str:
    """What to type instead of the mlx-lm names an "unrecognized arguments" (or
    "ambiguous option") usage error names, as text to add to its line ("" when it
    names none)."""
    if message.startswith("unrecognized arguments:"):
        given_flags = message.split(":", 1)[1].split()
    elif message.startswith("ambiguous option:"):  # serve's --prompt: --prompt-cache-*
        given_flags = message.split()[2:3]
    else:
        return ""
    command = prog.split()[-1]
    hints, seen = [], set()
    for given in given_flags:
        flag = given.split("=", 1)[0]
        for names, where, instead in MLX_LM_FLAGS:
            if flag in names and (where is None or command in where) and flag not in seen:
                seen.add(flag)
                hints.append(f"mlx-lm's {flag}: {instead}")
                break
    return "".join(f"; {h}" for h in hints)
