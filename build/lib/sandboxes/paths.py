"""Where sandbox state lives when ``SANDBOX_ROOT`` is not set.

Running as root, the local backend's sandbox init processes run as an unprivileged host uid
(``uid_base``) and must traverse every directory above ``SANDBOX_ROOT``. A checkout in ``/root``, a
700 ``mktemp -d`` directory or a 750 home is not traversable, so its ``var/sandboxes`` cannot be used.
Then the default moves to ``/var/lib/flowstate/sandboxes-<hash of the state directory>``: root-owned
directories that only root can write (no squatting as in a world-writable ``/tmp``), one per checkout.
Rootless, the sandbox runs as the caller's own uid, so the checkout's ``var/sandboxes`` always works.
This module must not import Django: settings import it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SHARED_STATE_DIR = Path("/var/lib/flowstate")
"""Parent of per-checkout sandbox roots for checkouts that other users cannot traverse (root only)."""


def untraversable_ancestor(path: Path) -> Path | None:
    """The first existing directory above ``path`` that other users cannot enter (no o+x), or None."""
    for ancestor in reversed(Path(path).absolute().parents):
        try:
            mode = os.stat(ancestor).st_mode
        except FileNotFoundError:
            break
        if not mode & 0o001:
            return ancestor
    return None


def default_sandbox_root(state_dir: Path, *, euid: int | None = None) -> Path:
    """``state_dir/sandboxes``, unless running as root below a directory other users cannot traverse."""
    preferred = Path(state_dir).absolute() / "sandboxes"
    if (os.geteuid() if euid is None else euid) != 0 or untraversable_ancestor(preferred) is None:
        return preferred
    digest = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:16]
    return SHARED_STATE_DIR / f"sandboxes-{digest}"


def ensure_shared_state_dir() -> None:
    """Create ``/var/lib/flowstate`` as root-owned 0711 (enterable, not listable, writable by root only)."""
    SHARED_STATE_DIR.mkdir(mode=0o711, exist_ok=True)
    info = os.lstat(SHARED_STATE_DIR)
    if not os.path.isdir(SHARED_STATE_DIR) or os.path.islink(SHARED_STATE_DIR) or info.st_uid != 0:
        raise PermissionError(f"{SHARED_STATE_DIR} must be a root-owned directory, not a link")
    os.chmod(SHARED_STATE_DIR, 0o711)
