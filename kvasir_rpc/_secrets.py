"""Secret files (wallets, hub keys, tokens, TLS private keys): written mode 0600 without a
moment in which anyone else could read them, and checked for loose permissions when loaded.

A secret is never written in place: it goes to a fresh temporary file in the same folder,
created 0600 with O_EXCL (so nobody else can have it open), synced, then renamed over the
target (or hard-linked to it when the target must not exist yet). Overwriting an old 0644
key therefore leaves a 0600 file, and a reader sees the old file or the new one, whole.
"""

from __future__ import annotations

import os
import pathlib
import secrets
import stat

from kvasir_rpc._log import get_logger

__all__ = ["check_secret_mode", "ensure_state_dir", "write_secret"]

#: The name of the project's state folder (STATE_DIR, ``.kvasir``): one found on a path is
#: this project's, so it may be tightened to the owner's alone.
_STATE_DIR_NAME = ".kvasir"


def ensure_state_dir(path: str | os.PathLike[str]) -> pathlib.Path:
    """Make the folder ``path`` for state files (keys, tokens, databases), its missing parents
    too, each folder made mode 0700 whatever the umask: what goes in it is the owner's alone,
    as the README promises of ``.kvasir/``. Returns ``path``; raises OSError when a folder
    cannot be made.

    A ``.kvasir`` folder that exists already on the path, and any folder under one, is
    tightened to 0700 when it is this user's and others may open it: earlier versions made
    it 0755, and its wallets and keys sit inside. Any other folder that exists (the working
    directory, a folder given with a flag) is the person's choice and is left as it is, and
    so is a symbolic link (its target is someone's choice too)."""
    p = pathlib.Path(path)
    missing: list[pathlib.Path] = []
    folder = p
    while not folder.exists() and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        try:
            os.mkdir(made, 0o700)
        except FileExistsError:  # made by another process at the same moment: theirs is as good
            if not made.is_dir():
                raise
            continue
        os.chmod(made, 0o700)  # the umask may have taken the owner's own bits away
    _tighten_state_dirs(p)
    return p


def _tighten_state_dirs(path: pathlib.Path) -> None:
    """chmod 0700 the ``.kvasir`` folders on ``path`` and the folders under them, where they
    are this user's, open to others and not symbolic links (best effort: never raises)."""
    if os.name != "posix":
        return
    for folder in (path, *path.parents):
        if _STATE_DIR_NAME not in folder.parts:
            break  # the folders above the state folder are not the project's
        try:
            st = os.lstat(folder)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
                os.chmod(folder, 0o700)
        except OSError:
            continue


def write_secret(path: str | os.PathLike[str], data: bytes | str, *, replace: bool = True) -> None:
    """Write ``data`` to ``path`` with mode 0600 whatever the umask, atomically.

    Missing parent folders are created mode 0700 (``ensure_state_dir``). With ``replace`` an
    existing file is replaced (its old mode does not survive); without it, FileExistsError is
    raised when ``path`` exists, even if another process creates it at the same moment.
    Raises OSError when the folder is not writable; no temporary file is left behind either
    way.
    """
    p = pathlib.Path(path)
    blob = data.encode() if isinstance(data, str) else data
    ensure_state_dir(p.parent)
    tmp = p.with_name(f".{p.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)  # the umask may have taken bits away; never adds any
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, p)
        else:
            os.link(tmp, p)  # fails with FileExistsError rather than clobber a key someone just made
    finally:
        tmp.unlink(missing_ok=True)
    _sync_folder(p.parent)


def _sync_folder(folder: pathlib.Path) -> None:
    # The rename itself is durable only once the folder is synced (POSIX; a no-op elsewhere).
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_secret_mode(path: str | os.PathLike[str], what: str = "secret file") -> bool:
    """Whether only its owner may read ``path``; otherwise log a warning naming the file, its
    mode and the fix (``chmod 600 FILE``). The file is still used: this never raises, and a
    file that cannot be inspected (or a platform without POSIX modes) counts as private."""
    if os.name != "posix":
        return True
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return True
    if mode & 0o077 == 0:
        return True
    # A logger per call: the one in force now (tests capture logs; main() configures late).
    get_logger("kvasir_rpc.secrets").warning(f"{what} is open to other users", file=str(path),
                                             mode=f"{mode:04o}", fix=f"chmod 600 {path}")
    return False
