"""The Hugging Face hub, for the few things Deltafin fetches from it: a source
checkpoint (deltafin-convert, whole or shard by shard) or only its config.json
(`deltafin-run plan`, `info`), with each kind of failure — offline above all, a
missing or gated repository, a wrong revision — said in one line.

The repository is listed first (one API request, which huggingface-hub does not
retry): a file download that cannot reach the hub is retried for ~24 s before it
gives up, so asking the listing first makes an unreachable hub one line in a second.
Unreachable, a repository already in the local hub cache is used from there.

A snapshot's files in the hub cache are symlinks into the repository's `blobs/`
folder, so the root under which a snapshot's files may resolve is the repository's
cache folder (`models--OWNER--NAME`, its real path), not the snapshot folder.
"""

import contextlib
import errno
import hashlib
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

from deltafin_mlx.errors import HubError

# A branch or tag name as refs/ holds it (no leading `/` or `..`: it stays in refs/).
REF_NAME = re.compile(r"(?!/)(?!.*\.\.)[A-Za-z0-9._/-]+")
# What a conversion fetches of a repository (weights, configs, tokenizer files).
SOURCE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def looks_like_hub_id(src: str) -> bool:
    """`owner/name`, and not a path that merely does not exist."""
    return src.count("/") == 1 and not src.startswith((".", "/", "~")) and all(src.split("/"))


def offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def hub_failure(repo: str, e: BaseException, what: str, revision: Optional[str] = None) -> str:
    """One line: why fetching `what` of `repo` failed."""
    from huggingface_hub import errors

    if isinstance(e, errors.RevisionNotFoundError):
        why = f"it has no revision {revision or 'main'!r} (check --revision)"
    elif isinstance(e, errors.GatedRepoError):
        why = "the repository is gated: accept its terms on huggingface.co and log in (hf auth login)"
    elif isinstance(e, errors.RepositoryNotFoundError):
        why = "no such repository on the Hugging Face hub (or it is private: log in with hf auth login)"
    elif isinstance(e, errors.EntryNotFoundError) and not isinstance(
            e, errors.LocalEntryNotFoundError):
        why = f"the repository has no {what}"
    elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        why = f"disk full: no space left to write {e.filename or hub_cache_dir()}"
    elif isinstance(e, OSError) and e.errno == errno.EFBIG:  # file_size_bound
        why = ("the hub sent more bytes for a file than it lists; the download was "
               "stopped there")
    elif _is_cut_short(e):
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        why = f"download cut short: {detail}; rerun to fetch it again"
    elif isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled,
                        ConnectionError, OSError)) or _is_network_error(e):
        if offline_mode():
            why = "offline: HF_HUB_OFFLINE is set, and it is not in the local hub cache"
        else:
            why = ("offline: the Hugging Face hub cannot be reached, and it is not in the local "
                   "hub cache (HF_HUB_OFFLINE=1 uses only the cache)")
    else:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = f"{type(e).__name__}: {msg}"
    return f"{repo}: not a local path, and fetching {what} from the Hugging Face hub failed ({why})"


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _is_cut_short(e: BaseException) -> bool:
    """A transfer that began and broke off (the connection reset or closed early,
    or fewer bytes than the hub listed), as opposed to a hub never reached."""
    if isinstance(e, OSError) and str(e).startswith("Consistency check failed"):
        return True  # huggingface-hub: a file of another size than its listing
    try:
        from httpx2 import ReadError, ReadTimeout, RemoteProtocolError
    except ImportError:  # another huggingface-hub HTTP stack: its errors are OSErrors
        return False
    return isinstance(e, (ReadError, ReadTimeout, RemoteProtocolError))


def _is_network_error(e: BaseException) -> bool:
    try:
        from httpx2 import TransportError
    except ImportError:  # another huggingface-hub HTTP stack: its errors are OSErrors
        return isinstance(e, TimeoutError)
    return isinstance(e, (TransportError, TimeoutError))


