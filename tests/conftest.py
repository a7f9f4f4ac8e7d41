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
