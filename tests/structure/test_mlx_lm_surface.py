"""Every private or undocumented mlx-lm name Deltafin reads or overrides is listed
in compat.PRIVATE and exists in the installed mlx-lm: an mlx-lm release that
renames one fails here, in one line naming it, instead of deep inside a request."""

import re
from pathlib import Path

import pytest

from deltafin_mlx import compat

ROOT = Path(__file__).resolve().parents[2] / "deltafin_mlx"


@pytest.mark.parametrize("module,name", compat.PRIVATE, ids=[n for _, n in compat.PRIVATE])
def test_each_private_name_exists_in_the_installed_mlx_lm(module, name):
    assert compat.missing([(module, name)]) == [], (
        f"mlx-lm no longer has {module}:{name} (compat.PRIVATE)")


def test_a_renamed_name_is_reported():
    assert compat.missing([("mlx_lm.server", "APIHandler._no_such_hook"),
                           ("mlx_lm.utils", "_no_such_function")]) == [
        "mlx_lm.server:APIHandler._no_such_hook", "mlx_lm.utils:_no_such_function"]


def test_make_samplers_chain_is_readable():
    """KeyedSampler draws mlx-lm's own filter chain with its own key: the chain is
    read from make_sampler's closure, which a release may change."""
    from mlx_lm.sample_utils import make_sampler

    filters, temp = compat.sampler_chain(make_sampler(0.7, top_p=0.9, top_k=5))
    assert temp == 0.7 and len(filters) == 2
    assert compat.sampler_chain(make_sampler(0.0)) == ([], None)


def test_the_float_tag_is_mlx_lms():
    import mlx_lm.utils

    assert compat.FLOAT_TAG == mlx_lm.utils._FLOAT_TAG_KEY
    assert compat.decode_tagged_floats({"a": {"__float__": "NaN"}}, b'"__float__"')["a"] != 0


def test_only_compat_reaches_into_mlx_lm_private_names():
    """`mlx_lm.anything._private` is spelled in compat.py alone."""
    spelled = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
               if re.search(r"\bmlx_lm(\.\w+)*\._[a-z]\w*", p.read_text())}
    assert spelled <= {"compat.py"}, spelled


def test_every_server_hook_the_server_overrides_is_listed():
    """A method the server's subclasses define under a name mlx-lm's class also
    has overrides mlx-lm's internals: it must be in PRIVATE (unless it is
    http.server's own API)."""
    import http.server

    import mlx_lm.server as server

    listed = {n for _, n in compat.PRIVATE}
    public = set(dir(http.server.BaseHTTPRequestHandler)) | {"do_GET", "do_POST", "do_OPTIONS",
                                                            "__init__"}
    unlisted = []
    for path in ("server/handler.py", "server/app.py", "server/generation.py",
                 "dropin/guard.py"):
        for name in re.findall(r"^\s+def (\w+)\(self", (ROOT / path).read_text(), re.M):
            for cls in (server.APIHandler, server.ModelProvider, server.ResponseGenerator):
                if name in vars(cls) and name not in public and f"{cls.__name__}.{name}" not in listed:
                    unlisted.append(f"{path}: {cls.__name__}.{name}")
    assert unlisted == []