@contextlib.contextmanager
def quiet_hub():
    """huggingface-hub logs each retry as a warning, and warns of too little free
    disk space before it writes: one line is said instead (a full disk is "disk
    full" when a write fails)."""
    from huggingface_hub.utils import logging as hub_logging

    logger = hub_logging.get_logger("huggingface_hub")
    level = logger.level
    logger.setLevel(hub_logging.ERROR + 10)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Not enough free disk space")
            yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    sha256: Optional[str]  # the LFS oid (None for a small file kept in git)


@dataclass
class HubRepo:
    """One revision of a repository as the hub lists it."""

    repo: str
    commit: str
    files: Dict[str, HubFile]


def list_repo(repo: str, revision: Optional[str] = None, what: str = "it") -> Optional[HubRepo]:
    """The repository's files at `revision` with their sizes and sha256, or None when
    the hub cannot be reached (offline: the caller falls back to the local cache).
    A missing or gated repository or a wrong revision is a HubError."""
    if offline_mode():
        return None
    from huggingface_hub import HfApi

    try:
        with quiet_hub():
            info = HfApi().model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:  # the hub raises many types; hub_failure says which
        line = hub_failure(repo, e, what, revision)
        if "offline:" in line:
            return None
        raise HubError(line) from None
    files = {}
    for s in info.siblings or []:
        lfs = getattr(s, "lfs", None)
        files[s.rfilename] = HubFile(s.rfilename, int(s.size or 0),
                                     getattr(lfs, "sha256", None) if lfs else None)
    return HubRepo(repo, info.sha, files)


def fetch_file(repo: str, name: str, revision: Optional[str] = None,
               what: Optional[str] = None, listed: Optional[HubRepo] = None) -> Path:
    """One file of the repository (from the local hub cache when it is there and
    the revision is pinned, or when the hub cannot be reached)."""
    from huggingface_hub import hf_hub_download

    what = what or f"its {name}"
    if listed is None and not offline_mode():
        listed = list_repo(repo, revision, what)
    try:
        with quiet_hub():
            if listed is None:  # unreachable: only the cache can answer
                return Path(hf_hub_download(repo, name, revision=revision, local_files_only=True))
            if name not in listed.files:
                raise HubError(f"{repo}: the repository has no {name}")
            path = Path(hf_hub_download(repo, name, revision=listed.commit))
            record_ref(path, revision, listed.commit)
            return path
    except HubError:
        raise
    except Exception as e:  # the hub raises many types; hub_failure says which
        raise HubError(hub_failure(repo, e, what, revision)) from None


def fetch_config(repo: str, revision: Optional[str] = None) -> Path:
    """config.json of a hub repository, and nothing else of it (plan before downloading)."""
    return fetch_file(repo, "config.json", revision, "its config.json")


