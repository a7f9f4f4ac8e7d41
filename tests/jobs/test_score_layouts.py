"""Teacher distributions in trainers' layouts: score's lines carry per-position top-K
ids (integers) and log-probabilities (normalised over the whole vocabulary) as
separate arrays, each position's tail mass, and their input line; `deltafin-run
export` writes them as a parquet dataset that `datasets` loads, in input order, with
ms-swift's column names, aligned as a model's logits are (row t predicts token t+1);
results written in the layout before (pairs) export the same."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import deltafin_mlx
from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.score import ScoreOptions, run_job

from test_score import read_lines, texts, write_lines

K = 4


def log_softmax(model, tokens) -> np.ndarray:
    """The model's logits for `tokens` alone, log-softmaxed in float64 by numpy."""
    logits = np.array(model(mx.array([tokens]))[0].astype(mx.float32)).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def scored(converted, tmp_path_factory):
    """A score job over texts of varied lengths (a bad line among them), in passes
    of at most 40 tokens, so its sweep packs the longest first: (the model, the
    tokenizer, the input rows, OUT)."""
    tmp = tmp_path_factory.mktemp("layouts")
    model, tok = load(converted("qwen3_moe"), "200MB", warm_start=False)
    rows = [{"id": i, "text": t} for i, t in
            enumerate([texts(1, words=w, seed=w)[0] for w in (4, 14, 6, 20, 9, 5)])]
    rows.insert(3, {"id": "bad", "txt": "no such key"})
    rows.append({"id": "pc", "prompt": "the experts", "completion": " stream from disk"})
    inp, out = tmp / "in.jsonl", tmp / "out.jsonl"
    write_lines(inp, rows)
    run_job(model, tok, inp, out, ScoreOptions(top_logprobs=K, max_pass_tokens=40),
            show_progress=False)
    yield model, tok, rows, out
    runtime(model).close()


def test_lines_carry_their_input_line_and_top_k_as_separate_arrays(scored):
    """OUT is in pass order, not input order (the sweep took the longest texts
    first), and every line, error lines too, names IN's line it answers; top_ids
    are integer lists, top_logprobs float lists, null where not scored."""
    _, _, rows, out = scored
    lines = read_lines(out)
    assert sorted(l["line"] for l in lines) == list(range(1, len(rows) + 1))
    assert [l["line"] for l in lines] != sorted(l["line"] for l in lines)
    for l in lines:
        assert rows[l["line"] - 1]["id"] == l["id"]
        if "error" in l:
            continue
        assert len(l["top_ids"]) == len(l["top_logprobs"]) == len(l["tail_logprob"]) \
            == len(l["tokens"])
        for lp, ids, vals in zip(l["token_logprobs"], l["top_ids"], l["top_logprobs"]):
            if lp is None:
                assert ids is None and vals is None
                continue
            assert len(ids) == len(vals) == K and all(type(i) is int for i in ids)
            assert all(type(v) is float for v in vals) and vals == sorted(vals, reverse=True)


def test_tail_is_the_mass_outside_the_top_k(scored):
    """tail_logprob = log(1 - sum of the top K's probabilities) at every scored
    position, and equals that mass in an independent log-softmax of the model's
    logits; with K the whole vocabulary, the top K hold all of it."""
    model, tok, _, out = scored
    for l in read_lines(out):
        if "error" in l:
            continue
        want = log_softmax(model, l["tokens"])
        for p, vals in enumerate(l["top_logprobs"]):
            if vals is None:
                continue
            tail = l["tail_logprob"][p]
            assert abs(tail - np.log(1 - np.exp(np.float64(vals)).sum())) < 1e-6
            rest = np.delete(want[p - 1], l["top_ids"][p])
            assert abs(np.exp(tail) - np.exp(rest).sum()) < 1e-5
    whole = deltafin_mlx.score(model, tok, ["the experts stream"], top_logprobs=10 ** 6)[0]
    assert len(whole["top_ids"][1]) == log_softmax(model, whole["tokens"]).shape[-1]
    assert all(t is None or np.exp(t) < 1e-4 for t in whole["tail_logprob"])


def test_parquet_export_loads_with_datasets_and_matches_score(scored, tmp_path):
    """`deltafin-run export` writes one row per scored text in input order; datasets
    loads it with integer ids; row t of teacher_topk_* is score's position t+1
    (the token it predicts), exactly score's values and within 1e-5 of an
    independent log-softmax of the model's logits; labels are the tokens, -100
    where not scored; the last row and unscored ones are null."""
    import datasets
    import pyarrow as pa

    model, _, rows, out = scored
    parquet = tmp_path / "teacher.parquet"
    assert main(["export", str(out), "-o", str(parquet)]) == 0
    ds = datasets.load_dataset("parquet", data_files=str(parquet), split="train",
                               cache_dir=str(tmp_path / "hf"))
    schema = ds.data.schema
    assert pa.types.is_integer(schema.field("teacher_topk_indices").type.value_type.value_type)
    assert pa.types.is_integer(schema.field("input_ids").type.value_type)
    assert pa.types.is_string(schema.field("id").type)  # ints and a string id: text
    want = {json.dumps(l["id"]) if isinstance(l["id"], int) else l["id"]: l
            for l in read_lines(out) if "error" not in l}
    assert ds["id"] == [json.dumps(r["id"]) if isinstance(r["id"], int) else r["id"]
                        for r in rows if r["id"] != "bad"]
    for row in ds:
        w = want[row["id"]]
        tokens = w["tokens"]
        assert row["input_ids"] == tokens
        assert row["labels"] == [t if lp is not None else -100
                                 for t, lp in zip(tokens, w["token_logprobs"])]
        lp = log_softmax(model, tokens)
        assert row["teacher_topk_indices"][-1] is None
        for t in range(len(tokens) - 1):
            ids, vals = row["teacher_topk_indices"][t], row["teacher_topk_logprobs"][t]
            assert ids == w["top_ids"][t + 1]
            if ids is None:
                assert row["labels"][t + 1] == -100
                continue
            assert row["labels"][t + 1] == tokens[t + 1]
            assert np.array_equal(np.float32(vals), np.float32(w["top_logprobs"][t + 1]))
            assert np.float32(row["teacher_tail_logprob"][t]) == np.float32(w["tail_logprob"][t + 1])
            assert np.abs(np.float64(vals) - lp[t][ids]).max() < 1e-5
            assert ids[0] == int(np.argmax(lp[t]))
            assert abs(w["token_logprobs"][t + 1] - lp[t][tokens[t + 1]]) < 1e-5


