"""Loading a model by name, like timm's ``create_model(..., pretrained=True)``: from_pretrained.

:func:`from_pretrained` loads a model folder (``capsctl export CKPT --format hf``, see
:mod:`capsctl.checkpoint.folder` for its layout), a checkpoint file or, with the optional
``huggingface_hub`` package (``pip install 'capsctl[hub]'``), a Hub id ``org/name`` through
the Hugging Face cache (offline when the files are cached and ``HF_HUB_OFFLINE=1`` or
``local_files_only=True``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from capsctl.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    config_from_metadata,
    load_checkpoint,
    resolve_checkpoint,
)
from capsctl.checkpoint.format import library_versions
from capsctl.checkpoint.shipped import is_shipped_name, shipped
from capsctl.errors import CapsctlError, CheckpointError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

__all__ = ["from_pretrained", "looks_like_path", "resolve_pretrained"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
#: Endings of file names: a name ending so names a local file, never a Hub model.
_FILE_SUFFIXES = (".safetensors", ".json", ".yaml", ".yml", ".pt", ".pth", ".bin", ".ckpt")
_HUB_MISSING = "needs huggingface_hub: pip install 'capsctl[hub]'"


def _hub_error(
    e: Exception, repo_id: str, filename: str, revision: str | None
) -> CapsctlError | None:
    """The one-line error for a failed ``hf_hub_download`` (None: not a Hub error)."""
    from huggingface_hub.utils import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    # Subclasses first: LocalEntryNotFoundError and the others are HfHubHTTPErrors or OSErrors.
    if isinstance(e, LocalEntryNotFoundError):
        return CheckpointError(
            f"{at}: {filename} is not in the Hugging Face cache and downloading is off or "
            "failed (HF_HUB_OFFLINE / local_files_only / no network); connect once to "
            "download it, or pass a local folder"
        )
    if isinstance(e, GatedRepoError):
        return CheckpointError(
            f"{at} is gated on the Hugging Face Hub; accept its terms on the Hub and log "
            "in (hf auth login)"
        )
    if isinstance(e, RepositoryNotFoundError):
        return CheckpointError(
            f"{at}: no such model on the Hugging Face Hub (or it is private: log in with "
            "hf auth login); check the id"
        )
    if isinstance(e, RevisionNotFoundError):
        return CheckpointError(
            f"{at}: the Hub model has no revision {revision!r}; check the revision"
        )
    if isinstance(e, EntryNotFoundError):
        return CheckpointError(
            f"{at} has no {filename}, so it is not a capsctl model folder; pass a model "
            "exported with capsctl export --format hf"
        )
    if isinstance(e, HFValidationError):
        return UsageError(f"{repo_id!r} is not a valid Hub id ({e}); use org/name")
    if isinstance(e, (HfHubHTTPError, OSError)):
        text = " ".join(str(e).split())
        return CheckpointError(
            f"cannot fetch {filename} of {at} from the Hugging Face Hub ({text}); retry, or "
            "set HF_HUB_OFFLINE=1 to use the cache"
        )
    return None


def _from_hub(
    repo_id: str,
    *,
    revision: str | None,
    cache_dir: str | os.PathLike[str] | None,
    local_files_only: bool | None,
) -> Path:
    """The snapshot folder of ``repo_id`` in the Hugging Face cache (downloaded if allowed)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise CapsctlError(
            f"{repo_id!r} is not a local path; loading it from the Hugging Face Hub {_HUB_MISSING}"
        ) from None
    at = f"{repo_id}@{revision}" if revision else repo_id
    files = []
    for filename in (CONFIG_NAME, WEIGHTS_NAME):
        try:
            downloaded = hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=bool(local_files_only),
                library_name="capsctl",
                library_version=library_versions()["capsctl_version"],
            )
        except Exception as e:
            error = _hub_error(e, repo_id, filename, revision)
            if error is None:
                raise
            raise error from None
        files.append(Path(downloaded))
    if files[0].parent != files[1].parent:  # pragma: no cover - same revision, same snapshot
        raise CheckpointError(f"{at}: the cached files belong to different revisions; retry")
    return files[0].parent