def download_snapshot(repo: str, revision: Optional[str] = None,
                      listed: Optional[HubRepo] = None, patterns=None,
                      progress: bool = True) -> Path:
    """The snapshot folder of the whole repository (what a conversion reads),
    downloaded into the hub cache, or found there when the hub cannot be reached.
    huggingface-hub writes a file whole before it compares its size with the
    listing, so no file may grow past the largest the listing names meanwhile: a
    hub that sends an endless body cannot fill the disk."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if listed is None and not offline_mode():
        listed = list_repo(repo, revision)
    if not progress:
        disable_progress_bars()
    largest = max((f.size for f in listed.files.values()), default=0) if listed else None
    try:
        with quiet_hub(), file_size_bound(largest):
            snapshot = Path(snapshot_download(
                repo, revision=listed.commit if listed else revision,
                local_files_only=listed is None, allow_patterns=patterns or SOURCE_PATTERNS))
            if listed is not None:
                record_ref(snapshot, revision, listed.commit)
            return snapshot
    except Exception as e:  # the hub raises many types; hub_failure says which
        raise HubError(hub_failure(repo, e, "it", revision)) from None


def record_ref(fetched: Path, revision: Optional[str], commit: str):
    """`refs/REVISION` (main by default) holding the commit, as huggingface-hub leaves
    a download by name, so the name finds the snapshot offline (mlx-lm's too).
    Deltafin downloads by the commit it listed (a branch that moves meanwhile cannot
    mix two commits' files), for which huggingface-hub writes no ref. `fetched`: the
    snapshot folder or a file in it."""
    revision = revision or "main"
    snapshots = next((p for p in Path(fetched).parents if p.name == "snapshots"), None)
    if commit.startswith(revision) or not REF_NAME.fullmatch(revision) or snapshots is None:
        return  # a commit itself, or no name huggingface-hub would write
    ref = snapshots.parent / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.with_name(ref.name + ".tmp").write_text(commit)
    os.replace(ref.with_name(ref.name + ".tmp"), ref)


@contextlib.contextmanager
def file_size_bound(limit: Optional[int]):
    """While the block runs, no file this process writes grows past `limit` bytes
    (RLIMIT_FSIZE, with SIGXFSZ ignored so such a write fails with EFBIG instead of
    killing the process). Only from the main thread (signals are set there) and
    where the platform has the limit; None: no bound."""
    try:
        import resource
        import signal
    except ImportError:  # Windows
        resource = None
    if limit is None or resource is None or \
            threading.current_thread() is not threading.main_thread():
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and soft <= limit:  # already as tight
        yield
        return
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def cache_root(snapshot: Path) -> Path:
    """The real path of a hub-cache repository folder holding `snapshot`
    (`.../models--OWNER--NAME/snapshots/COMMIT`): its files resolve into its
    `blobs/`. A folder outside the hub cache is its own root."""
    snapshot = Path(snapshot)
    if snapshot.parent.name == "snapshots" and snapshot.parent.parent.name.startswith("models--"):
        return Path(os.path.realpath(snapshot.parent.parent))
    return Path(os.path.realpath(snapshot))


def sha256_file(path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _get(repo: str, commit: str, name: str, headers: dict):
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    url = hf_hub_url(repo, name, revision=commit)
    return get_session().stream("GET", url, headers={**build_hf_headers(), **headers},
                                follow_redirects=True, timeout=60)


def fetch_range(repo: str, commit: str, name: str, start: int, length: int) -> bytes:
    """`length` bytes of a repository file from `start` (an HTTP range request):
    a shard's safetensors header without downloading the shard."""
    from huggingface_hub.utils import hf_raise_for_status

    try:
        with _get(repo, commit, name, {"Range": f"bytes={start}-{start + length - 1}"}) as r:
            hf_raise_for_status(r)
            data = r.read()
    except HubError:
        raise
    except Exception as e:  # the hub raises many types; hub_failure says which
        raise HubError(hub_failure(repo, e, f"the header of {name}")) from None
    if r.status_code != 206 and len(data) > length:
        data = data[start:start + length]  # a server that ignores ranges
    return data


def download_to(repo: str, commit: str, name: str, dest: Path, size: int, on_bytes=None) -> str:
    """Stream a repository file into `dest` (flushed to disk), returning its
    sha256; `on_bytes(n)` is told of every chunk written. The file must be the
    `size` bytes the hub lists: a hub that sends more (an endless body) is stopped
    there, one that sends fewer is a download cut short; a failed download's
    partial file is removed. A full disk is said as such, naming `dest`."""
    from huggingface_hub.utils import hf_raise_for_status

    h = hashlib.sha256()
    got = 0
    try:
        with _get(repo, commit, name, {}) as r, open(dest, "wb") as f:
            hf_raise_for_status(r)
            for chunk in r.iter_bytes(4 << 20):
                got += len(chunk)
                if got > size:
                    raise HubError(f"{repo}/{name}: the hub sent more than the {size} bytes it "
                                   "lists for it; the download was stopped there")
                f.write(chunk)
                h.update(chunk)
                if on_bytes:
                    on_bytes(len(chunk))
            if got < size:
                raise HubError(f"{repo}/{name}: download cut short: {got} of the {size} bytes "
                               "the hub lists arrived; rerun to fetch it again")
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        Path(dest).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise HubError(f"{repo}/{name}: disk full: no space left to write {dest}") from None
        if isinstance(e, HubError) or not isinstance(e, Exception):
            raise
        if isinstance(e, OSError) and e.errno is not None and e.filename is not None:
            raise
        # the hub raises many types; hub_failure says which
        raise HubError(hub_failure(repo, e, name)) from None
    return h.hexdigest()
