"""The rollout address file: where a worker finds the trainer, and the keys it needs.

The trainer writes ``<output_dir>/rollout/address.json``; workers on this node or others of
the job (the run directory is on the shared file system) read it. It holds the CURVE keys of
the run's control channel (:mod:`.hub`), so it is a secret: it lives in a directory of mode
0700 and is written with mode 0600, atomically (a fresh temporary file opened with
``O_CREAT | O_EXCL | O_NOFOLLOW``, then renamed over the old one: never a half-written file,
never a planted or symlinked one followed). A worker refuses a file that is a symbolic link,
is not the user's own, is readable by others, or is malformed in any way, with one line
naming the file and the fix (:class:`AddressError`).

Content (JSON): ``{"host": str, "port": 1..65535, "run_id": str, "server_key": z85,
"client_public": z85, "client_secret": z85}`` (z85: 40 characters, a 32-byte CURVE key).
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass
from pathlib import Path

ADDRESS_FILE = "address.json"
_KEYS = ("server_key", "client_public", "client_secret")
_FIELDS = ("host", "port", "run_id", *_KEYS)
_MAX_BYTES = 64 * 1024


class AddressError(ValueError):
    """An address file (or its directory) that a worker must not trust; one line."""


@dataclass(frozen=True)
class Address:
    """Where a worker finds the trainer, and the run's CURVE keys (z85 strings)."""

    host: str
    port: int
    run_id: str
    server_key: str
    """The trainer's public key: the worker checks the server it talks to holds its secret."""
    client_public: str
    client_secret: str
    """The workers' key pair: the trainer admits only connections that prove this key."""

    def write(self, path: Path) -> None:
        """Atomically replace ``path`` (mode 0600) in a private directory (mode 0700)."""
        private_dir(path.parent)
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(self), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # replaces a planted link itself, never what it points to
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def read(cls, path: Path) -> Address:
        """Read and check ``path``; :class:`FileNotFoundError` when it does not exist (yet),
        :class:`AddressError` (one line) for anything else that is wrong with it."""
        fix = "delete it and let the trainer write it (rollout/address.json of the run)"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            if stat.S_ISLNK(os.lstat(path).st_mode):
                raise AddressError(
                    f"{path} is a symbolic link: the trainer never writes one ({fix})"
                ) from None
            raise AddressError(f"{path} cannot be read ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            _check_private(path, st, "file", fix)
            if not stat.S_ISREG(st.st_mode):
                raise AddressError(f"{path} is not a regular file ({fix})")
            raw = f.read(_MAX_BYTES + 1)
        if len(raw) > _MAX_BYTES:
            raise AddressError(f"{path} is over {_MAX_BYTES} bytes: not an address file ({fix})")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AddressError(f"{path} is not JSON ({exc}; {fix})") from None
        return cls.from_dict(data, str(path), fix)

    @classmethod
    def from_dict(cls, data: object, where: str, fix: str) -> Address:
        if not isinstance(data, dict):
            raise AddressError(
                f"{where} holds a {type(data).__name__}, not an object with keys "
                f"{list(_FIELDS)} ({fix})"
            )
        if set(data) != set(_FIELDS):
            raise AddressError(
                f"{where} has keys {sorted(data)}, expected {sorted(_FIELDS)} ({fix})"
            )
        for name in ("host", "run_id", *_KEYS):
            if not isinstance(data[name], str) or not data[name]:
                raise AddressError(
                    f"{where}: {name} must be a non-empty string, got {data[name]!r} ({fix})"
                )
        for name in _KEYS:
            if len(data[name]) != 40:
                raise AddressError(
                    f"{where}: {name} must be a 40-character z85 CURVE key, got "
                    f"{len(data[name])} characters ({fix})"
                )
        port = data["port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise AddressError(
                f"{where}: port must be an integer in 1..65535, got {port!r} ({fix})"
            )
        return cls(**data)


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) or check an existing one is this user's own directory and
    make it 0700; :class:`AddressError` otherwise."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise AddressError(f"{path} must be a directory, not a link or a file: remove it")
    if st.st_uid != os.getuid():
        raise AddressError(
            f"{path} belongs to user id {st.st_uid}, not to you: choose another trainer.output_dir"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def check_private_dir(path: Path) -> None:
    """What a worker checks of the address file's directory: its owner, and that no one else
    can write in it (plant a file)."""
    st = os.stat(path)
    _check_private(path, st, "directory", "it must be the run's rollout directory (mode 0700)")


def _check_private(path: Path, st: os.stat_result, what: str, fix: str) -> None:
    if st.st_uid != os.getuid():
        raise AddressError(
            f"{path}: the {what} belongs to user id {st.st_uid}, not to you (uid "
            f"{os.getuid()}): someone else may have planted it ({fix})"
        )
    mode = stat.S_IMODE(st.st_mode)
    loose = 0o022 if what == "directory" else 0o077
    if mode & loose:
        raise AddressError(
            f"{path}: the {what} has mode {mode:04o}, open to other users ({fix}; the "
            "trainer writes it 0600 in a 0700 directory)"
        )
