"""A KL reference comes from a file anyone can write: `--kl-divergence REF` checks
all of it before use (ids within the model's vocabulary, log-probabilities finite
and not positive, every tensor of the shape its windows give) and refuses a forged
one in one line, never a crash or a wrong KL; `--kl-divergence-base REF` never
replaces the text measured, a model's file or an existing file that is not a
reference."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from deltafin_mlx.cli.main import main

from helpers import one_line_error

WORDS = ("the experts stream from disk while the trunk stays in memory and every "
         "token routes to a few of them 12 34 def route(x): return x").split()


@pytest.fixture(scope="module")
def base(converted, tmp_path_factory):
    """A text and the qwen3_moe fixture's reference on it."""
    root = tmp_path_factory.mktemp("kl_checks")
    text, ref = root / "corpus.txt", root / "base.kld.safetensors"
    rng = np.random.default_rng(1)
    text.write_text("\n".join(" ".join(rng.choice(WORDS, size=13)) for _ in range(20)) + "\n")
    assert main(["perplexity", str(converted("qwen3_moe")), str(text), "-c", "48",
                 "--budget", "200MB", "--kl-top-k", "8", "--kl-divergence-base", str(ref)]) == 0
    return converted("qwen3_moe"), text, ref


def forged(ref, path, **changed):
    """A copy of the reference `ref` at `path`, with some tensors changed."""
    tensors = load_file(str(ref))
    with safe_open(str(ref), "np") as f:
        metadata = f.metadata()
    for name, change in changed.items():
        tensors[name] = change(tensors[name].copy())
    save_file(tensors, str(path), metadata=metadata)
    return path


def at(row, col, value):
    def change(a):
        a[row, col] = value
        return a
    return change


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def vocab_of(model) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("changed, says", [
    ({"top_ids": at(5, 0, -3)}, "a negative token id"),
    ({"top_logprobs": at(3, 1, np.nan)}, "top_logprobs holds a value that is not a log-prob"),
    ({"top_logprobs": at(3, 1, 9.0)}, "top_logprobs holds a value that is not a log-probability"),
    ({"tail_logprob": lambda a: np.where(np.arange(a.size) == 2, np.inf, a).astype(np.float32)},
     "tail_logprob holds a value that is not a log-probability"),
    ({"token_logprobs": lambda a: -a}, "token_logprobs holds a value that is not a log-prob"),
    ({"top_ids": lambda a: a[:-5], "top_logprobs": lambda a: a[:-5]},
     "its tensors' shapes are not those of its windows"),
    ({"tail_logprob": lambda a: a[:-1]}, "its tensors' shapes are not those of its windows"),
    ({"top_logprobs": lambda a: a[:, :-1]}, "its tensors' shapes are not those of its windows"),
    ({"tokens": lambda a: a[:-1]}, "its tensors' shapes are not those of its windows"),
    ({"top_ids": lambda a: a.astype(np.int64)}, "no 2-d I32 tensor top_ids"),
], ids=["negative id", "NaN log-probability", "positive log-probability", "infinite tail",
        "positive token log-probability", "fewer rows", "a short tail", "fewer columns",
        "fewer tokens", "ids of another dtype"])
def test_a_forged_reference_is_refused_in_one_line_before_the_model_loads(base, tmp_path,
                                                                         capsys, changed, says):
    model, text, ref = base
    bad = forged(ref, tmp_path / "forged.kld", **changed)
    assert main(["perplexity", str(model), str(text), "--budget", "200MB",
                 "--kl-divergence", str(bad)]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"deltafin-run: error: {bad}: not a KL reference written by "
                           "--kl-divergence-base (") and says in line, line


@pytest.mark.parametrize("bad_id", ["vocab", "1e9"])
def test_a_reference_id_outside_the_models_vocabulary_is_refused_not_gathered(base, tmp_path,
                                                                              bad_id):
    """An id the model has no logit for: gathered, 1e9 was a SIGSEGV and one just past
    the vocabulary a wrong KL with exit 0. Run as a process of its own (a crash
    must fail this test, not the test run)."""
    model, text, ref = base
    value = vocab_of(model) if bad_id == "vocab" else 10**9
    bad = forged(ref, tmp_path / "forged.kld", top_ids=at(5, 0, value))
    out = subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", "perplexity",
                          str(model), str(text), "--budget", "200MB", "--kl-divergence",
                          str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert (f"{bad}: token id {value} is outside this model's vocabulary (0 to "
            f"{vocab_of(model) - 1})") in one_line_error(out)


@pytest.mark.parametrize("target", ["the text", "config.json", "a new file in the model",
                                    "an existing text", "a FIFO", "a missing folder"])
def test_the_reference_written_never_replaces_the_text_the_models_files_or_other_files(
        base, tmp_path, capsys, target):
    model_src, text_src, _ = base
    model, text = tmp_path / "model", tmp_path / "corpus.txt"
    shutil.copytree(model_src, model)
    shutil.copy(text_src, text)
    other = tmp_path / "notes.txt"
    other.write_text("my notes\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path, says = {
        "the text": (text, f"{text}: this is the text measured"),
        "config.json": (model / "config.json", f"{model / 'config.json'}: this is in the "
                        "model directory"),
        "a new file in the model": (model / "tokenizer_config.json", "this is in the model "
                                    "directory"),
        "an existing text": (other, f"{other}: exists and is not a KL reference"),
        "a FIFO": (fifo, f"{fifo}: exists and is not a KL reference"),
        "a missing folder": (tmp_path / "nowhere" / "base.kld.safetensors",
                             f"{tmp_path / 'nowhere'} is not a folder this run can write"),
    }[target]
    def files():
        return {p: p.read_bytes() for p in (text, other, *model.rglob("*")) if p.is_file()}

    before = files()
    assert main(["perplexity", str(model), str(text), "-c", "48", "--budget", "200MB",
                 "--kl-divergence-base", str(path)]) == 1
    assert says in one_error_line(capsys)
    assert files() == before  # nothing replaced, nothing added


def test_an_existing_reference_is_replaced_by_a_new_one(base, tmp_path, capsys):
    model, text, ref = base
    again = tmp_path / "again.kld"
    shutil.copy(ref, again)
    with open(again, "r+b") as f:  # a reference of other values: replaced whole
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    assert main(["perplexity", str(model), str(text), "-c", "48", "--budget", "200MB",
                 "--kl-top-k", "8", "--kl-divergence-base", str(again)]) == 0
    assert again.read_bytes() == ref.read_bytes()
