"""Where ``torch.compile`` keeps, and loads again, the code it generates: a folder of this user's
that no other user can write to.

TorchInductor's default is ``$TMPDIR/torchinductor_<user>``: a predictable name in a folder
every user can write to, whose compiled libraries and pickled graphs it loads without asking
who made them. :func:`use_private_compile_cache` points it (``TORCHINDUCTOR_CACHE_DIR``) at
``inductor/`` in capsctl's cache (``$CAPSCTL_CACHE``, else ``$XDG_CACHE_HOME/capsctl`` or
``~/.cache/capsctl``; empty variables count as unset), made private; where that cannot be
used, at a fresh private temporary folder (nothing is reused between runs then). A folder the
user names in ``TORCHINDUCTOR_CACHE_DIR`` (other than that default, which torch itself writes
there once used) is kept, and refused when another user owns it or
can write to it. Imports nothing of torch: call it before the first compilation.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import tempfile
from pathlib import Path

from capsctl.errors import CapsctlError
from capsctl.user_cache import cache_root, not_private

__all__ = ["COMPILE_CACHE_ENV", "use_private_compile_cache"]

#: TorchInductor's environment variable for its cache folder.
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"

log = logging.getLogger(__name__)


def use_private_compile_cache() -> Path:
    """Point ``torch.compile``'s cache at a private folder and return it (see the module's
    docstring); :class:`CapsctlError` when ``TORCHINDUCTOR_CACHE_DIR`` names a folder others
    can write to."""
    given = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if given and os.path.abspath(given) != _torch_default():  # torch sets it on first use
        folder = Path(given)
        why = not_private(folder) if folder.exists() else None
        if why is not None:
            raise CapsctlError(
                f"{COMPILE_CACHE_ENV}={given}: the folder {why}, and torch.compile loads code "
                f"from it; make it private (chown to yourself, chmod go-w) or unset "
                f"{COMPILE_CACHE_ENV}"
            )
        return folder
    folder = _private_cache_folder()
    os.environ[COMPILE_CACHE_ENV] = str(folder)
    return folder


def _torch_default() -> str:
    """TorchInductor's own default folder (torch._inductor.runtime.cache_dir_utils), which torch
    also writes into ``TORCHINDUCTOR_CACHE_DIR`` once it has used it."""
    try:
        user = getpass.getuser()
    except (KeyError, ImportError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    user = re.sub(r'[\\/:*?"<>|]', "_", user)
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + user))


def _private_cache_folder() -> Path:
    root = cache_root()
    if root is not None:
        folder = root / "inductor"
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            why = not_private(folder)
        except OSError as e:
            why = f"cannot be made ({e.strerror})"
        if why is None:
            return folder
        log.warning(
            "not keeping torch.compile's code in %s: it %s; using a private temporary folder "
            "(make it private with chmod go-w, or set CAPSCTL_CACHE to a private folder)",
            folder,
            why,
        )
    return Path(tempfile.mkdtemp(prefix="capsctl-inductor-"))