def test_results_in_the_layout_before_export_the_same(scored, tmp_path):
    """Lines written before (top_logprobs as [id, logprob] pairs, no top_ids, tail
    or line) export the same rows: the tail by the same rule."""
    import pyarrow.parquet as pq

    _, _, _, out = scored
    old = []
    for l in read_lines(out):
        l = dict(l)
        l.pop("line")
        if "error" not in l:
            l["top_logprobs"] = [None if ids is None else [[i, v] for i, v in zip(ids, vals)]
                                 for ids, vals in zip(l.pop("top_ids"), l["top_logprobs"])]
            del l["tail_logprob"]
        old.append(l)
    write_lines(tmp_path / "old.jsonl", old)
    assert main(["export", str(out), "-o", str(tmp_path / "new.parquet")]) == 0
    assert main(["export", str(tmp_path / "old.jsonl"), "-o", str(tmp_path / "old.parquet")]) == 0
    new = {r["id"]: r for r in pq.read_table(tmp_path / "new.parquet").to_pylist()}
    again = {r["id"]: r for r in pq.read_table(tmp_path / "old.parquet").to_pylist()}
    assert new == again


def export_cli(*args, block_pyarrow=False, stdin=None):
    code = ("import sys\n"
            + ("sys.modules['pyarrow'] = None\n" if block_pyarrow else "")
            + "from deltafin_mlx.cli.main import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "export", *map(str, args)],
                          capture_output=True, text=True, timeout=120, stdin=stdin)


def test_results_from_stdin_export_as_from_the_file(scored, tmp_path):
    """`-` reads score's results from stdin (a pipe), kept as any job's input is."""
    import pyarrow.parquet as pq

    _, _, _, out = scored
    assert main(["export", str(out), "-o", str(tmp_path / "file.parquet")]) == 0
    with open(out, "rb") as f:
        r = export_cli("-", "-o", tmp_path / "pipe.parquet", stdin=f)
    assert r.returncode == 0, r.stderr
    assert pq.read_table(tmp_path / "pipe.parquet").to_pylist() == \
        pq.read_table(tmp_path / "file.parquet").to_pylist()


def test_a_line_past_the_limit_is_refused_unread(tmp_path, monkeypatch, capsys):
    """No line of the results is held whole past LINE_MAX_BYTES (a hostile file of
    one endless line): the export stops at it in one line, writing nothing."""
    import deltafin_mlx.jobs.results_file as results_file
    import deltafin_mlx.jobs.score_export as score_export
    from deltafin_mlx.units import human_bytes

    monkeypatch.setattr(results_file, "LINE_MAX_BYTES", 4096)
    monkeypatch.setattr(score_export, "LINE_MAX_BYTES", 4096)
    scores = tmp_path / "s.jsonl"
    scores.write_text('{"id": 1, "tokens": [' + "5, " * 5000 + '5]}\n')
    assert main(["export", str(scores), "-o", str(tmp_path / "x.parquet")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"deltafin-run: error: {scores}: line 1 is longer than {human_bytes(4096)}: not "
        "score's results"]
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob(".*.tmp"))


def test_export_refusals_are_one_line(tmp_path):
    """Without pyarrow, the export says in one line how to install it; a file that
    is not a parquet file is never replaced; an index of shards, or results without
    a top K, cannot be exported."""
    scores = tmp_path / "s.jsonl"
    write_lines(scores, [{"id": 1, "line": 1, "tokens": [5, 6], "token_logprobs": [None, -1.0],
                          "logprob": -1.0, "scored_tokens": 1, "greedy": False}])
    cases = [
        ((scores, "-o", tmp_path / "x.parquet"), True, "pip install 'deltafin[distill]'"),
        ((scores, "-o", tmp_path / "x.parquet"), False, "score with --top-logprobs K"),
    ]
    keep = tmp_path / "notes.txt"
    keep.write_text("mine")
    cases.append(((scores, "-o", keep), False, "is not a parquet file"))
    index = tmp_path / "i.jsonl"
    write_lines(index, [{"id": 1, "shard": "i.jsonl.00000.safetensors", "offset": 0}])
    cases.append(((index, "-o", tmp_path / "y.parquet"), False, "--format safetensors"))
    for args, block, message in cases:
        r = export_cli(*args, block_pyarrow=block)
        assert r.returncode == 1 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert keep.read_text() == "mine"
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob(".*.tmp"))
