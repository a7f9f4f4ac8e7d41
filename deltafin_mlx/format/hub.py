"""The Hugging Face hub, for the few things Deltafin fetches from it: a source
checkpoint (deltafin-convert) or only its config.json (`deltafin-run plan`), with
each kind of failure — offline above all — said in one line."""

import contextlib
import os
from pathlib import Path
from deltafin_mlx.errors import HubError


def looks_like_hub_id(src: str) -> bool:
    """`owner/name`, and not a path that merely does not exist."""
    return src.count("/") == 1 and not src.startswith((".", "/", "~")) and all(src.split("/"))


def hub_failure(repo: str, e: BaseException, what: str) -> str:
    """One line: why fetching `what` of `repo` failed."""
    from huggingface_hub import errors

    if isinstance(e, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled,
                      ConnectionError)):
        if os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0"):
            why = "offline: HF_HUB_OFFLINE is set, and it is not in the local hub cache"
        else:
            why = "offline: the Hugging Face hub cannot be reached, and it is not in the local hub cache"
    elif isinstance(e, errors.GatedRepoError):
        why = "the repository is gated: accept its terms on huggingface.co and log in (hf auth login)"
    elif isinstance(e, errors.RepositoryNotFoundError):
        why = "no such repository on the Hugging Face hub (or it is private: log in with hf auth login)"
    elif isinstance(e, errors.EntryNotFoundError):
        why = f"the repository has no {what}"
    else:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        why = f"{type(e).__name__}: {msg}"
    return f"{repo}: not a local path, and fetching {what} from the Hugging Face hub failed ({why})"


@contextlib.contextmanager
def quiet_hub():
    """huggingface-hub logs each retry as a warning: one line is said instead."""
    from huggingface_hub.utils import logging as hub_logging

    logger = hub_logging.get_logger("huggingface_hub")
    level = logger.level
    logger.setLevel(hub_logging.ERROR + 10)
    try:
        yield
    finally:
        logger.setLevel(level)


def fetch_config(repo: str) -> Path:
    """config.json of a hub repository, and nothing else of it (plan before downloading)."""
    from huggingface_hub import hf_hub_download

    try:
        with quiet_hub():
            return Path(hf_hub_download(repo, "config.json"))
    except Exception as e:  # the hub raises many types; hub_failure says which
        raise HubError(hub_failure(repo, e, "its config.json")) from None


