"""A model named as users name it: a local checkpoint folder, or a Hugging Face Hub repository
id (``Qwen/Qwen2.5-7B-Instruct``) resolved to a folder of the local Hub cache.

A Hub id is fetched with ``huggingface_hub.snapshot_download``, only the files the engine reads
(safetensors weights, config, tokenizer, generation config, chat template): never ``*.py`` (the
engine runs no checkpoint code) nor pickled ``*.bin`` weights. The library itself reads
``HF_TOKEN`` (gated and private repositories), ``HF_HUB_OFFLINE`` (the cache only),
``HF_HUB_CACHE`` / ``HF_HOME`` (where the cache is; ``download_dir`` overrides it) and
``HF_ENDPOINT``; nothing here reads them again. Every process that opens the model (each
Worker, rank 0 of a tensor-parallel group, which hands the folder to its ranks) resolves it on
its own machine, so Workers on other nodes fill their own caches, as vLLM's do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import ModelConfig

ALLOW_PATTERNS = [
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "*.tiktoken", "chat_template.jinja",
    "chat_template.json",
]

# owner/name (or a bare name), as the Hub spells repository ids: letters, digits, "-", "_", "."
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_repo_id(model: str) -> bool:
    """Whether ``model`` reads as a Hub id rather than a path (``./x``, ``/x``, ``~/x`` and
    ``a/b/c`` are paths)."""
    return bool(_REPO_ID.fullmatch(model)) and ".." not in model and not model.endswith(".")


def locate_model(config: ModelConfig) -> tuple[str, str]:
    """The folder the engine loads for ``config`` and the model's name: a folder or Hub id as
    given (``resolve_model``), else the default model's (built on first use)."""
    from engine.models.default_model import DEFAULT_MODEL_NAME, default_model_path

    if config.model is None:
        return str(default_model_path()), DEFAULT_MODEL_NAME
    return resolve_model(config.model, config.revision, config.download_dir), config.model


def resolve_model(model: str, revision: str | None = None,
                  download_dir: str | None = None) -> str:
    """The local folder of ``model``: the folder itself when it exists, else the Hub cache's
    snapshot of the repository ``model`` at ``revision`` (a branch, tag or commit; None: main),
    downloaded if needed into ``download_dir`` (None: the Hub cache). A start-up
    ``ValueError`` names the model when it is neither a folder nor a fetchable repository."""
    if Path(model).expanduser().is_dir():
        return str(Path(model).expanduser())
    if not looks_like_repo_id(model):
        raise ValueError(f"model: {model!r} is not a folder, nor a Hugging Face Hub repository "
                         "id (owner/name)")
    return _download(model, revision, download_dir)


def _download(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import constants, errors, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    cache = download_dir or constants.HF_HUB_CACHE
    # huggingface_hub 2.x tells a partly cached snapshot apart (a LocalEntryNotFoundError)
    incomplete = getattr(errors, "IncompleteSnapshotError", ())
    try:
        folder: str = snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                        allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError as e:
        reason = ("HF_HUB_OFFLINE is set" if constants.is_offline_mode()
                  else "the Hugging Face Hub cannot be reached")
        if isinstance(e, incomplete):
            raise ValueError(f"{where}: the cached copy in {cache} is incomplete and {reason}, "
                             "so it cannot be completed") from None
        raise ValueError(f"{where} is not in the Hugging Face cache ({cache}) and {reason}, "
                         "so it cannot be downloaded") from None
    except GatedRepoError:
        raise ValueError(f"{where} is gated: accept its terms on the Hub and set HF_TOKEN to a "
                         "token of an account that has") from None
    except RevisionNotFoundError:
        raise ValueError(f"{where}: the repository has no such revision") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{where} is not a repository on the Hugging Face Hub (or it is "
                         "private: set HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise ValueError(f"{where}: the Hugging Face Hub answered {e}") from None
    return folder
