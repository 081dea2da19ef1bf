"""Hardware profiles: named, versioned JSON documents holding tuned ZenFlowConfig settings.

A profile is a small JSON document (``schema_version`` 1)::

    {
      "schema_version": 1,
      "name": "h100-sxm5",
      "description": "...",
      "hardware": {...facts: link/memory bandwidth, FLOP/s, host cores, citation...},
      "settings": {...ZenFlowConfig field values...},
      "provenance": {"source": "paper-defaults" | "measured" | "modelled", ...}
    }

Built-in profiles ship in ``zenflow_triton/profiles/builtin/*.json``. Tuned profiles (written
by ``zenflow-tune run``) go to :func:`user_profile_dir` and win over built-ins of the same
name. :func:`load_profile` validates everything up front: an unknown name lists the known ones
and the closest match; a corrupt or wrong-schema file names the file and the problem; a
profile written by a newer schema fails with a message that says so.

This module imports neither the optimizer nor ``autotune`` (the optimizer imports it lazily
for ``ZenFlowOptimizer.from_profile``).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from ..config import ConfigError, ZenFlowConfig

__all__ = [
    "SCHEMA_VERSION",
    "PROFILE_DIR_ENV",
    "Profile",
    "ProfileError",
    "ProfileNotFoundError",
    "builtin_profile_dir",
    "user_profile_dir",
    "profile_path",
    "load_profile",
    "list_profiles",
    "save_profile",
    "validate_name",
]

SCHEMA_VERSION = 1
"""The profile schema this library reads and writes. Older versions would be migrated here;
newer ones are refused (they may hold fields whose meaning this version does not know)."""

PROFILE_DIR_ENV = "ZENFLOW_PROFILE_DIR"
"""Environment variable that overrides :func:`user_profile_dir`."""

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_PROVENANCE_SOURCES = ("paper-defaults", "library-defaults", "measured", "model", "modelled")
_REQUIRED = ("schema_version", "name", "hardware", "settings", "provenance")


class ProfileError(ValueError):
    """A profile file is unreadable, corrupt, of an unsupported schema, or holds bad settings."""


class ProfileNotFoundError(ProfileError, LookupError):
    """No profile of that name exists (neither a user profile nor a built-in)."""

    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = known
        close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.4)
        self.closest = close[0] if close else None
        hint = f" Did you mean {self.closest!r}?" if self.closest else ""
        super().__init__(
            f"unknown profile {name!r}.{hint} Known profiles: {', '.join(known) or '(none)'}. "
            f"User profiles are read from {user_profile_dir()} (set ${PROFILE_DIR_ENV} to change)."
        )


@dataclass(frozen=True)
class Profile:
    """One hardware profile. ``settings`` holds ZenFlowConfig field values only."""

    name: str
    settings: dict[str, Any]
    hardware: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    schema_version: int = SCHEMA_VERSION
    path: Path | None = None
    source: Literal["builtin", "user", "memory"] = "memory"

    def __post_init__(self) -> None:
        validate_name(self.name)
        try:
            ZenFlowConfig.from_dict(dict(self.settings))
        except (ConfigError, TypeError) as e:
            raise ProfileError(f"profile {self.name!r}: invalid settings: {e}") from None

    def config(self, **overrides: Any) -> ZenFlowConfig:
        """The profile's settings as a validated ZenFlowConfig, with ``overrides`` applied
        (unknown or out-of-range overrides raise :class:`~zenflow_triton.config.ConfigError`)."""
        return ZenFlowConfig.from_dict(dict(self.settings)).replace(**overrides)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (without the file path)."""
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "description": self.description,
            "hardware": self.hardware,
            "settings": self.settings,
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, doc: Any, *, path: Path | None = None,
                  source: Literal["builtin", "user", "memory"] = "memory") -> "Profile":
        """Validate a parsed JSON document; errors name ``path`` (when given) and the problem."""
        where = str(path) if path is not None else "<profile document>"

        def fail(problem: str) -> ProfileError:
            return ProfileError(f"{where}: {problem}")

        if not isinstance(doc, dict):
            raise fail(f"expected a JSON object, got {type(doc).__name__}")
        missing = [k for k in _REQUIRED if k not in doc]
        if missing:
            raise fail(f"missing required key(s) {missing}")
        version = doc["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise fail(f"schema_version must be a positive integer, got {version!r}")
        if version > SCHEMA_VERSION:
            raise fail(
                f"schema_version {version} is newer than this zenflow-triton supports "
                f"({SCHEMA_VERSION}); upgrade zenflow-triton to read this profile"
            )
        for key in ("hardware", "settings", "provenance"):
            if not isinstance(doc[key], dict):
                raise fail(f"{key!r} must be a JSON object, got {type(doc[key]).__name__}")
        name = doc["name"]
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise fail(f"invalid profile name {name!r} (lowercase letters, digits, '.', '_', '-')")
        if path is not None and path.stem != name:
            raise fail(f"declares name {name!r} but the file is named {path.name!r}; "
                       f"a profile's file must be <name>.json")
        src = doc["provenance"].get("source")
        if src not in _PROVENANCE_SOURCES:
            raise fail(f"provenance.source must be one of {list(_PROVENANCE_SOURCES)}, got {src!r}")
        try:
            ZenFlowConfig.from_dict(dict(doc["settings"]))
        except (ConfigError, TypeError) as e:
            raise fail(f"invalid settings: {e}") from None
        desc = doc.get("description", "")
        return cls(name=name, settings=dict(doc["settings"]), hardware=dict(doc["hardware"]),
                   provenance=dict(doc["provenance"]),
                   description=desc if isinstance(desc, str) else str(desc),
                   schema_version=version, path=path, source=source)


# ---- locations ---------------------------------------------------------------------------
def builtin_profile_dir() -> Path:
    """Directory of the profiles that ship with the package."""
    return Path(__file__).resolve().parent / "builtin"


def platform_dir(kind: str) -> Path:
    """zenflow-triton's per-user folder for ``kind`` "config" or "data" files:
    ``$XDG_CONFIG_HOME`` / ``$XDG_DATA_HOME`` (``~/.config``, ``~/.local/share``) on Linux,
    ``~/Library/Application Support`` on macOS, ``%APPDATA%`` / ``%LOCALAPPDATA%`` on
    Windows. It need not exist."""
    if kind not in ("config", "data"):
        raise ValueError(f'kind must be "config" or "data", got {kind!r}')
    if sys.platform == "win32":
        var, default = ("APPDATA", ("AppData", "Roaming")) if kind == "config" else \
            ("LOCALAPPDATA", ("AppData", "Local"))
        base = Path(os.environ.get(var) or Path.home().joinpath(*default))
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        var, default = ("XDG_CONFIG_HOME", (".config",)) if kind == "config" else \
            ("XDG_DATA_HOME", (".local", "share"))
        base = Path(os.environ.get(var) or Path.home().joinpath(*default))
    return base / "zenflow-triton"


def user_profile_dir() -> Path:
    """Directory of tuned (user) profiles: ``$ZENFLOW_PROFILE_DIR`` if set, else
    ``platform_dir("config") / "profiles"``. It need not exist."""
    env = os.environ.get(PROFILE_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return platform_dir("config") / "profiles"


def validate_name(name: Any) -> str:
    """A profile name is also its file name: lowercase letters, digits, '.', '_', '-'."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProfileError(
            f"invalid profile name {name!r}: use 1-64 lowercase letters, digits, '.', '_' or "
            f"'-', starting with a letter or digit"
        )
    return name


def _names_in(directory: Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.json") if p.is_file())


def known_profile_names() -> list[str]:
    """Every name :func:`load_profile` would look for: user and built-in, deduplicated."""
    return sorted(set(_names_in(user_profile_dir())) | set(_names_in(builtin_profile_dir())))


def profile_path(name: str) -> Path:
    """The file ``load_profile(name)`` reads: the user one if present, else the built-in."""
    if isinstance(name, str) and not _NAME_RE.match(name) and _NAME_RE.match(name.lower()):
        name = name.lower()  # names are lower case: "A100-PCIE4" is a100-pcie4
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ProfileNotFoundError(str(name), known_profile_names())
    for directory in (user_profile_dir(), builtin_profile_dir()):
        p = directory / f"{name}.json"
        if p.is_file():
            return p
    raise ProfileNotFoundError(name, known_profile_names())


def read_profile_file(path: str | os.PathLike[str],
                      source: Literal["builtin", "user", "memory"] = "memory") -> Profile:
    """Read and validate one profile file (any path)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
                           ) from None
    return Profile.from_dict(doc, path=path, source=source)


def load_profile(name: str) -> Profile:
    """Load a profile by name: a user profile (see :func:`user_profile_dir`) wins over a
    built-in of the same name. Raises :class:`ProfileNotFoundError` or :class:`ProfileError`."""
    path = profile_path(name)
    source = "builtin" if path.parent == builtin_profile_dir() else "user"
    return read_profile_file(path, source=source)


def list_profiles(*, errors: Literal["raise", "skip", "collect"] = "raise"
                  ) -> list[Profile] | tuple[list[Profile], list[ProfileError]]:
    """Every visible profile (user ones shadow built-ins), sorted by name.

    ``errors="raise"`` raises on the first bad file; ``"skip"`` ignores bad files;
    ``"collect"`` returns ``(profiles, errors)``.
    """
    found: list[Profile] = []
    bad: list[ProfileError] = []
    for name in known_profile_names():
        try:
            found.append(load_profile(name))
        except ProfileError as e:
            if errors == "raise":
                raise
            bad.append(e)
    if errors == "collect":
        return found, bad
    return found


def save_profile(profile: Profile, directory: str | os.PathLike[str] | None = None, *,
                 overwrite: bool = True) -> Path:
    """Write ``profile`` as ``<directory>/<name>.json`` (default :func:`user_profile_dir`),
    atomically (temp file + rename) so a crash never leaves a half-written profile."""
    directory = Path(directory) if directory is not None else user_profile_dir()
    validate_name(profile.name)
    doc = profile.to_dict()
    Profile.from_dict(json.loads(json.dumps(doc)))  # round-trip check before touching disk
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"{profile.name}.json"
    if target.exists() and not overwrite:
        raise ProfileError(f"{target}: exists (pass overwrite=True to replace it)")
    fd, tmp = tempfile.mkstemp(prefix=f".{profile.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target


def describe(profile: Profile) -> str:
    """A human-readable multi-line summary (used by ``zenflow-tune show``)."""
    lines = [f"{profile.name}  ({profile.source}: {profile.path or '-'})"]
    if profile.description:
        lines.append(f"  {profile.description}")
    quality = profile.provenance.get("quality")
    if isinstance(quality, dict) and quality.get("summary"):
        extra = "".join(f"; {k} {', '.join(map(str, quality[k]))}" for k in ("models", "seeds")
                        if quality.get(k))
        lines.append(f"  quality: {quality.get('source', '?')}: {quality['summary']}{extra}")
    lines.append("  settings:")
    lines += [f"    {k} = {v!r}" for k, v in profile.settings.items()]
    lines.append("  hardware:")
    lines += [f"    {k} = {v}" for k, v in _flatten(profile.hardware)]
    lines.append("  provenance:")
    lines += [f"    {k} = {v}" for k, v in _flatten(profile.provenance)]
    return "\n".join(lines)


def _flatten(d: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v
