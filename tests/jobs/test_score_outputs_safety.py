"""A job's output never costs the user a file: `score --format safetensors` names
its shards after the index's whole name and creates each without overwriting
anything, so two jobs in one folder, or a user's own `STEM.00000.safetensors`,
are left byte for byte as they were; only a shard of its own that no index line
names (what a kill leaves) is deleted. An output that is the input is refused; an
index whose "shard" is not a name, and a full disk, are one line naming the file,
with nothing half-written left behind."""

import hashlib
import json
import subprocess
from pathlib import Path

import pytest
from safetensors.numpy import load_file
from helpers import BIN, fill, small_filesystem

TEXTS = ["the experts stream from disk", "every token routes to a few experts",
         "a budget holds the trunk", "def route(x): return x"]


def write_lines(path, lines):
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))


def read_lines(path):
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def texts(ids):
    return [{"id": i, "text": TEXTS[i % len(TEXTS)]} for i in ids]


def deltafin(*args, timeout=300):
    return subprocess.run([str(BIN / "deltafin-run"), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


def score(model, inp, out, *more):
    return deltafin("score", model, inp, "-o", out, "--budget", "200MB", "--no-warm-start",
                    "--no-progress", *more)


def one_error_line(r):
    """The one error line (notes in brackets aside, such as an options record's)."""
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and not l.startswith("[")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def snapshot(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.iterdir() if p.is_file()}


def users_files(folder: Path) -> dict:
    """Files of the user's beside the output: a note, and safetensors files under
    the names shards had (STEM.NNNNN) and have (OUT.NNNNN)."""
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("my notes\n")
    for name in ("scores.00000.safetensors", "scores.jsonl.00000.safetensors",
                 "scores.jsonl.00002.safetensors"):
        (folder / name).write_bytes(b"the user's own " + name.encode())
    return snapshot(folder)


def test_a_users_files_beside_the_index_are_never_touched(converted, tmp_path):
    folder = tmp_path / "o"
    mine = users_files(folder)
    inp = tmp_path / "in.jsonl"
    write_lines(inp, texts(range(4)))
    r = score(converted("kimi_k3"), inp, folder / "scores.jsonl", "--format", "safetensors",
              "--pass-tokens", "16")
    assert r.returncode == 0, r.stderr
    after = snapshot(folder)
    assert {k: after[k] for k in mine} == mine
    index = read_lines(folder / "scores.jsonl")
    shards = {l["shard"] for l in index}
    assert len(shards) > 1 and not shards & set(mine)
    for line in index:
        assert load_file(str(folder / line["shard"]))["tokens"].shape[0] >= line["length"]


def test_two_jobs_in_one_folder_keep_each_others_shards(converted, tmp_path):
    """`-o o/run.jsonl` then `-o o/run.index` (one stem): the second job writes no
    shard the first one's index names, and the first job's shards keep their bytes."""
    folder = tmp_path / "o"
    folder.mkdir()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_lines(a, texts(range(2)))
    write_lines(b, texts(range(2, 4)))
    model = converted("kimi_k3")
    assert score(model, a, folder / "run.jsonl", "--format", "safetensors").returncode == 0
    first = snapshot(folder)
    r = score(model, b, folder / "run.index", "--format", "safetensors")
    assert r.returncode == 0, r.stderr
    after = snapshot(folder)
    assert {k: after[k] for k in first} == first
    a_shards = {l["shard"] for l in read_lines(folder / "run.jsonl")}
    b_shards = {l["shard"] for l in read_lines(folder / "run.index")}
    assert a_shards and b_shards and not a_shards & b_shards


def test_only_a_shard_of_its_own_that_no_line_names_is_deleted(converted, tmp_path):
    """What a kill between a shard and its index lines leaves (here: a copy of the
    job's own shard under the next free number) is deleted by the rerun; the same
    file beside another index of the same name (another folder) is not that
    index's, and stays."""
    model = converted("kimi_k3")
    inp = tmp_path / "in.jsonl"
    write_lines(inp, texts(range(1)))
    runs = {}
    for name in ("mine", "other"):
        folder = tmp_path / name
        folder.mkdir()
        assert score(model, inp, folder / "s.jsonl", "--format", "safetensors").returncode == 0
        runs[name] = folder
    shard = read_lines(runs["mine"] / "s.jsonl")[0]["shard"]
    leftover = (runs["mine"] / shard).read_bytes()
    (runs["mine"] / "s.jsonl.00005.safetensors").write_bytes(leftover)
    (runs["other"] / "s.jsonl.00005.safetensors").write_bytes(leftover)
    write_lines(inp, texts(range(2)))
    for folder in runs.values():
        r = score(model, inp, folder / "s.jsonl", "--format", "safetensors")
        assert r.returncode == 0, r.stderr
    assert not (runs["mine"] / "s.jsonl.00005.safetensors").exists()
    assert (runs["other"] / "s.jsonl.00005.safetensors").read_bytes() == leftover
    assert sorted(l["id"] for l in read_lines(runs["mine"] / "s.jsonl")) == [0, 1]


@pytest.mark.parametrize("cmd, how", [("score", "same name"), ("score", "symlink"),
                                      ("batch", "hard link")])
def test_the_input_as_the_output_is_refused(converted, tmp_path, cmd, how):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [{"id": i, ("text" if cmd == "score" else "prompt"): TEXTS[i]}
                      for i in range(3)])
    before = inp.read_bytes()
    out = tmp_path / "out.jsonl"
    if how == "same name":
        out = inp
    elif how == "symlink":
        out.symlink_to(inp)
    else:
        out.hardlink_to(inp)
    more = ["-n", "2"] if cmd == "batch" else []
    r = deltafin(cmd, converted("kimi_k3"), inp, "-o", out, "--budget", "200MB", *more)
    line = one_error_line(r)
    assert "input file" in line and str(out) in line, line
    assert inp.read_bytes() == before


def test_an_index_line_whose_shard_is_not_a_name_is_one_line(converted, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "idx.jsonl"
    write_lines(inp, texts(range(2)))
    write_lines(out, [{"id": 0, "shard": ["a"], "offset": 0, "length": 3, "logprob": -1.0,
                       "scored_tokens": 2, "greedy": 1}])
    before = out.read_bytes()
    line = one_error_line(score(converted("kimi_k3"), inp, out, "--format", "safetensors"))
    assert str(out) in line and "line 1" in line and '"shard"' in line, line
    assert out.read_bytes() == before


@pytest.fixture
def small_fs(tmp_path):
    with small_filesystem(tmp_path, "4m") as mnt:
        yield mnt


@pytest.mark.parametrize("cmd, fmt", [("score", "jsonl"), ("score", "safetensors"),
                                      ("batch", None)])
def test_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing_behind(
        converted, tmp_path, small_fs, cmd, fmt):
    """A job started (its options recorded, a first result written), then resumed
    with more lines on a disk with no space left: "disk full" naming the file it
    could not write, the output as it was, no temporary or partial file left."""
    model = converted("kimi_k3")
    key = "text" if cmd == "score" else "prompt"
    inp, out = tmp_path / "in.jsonl", small_fs / "out.jsonl"
    more = (["--format", fmt, "--top-logprobs", "4"] if cmd == "score"
            else ["-n", "6", "--top-logprobs", "5", "--temp", "0"])
    write_lines(inp, [{"id": 0, key: TEXTS[0]}])
    r = deltafin(cmd, model, inp, "-o", out, "--budget", "200MB", "--no-warm-start", *more)
    assert r.returncode == 0, r.stderr
    # More than the output's last page can hold past its first result.
    write_lines(inp, [{"id": i, key: TEXTS[i % len(TEXTS)]} for i in range(16)])
    fill(small_fs)
    before, answered = snapshot(small_fs), out.read_bytes()
    r = deltafin(cmd, model, inp, "-o", out, "--budget", "200MB", "--no-warm-start", *more)
    line = one_error_line(r)
    assert "disk full" in line and str(small_fs) in line, line
    # The results that fitted in the output's last page are whole lines; nothing cut.
    now = out.read_bytes()
    assert now.startswith(answered) and now.endswith(b"\n")
    assert all(json.loads(l) for l in now.splitlines())
    before.pop(out.name)
    assert {k: v for k, v in snapshot(small_fs).items() if k != out.name} == before
    assert sorted(p.name for p in small_fs.iterdir()) == sorted([*before, out.name])