def looks_like_path(name_or_path: str | os.PathLike[str]) -> bool:
    """Whether ``name_or_path`` names a local file or folder rather than a Hub id ``org/name``.

    A path object; or text that starts with ``.``, ``~`` or a separator, ends with a separator
    or a file suffix (``.safetensors``, ``.json``, ...), holds a backslash or other than exactly
    one ``/``, or whose part before the ``/`` is a local folder (``runs/x`` where ``runs/``
    exists)."""
    if not isinstance(name_or_path, str):
        return True
    text = name_or_path
    separators = ("/", "\\")  # os.sep is one of them
    if text.startswith((".", "~", *separators)) or text.endswith(separators):
        return True
    if "\\" in text or text.count("/") != 1 or text.lower().endswith(_FILE_SUFFIXES):
        return True
    return Path(text.split("/", 1)[0]).is_dir()


def resolve_pretrained(
    name_or_path: str | os.PathLike[str],
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
) -> Path:
    """The local path of a model: an existing folder or file as it is, then a shipped name
    (``capsctl weights``), then a Hub id via the cache.

    A missing path (:func:`looks_like_path`) is a one-line error that never asks the Hub. A
    run folder of ``capsctl train`` stands for its ``best.safetensors``.
    A string ``org/name`` that is not an existing path is fetched with ``huggingface_hub``
    (``config.json`` and ``model.safetensors`` of ``revision``, default the main branch) into
    its cache (``cache_dir``, default ``HF_HUB_CACHE``); with ``local_files_only=True`` or
    ``HF_HUB_OFFLINE=1`` only the cache is used. Returns the snapshot folder.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if revision is not None:
            raise UsageError(
                f"revision={revision!r} applies to Hub ids only, and {path} is a local path"
            )
        return resolve_checkpoint(path)
    text = os.fspath(name_or_path)
    found = shipped(text) if is_shipped_name(text) else None
    if found is not None:  # a shipped name (capsctl weights), after an existing path
        if revision is not None:
            raise UsageError(f"revision={revision!r} applies to Hub ids only, not {text}")
        return found.path
    if looks_like_path(name_or_path) or not _HUB_ID.match(text):
        raise CheckpointError(
            f"no such file or folder: {text}; pass a model folder, a run folder, a .safetensors "
            "checkpoint, a shipped name (capsctl weights) or a Hub id like org/name"
        )
    return _from_hub(
        text, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )


def from_pretrained(
    name_or_path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool | None = None,
) -> nn.Module:
    """Load a model, ready for inference, like ``timm.create_model(..., pretrained=True)``.

    ``name_or_path``: a model folder (``capsctl export --format hf``), a capsctl
    ``.safetensors`` checkpoint, or a Hugging Face Hub id ``org/name`` (needs
    ``pip install 'capsctl[hub]'``; see :func:`resolve_pretrained` for ``revision``,
    ``cache_dir`` and ``local_files_only``). Returns the model on ``device`` in eval mode;
    ``model.pretrained_cfg`` is the folder's ``config.json`` as a dict (timm's attribute name:
    ``input_size`` ``[C, H, W]``, ``mean``, ``std``, ``label_names``, ``model_config``,
    ``test``, ...). The checkpoint metadata as the other capsctl functions use it comes with
    ``capsctl.load_checkpoint(path)``, which returns ``(model, metadata)``.

    Loading is strict: a missing or unexpected tensor raises
    :class:`~capsctl.errors.CheckpointError` naming it.
    """
    path = resolve_pretrained(
        name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only
    )
    model, meta = load_checkpoint(path, device=device)
    model.pretrained_cfg = config_from_metadata(meta)
    return model
