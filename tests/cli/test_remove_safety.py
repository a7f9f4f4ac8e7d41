"""`rm` deletes only what Deltafin wrote. `rm --demo` deletes only the files the
demo recorded writing (deltafin-demo.json) in a folder the user may have named
for anything: a checkpoint, a converted model or a note of the user's there is
left byte for byte. `rm MODEL` refuses a path that resolves elsewhere than it
reads (a '..' after a symlink) and takes `.` as the directory it is, before
deleting anything."""

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from deltafin_mlx.format.manifest import MANIFEST_NAME
from helpers import BIN



def rm(*args, cwd=None):
    return subprocess.run([str(BIN / "deltafin-run"), "rm", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def one_error_line(r, *words):
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def tree(folder: Path) -> dict:
    """Every file under `folder`, with its bytes' hash."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A demo folder as `deltafin-run --demo` leaves it (built once, copied per test)."""
    from deltafin_mlx.testing.demo import prepare

    root = tmp_path_factory.mktemp("demo") / "demo"
    prepare(root)
    return root


def test_rm_demo_removes_what_the_demo_wrote_and_leaves_the_users_files(demo, tmp_path):
    root = tmp_path / "demo"
    shutil.copytree(demo, root, symlinks=True)
    (root / "thesis.tex").write_text("my thesis\n")
    r = rm("--demo", "--demo-dir", root, "--yes")
    assert r.returncode == 0 and "freed" in r.stderr, r.stderr
    assert tree(root) == {"thesis.tex": hashlib.sha256(b"my thesis\n").hexdigest()}


@pytest.mark.parametrize("what", ["checkpoint", "model"])
def test_rm_demo_in_a_folder_the_demo_did_not_write_deletes_nothing(
        converted, sources, tmp_path, what):
    """The user's checkpoint in DIR/source, or converted model in DIR/model, with a
    file of theirs beside it: refused in one line, every byte left."""
    root = tmp_path / "work"
    root.mkdir()
    if what == "checkpoint":
        shutil.copytree(sources("kimi_k3"), root / "source")
    else:
        shutil.copytree(converted("kimi_k3"), root / "model")
    (root / "thesis.tex").write_text("my thesis\n")
    before = tree(root)
    one_error_line(rm("--demo", "--demo-dir", root, "--yes"), "deltafin-demo.json",
                   "nothing removed")
    assert tree(root) == before


def test_rm_demo_leaves_a_claimed_folder_holding_a_users_file(demo, tmp_path):
    root = tmp_path / "demo"
    shutil.copytree(demo, root, symlinks=True)
    (root / "source" / "thesis.tex").write_text("my thesis\n")
    before = tree(root)
    one_error_line(rm("--demo", "--demo-dir", root, "--yes"), "thesis.tex", "nothing removed")
    assert tree(root) == before


@pytest.mark.parametrize("marker", ["forged", "the demo's, naming another folder"])
def test_rm_demo_never_deletes_a_folder_the_demo_was_not_writing_in(demo, tmp_path, marker):
    """A record whose `writing` names a folder of the user's (forged, or the demo's
    own record edited to name another folder): refused in one line, every byte left."""
    import json

    from deltafin_mlx.format.demo_marker import MARKER_NAME, start_source

    root = tmp_path / "demo"
    if marker == "forged":
        root.mkdir()
        record = {"kind": "deltafin demo", "model": None, "source": None}
    else:
        shutil.copytree(demo, root, symlinks=True)
        shutil.rmtree(root / "source")
        start_source(root)  # an interrupted demo: its folder and identity recorded
        record = json.loads((root / MARKER_NAME).read_text())
    (root / ".source-mine").mkdir()
    (root / ".source-mine" / "thesis.tex").write_text("my thesis\n")
    (root / MARKER_NAME).write_text(json.dumps({**record, "writing": ".source-mine"}))
    before = tree(root)
    one_error_line(rm("--demo", "--demo-dir", root, "--yes"), ".source-mine",
                   "not the folder the demo was writing in", "nothing removed")
    assert tree(root) == before


def test_rm_demo_removes_the_folder_an_interrupted_demo_was_writing_in(demo, tmp_path):
    from deltafin_mlx.format.demo_marker import start_source

    root = tmp_path / "demo"
    shutil.copytree(demo, root, symlinks=True)
    shutil.rmtree(root / "source")
    (start_source(root) / "config.json").write_text("{}")  # written when interrupted
    (root / "thesis.tex").write_text("my thesis\n")
    r = rm("--demo", "--demo-dir", root, "--yes")
    assert r.returncode == 0 and "freed" in r.stderr, r.stderr
    assert tree(root) == {"thesis.tex": hashlib.sha256(b"my thesis\n").hexdigest()}
    assert sorted(p.name for p in root.iterdir()) == ["thesis.tex"]


def test_the_demo_never_writes_over_a_users_checkpoint(sources, tmp_path):
    """A folder of the user's at DIR/source that the demo did not write is not
    replaced by the demo's checkpoint: the demo refuses in one line."""
    root = tmp_path / "work"
    root.mkdir()
    shutil.copytree(sources("kimi_k3"), root / "source")
    (root / "source" / "model.safetensors.index.json").unlink()  # what a cut download leaves
    before = tree(root)
    r = subprocess.run([str(BIN / "deltafin-run"), "--demo", "--demo-dir", str(root), "-n", "2"],
                       capture_output=True, text=True, timeout=300)
    one_error_line(r, str(root / "source"), "not touched")
    assert tree(root) == before


@pytest.fixture
def two_models(converted, tmp_path):
    """Model A, and model B whose experts folder is a symlink to A's."""
    a, b = tmp_path / "A", tmp_path / "B"
    shutil.copytree(converted("kimi_k3"), a)
    b.mkdir()
    (b / "experts").symlink_to(a / "experts")
    return a, b


def test_rm_through_a_link_and_dotdot_is_refused_before_deleting_anything(two_models):
    a, b = two_models
    before = tree(a)
    one_error_line(rm(b / "experts" / "..", "--yes"), "resolves to")
    assert tree(a) == before and (b / "experts").is_symlink()


def test_rm_dot_removes_the_model_it_stands_in(converted, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(converted("kimi_k3"), model)
    (tmp_path / "notes.txt").write_text("mine")
    r = rm(".", "--yes", cwd=model)
    assert r.returncode == 0 and "freed" in r.stderr and "error" not in r.stderr, r.stderr
    assert not model.exists() and (tmp_path / "notes.txt").read_text() == "mine"


def test_rm_dot_in_a_folder_that_is_no_model_deletes_nothing(converted, tmp_path):
    """`.` inside a model's experts folder: not a model, refused, nothing deleted."""
    model = tmp_path / "m"
    shutil.copytree(converted("kimi_k3"), model)
    before = tree(model)
    one_error_line(rm(".", "--yes", cwd=model / "experts"))
    assert tree(model) == before and (model / MANIFEST_NAME).exists()
