"""Shared fixtures: tiny generated source checkpoints, their conversions, and the
oracle — the same source quantized by mlx-lm itself and run fully in memory
(helpers.py makes them; tests that call them directly import helpers)."""

import shutil
from pathlib import Path

import pytest

from deltafin_mlx.convert.convert import ConvertOptions, convert
from helpers import make_source, reference_model


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path_factory, monkeypatch):
    """Every test has its own user cache directory: a hot set saved by one test (or by
    the user's own runs) never warms another test's cache (engine/hot_set.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = make_source(root / arch, arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("converted")
    cache = {}

    def get(arch):
        if arch not in cache:
            out = root / arch
            convert(str(sources(arch)), out, ConvertOptions(progress=False))
            cache[arch] = out
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def references(sources):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = reference_model(sources(arch))
        return cache[arch]

    return get


@pytest.fixture
def copy_of(tmp_path):
    def copy(path):
        dst = tmp_path / Path(path).name
        shutil.copytree(path, dst)
        return dst

    return copy


# End-to-end tests, marked `e2e` here in one table rather than by decorators spread
# over the files: whole commands in fresh processes (the README verbatim, the demo, a
# server under load, mlx.launch ranks, hub conversions, Ctrl-C loops) and any test that
# takes more than a few seconds alone. `pytest -m "not e2e"` is the fast run for edits;
# the full run (no -m) is what CI and a release run. Patterns are fnmatch patterns over
# node ids (file::test[params]); a file's pattern marks every test in it.
E2E = [
    "tests/model/test_distributed.py::*",         # mlx.launch, two ranks per test
    "tests/server/test_server_load.py::*",        # bench's stress harness, 12-24 clients
    "tests/server/test_stalled_bodies.py::*",     # 70 stalled bodies beside timed requests
    "tests/cli/test_frictions.py::test_readme_examples_run_verbatim",
    "tests/cli/test_frictions.py::test_demo_*",
    "tests/cli/test_cli.py::test_demo_builds_converts_and_streams",
    "tests/convert/test_hub.py::test_convert_a_hub_id_*",
]


def pytest_collection_modifyitems(config, items):
    import fnmatch

    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, p) for p in E2E):
            item.add_marker(pytest.mark.e2e)
