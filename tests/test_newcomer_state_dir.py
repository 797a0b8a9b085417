""".kvasir/ is the owner's alone (mode 0700), as the README says, whatever the umask: made so
by ensure_state_dir, which write_secret (wallets, the hub's key, tokens) and make_state_parent
(the hub's and the ledger's databases) make their folders with; a 0755 one made by an older
version is tightened, and folders that are not the project's are left as they are."""

from __future__ import annotations

import os
import pathlib
import stat
from collections.abc import Iterator

import pytest

from kvasir_rpc import Wallet, ensure_state_dir, load_or_create_token, make_state_parent, write_secret

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX modes")


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(autouse=True)
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_the_state_folder_is_made_0700_under_umask_022(tmp_path: pathlib.Path) -> None:
    state = tmp_path / ".kvasir"
    assert ensure_state_dir(state) == state
    assert _mode(state) == 0o700
    deep = tmp_path / "other" / ".kvasir" / "models"
    ensure_state_dir(deep)  # every folder it makes is 0700, its parents too
    assert _mode(deep) == _mode(deep.parent) == _mode(deep.parent.parent) == 0o700


def test_even_a_umask_that_takes_the_owners_bits_leaves_0700(tmp_path: pathlib.Path) -> None:
    os.umask(0o277)
    ensure_state_dir(tmp_path / ".kvasir")
    assert _mode(tmp_path / ".kvasir") == 0o700


def test_an_old_0755_state_folder_is_tightened_and_others_are_left(tmp_path: pathlib.Path) -> None:
    project = tmp_path / "project"
    state = project / ".kvasir"
    models = state / "models"
    models.mkdir(parents=True, mode=0o755)
    os.chmod(state, 0o755)
    os.chmod(project, 0o755)
    ensure_state_dir(models)
    assert _mode(models) == _mode(state) == 0o700
    assert _mode(project) == 0o755  # the person's folder, not the project's
    mine = tmp_path / "keys"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    ensure_state_dir(mine)
    assert _mode(mine) == 0o755  # a folder someone chose with a flag: their choice


def test_a_state_folder_that_is_a_link_is_left_as_it_is(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "shared"
    target.mkdir()
    os.chmod(target, 0o755)
    (tmp_path / ".kvasir").symlink_to(target)
    ensure_state_dir(tmp_path / ".kvasir")
    assert _mode(target) == 0o755


def test_a_file_in_the_way_is_an_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / ".kvasir").write_text("")
    with pytest.raises(OSError):
        ensure_state_dir(tmp_path / ".kvasir" / "certs")


def test_keys_tokens_and_databases_get_a_0700_state_folder(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Wallet.load_or_create(pathlib.Path(".kvasir") / "wallet.key")  # a worker's wallet, a hub's key
    assert _mode(tmp_path / ".kvasir") == 0o700
    os.chmod(tmp_path / ".kvasir", 0o755)
    load_or_create_token(pathlib.Path(".kvasir") / "hub-backbone.token")  # the hub's backbone token
    assert _mode(tmp_path / ".kvasir") == 0o700
    os.chmod(tmp_path / ".kvasir", 0o755)
    make_state_parent(pathlib.Path(".kvasir") / "ledger.db")  # the ledger's and the hub's databases
    assert _mode(tmp_path / ".kvasir") == 0o700
    write_secret(tmp_path / "new" / "ca.key", b"k")  # a folder made for a secret is private too
    assert _mode(tmp_path / "new") == 0o700 and _mode(tmp_path / "new" / "ca.key") == 0o600
