"""A converted model directory, opened once per command.

Opening reads and checks the manifest (every file it lists, small files with their
checksums) and config.json against it; the result is handed to whatever the
command does next — load, plan, info, verify, the demo — so that no step opens the
directory again. The tokenizer is loaded only when asked for
(`deltafin_mlx.engine.load.open_tokenizer`) and kept here.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from deltafin_mlx.compat import decode_tagged_floats
from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.integrity import CONFIG_MAX_BYTES, check_if_present, read_inside
from deltafin_mlx.format.manifest import Manifest, read_manifest


# The mlx-lm drop-in deltafin-convert writes and names as config.json's "model_file"
# (mlx_lm_shim.py): mlx-lm executes whatever file that key names, so no other is read.
SHIM_FILE = "deltafin_model.py"
# What the converter writes for the drop-in: the file itself, and the empty weights
# file mlx-lm's loader needs to find (it globs model*.safetensors).
PLACEHOLDER_WEIGHTS = "model-deltafin-placeholder.safetensors"
SHIM_SOURCE = '''"""Written by deltafin-convert: lets mlx-lm run this directory through Deltafin."""
from pathlib import Path

from deltafin_mlx.dropin.shim import make_classes

Model, ModelArgs = make_classes(Path(__file__).parent)
'''


@dataclass
class ModelDir:
    path: Path
    manifest: Manifest
    config: dict  # config.json as mlx-lm reads it, checked against the manifest
    tokenizer: Optional[Any] = None  # loaded on demand


def open_model_dir(path, check_files: bool = True) -> ModelDir:
    """The model directory at `path` (an already opened ModelDir is returned as is)."""
    if isinstance(path, ModelDir):
        return path
    path = Path(path).expanduser()
    manifest = read_manifest(path, check_files=check_files)
    return ModelDir(path, manifest, read_config(path, manifest))


def read_source_config(path: Path) -> dict:
    """A source checkpoint's config.json (or a config file given by name), read with
    the rules of every file Deltafin reads: a regular file, bounded in size, named
    in its own directory (a link is followed only within it)."""
    path = Path(path)
    return _parse_config(read_inside(path.parent, path.name, CONFIG_MAX_BYTES), path)


def _parse_config(raw: bytes, where: Path) -> dict:
    try:
        config = decode_tagged_floats(json.loads(raw), raw)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError, TypeError) as e:
        raise ModelError(f"{where}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    return config


def read_config(path: Path, manifest: Manifest) -> dict:
    """config.json, checked against the manifest (it is what builds the model),
    read as mlx-lm's load_config reads it (eos from generation_config.json)."""
    cpath = path / "config.json"
    raw = read_inside(path, "config.json", CONFIG_MAX_BYTES)
    want = manifest.source.get("config_sha256")
    if want and hashlib.sha256(raw).hexdigest() != want:
        raise ModelError(f"{cpath}: modified since conversion (its checksum differs)")
    config = _parse_config(raw, cpath)
    _check_model_file(config, cpath, manifest)
    gpath = path / "generation_config.json"
    if check_if_present(manifest, gpath.name, CONFIG_MAX_BYTES):
        try:
            generation = json.loads(read_inside(path, gpath.name, CONFIG_MAX_BYTES))
        except (ValueError, RecursionError):
            generation = {}  # as mlx-lm: an unreadable generation config is ignored
        if isinstance(generation, dict) and generation.get("eos_token_id"):
            config["eos_token_id"] = generation["eos_token_id"]
    return config


def code_named(path) -> List[str]:
    """Code the model directory at `path` carries or points to, which some tool
    would execute: config.json's "model_file" other than the drop-in (mlx-lm
    executes it with --trust-remote-code before any Deltafin code runs, so no check
    of ours can stop it), any "auto_map" in config.json or tokenizer_config.json
    (transformers runs those modules with trust_remote_code; Deltafin never does,
    and deltafin-convert writes none), and any Python file beside the drop-in. One
    line each; a file that cannot be read adds nothing (the other checks say why)."""
    root = os.path.realpath(path)

    def outside(rel) -> bool:
        try:
            real = os.path.realpath(os.path.join(root, rel))
        except (TypeError, ValueError):
            return True
        return os.path.commonpath([root, real]) != root

    found = []
    config = _json_inside(path, "config.json")
    named = config.get("model_file")
    if named is not None and (not isinstance(named, str) or outside(named)):
        found.append(f'config.json: "model_file" names {named!r:.200}, outside the model '
                     "directory: mlx-lm executes it (--trust-remote-code) before any Deltafin "
                     "code runs; do not load this model with mlx-lm")
    for name, doc in (("config.json", config),
                      ("tokenizer_config.json", _json_inside(path, "tokenizer_config.json"))):
        for ref in _auto_map_refs(doc):
            where = ("code from another hub repository" if "--" in ref else
                     "a module outside the model directory" if outside(ref.rsplit(".", 1)[0] + ".py")
                     else "code the model carries")
            found.append(f'{name}: "auto_map" names {ref!r:.200}, {where}: transformers would '
                         "execute it with trust_remote_code")
    try:
        code = sorted(e.name for e in os.scandir(root)
                      if e.name.endswith(".py") and e.name != SHIM_FILE)
    except OSError:
        code = []
    found += [f"{name!r:.200}: Python code in the model directory (deltafin-convert writes "
              "none but the drop-in): other tools may execute it" for name in code[:20]]
    return found


def _json_inside(path, name) -> dict:
    try:
        doc = json.loads(read_inside(path, name, CONFIG_MAX_BYTES))
    except (ModelError, ValueError, RecursionError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _auto_map_refs(doc, depth=0) -> List[str]:
    """Every module reference under an "auto_map" key, at any depth of `doc`."""
    refs = []
    if depth > 8 or not isinstance(doc, dict):
        return refs
    for key, value in doc.items():
        if key == "auto_map" and isinstance(value, dict):
            for v in value.values():
                refs += [r for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
        elif isinstance(value, dict):
            refs += _auto_map_refs(value, depth + 1)
    return refs


def _check_model_file(config: dict, cpath: Path, manifest: Manifest):
    """config.json's "model_file", which mlx-lm executes (`--trust-remote-code`), is
    absent or the drop-in the converter wrote, listed in the manifest (so its bytes
    are checked as every listed file's are)."""
    if "model_file" not in config:
        return
    named = config["model_file"]
    if named != SHIM_FILE:
        raise ModelError(f"{cpath}: \"model_file\" is {named!r:.200}, not {SHIM_FILE} (the "
                         "file deltafin-convert writes, which mlx-lm would execute)")
    if SHIM_FILE not in manifest.files:
        raise ModelError(f"{cpath}: \"model_file\" names {SHIM_FILE}, which the manifest "
                         "does not list")
