"""Configuration shared by the command-line tools: where the store and the
spool are, and the copier's settings.

The store spec syntax, and the VERNEUIL_CONFIG environment variable, belong
to `verneuil_fuse.store.config`; this module only decides which spec applies
(`--store`, else VERNEUIL_CONFIG, asked of the store layer) and reads the keys
around it:

- `replication_spooling_dir` (Verneuil's key): the spool directory;
- `copier` (this project's addition, optional): an object with any of
  `rate` (requests per second, 0 = unpaced), `burst`, `workers`, `db_workers`,
  `poll_interval`, `lock_timeout`, `touch_interval` (seconds);
- `max_db_size` (this project's addition, optional): the largest database
  replicated, in bytes, at most and by default `format.MAX_REPLICATED_DB_SIZE`
  (about 1.5 TiB); the writer (csrc/config.c reads the same key), the copier
  and `verneuilctl lag` apply it alike (`max_db_size`).
"""
from __future__ import annotations

from typing import Any, Optional

from verneuil_fuse import format as fmt
from verneuil_fuse.store import ENV_VAR, ConfigError, parse_config
from verneuil_fuse.store.config import env_config_present

SPOOL_KEY = "replication_spooling_dir"
MAX_DB_SIZE_KEY = "max_db_size"
COPIER_KEY = "copier"
COPIER_OPTIONS = {"rate": float, "burst": int, "workers": int, "db_workers": int,
                  "poll_interval": float,
                  "lock_timeout": float, "touch_interval": float}


def load(store_arg: Optional[str] = None) -> dict[str, Any]:
    """The configuration `--store` names, else VERNEUIL_CONFIG's."""
    return parse_config(store_arg)


def load_optional(store_arg: Optional[str] = None) -> dict[str, Any]:
    """Like `load`, but {} when nothing is configured at all."""
    if store_arg is None and not env_config_present():
        return {}
    return load(store_arg)


def spool_dir(spool_arg: Optional[str], store_arg: Optional[str] = None) -> str:
    """`--spool`, else `replication_spooling_dir` from the `--store` config
    (when it is a config) or from VERNEUIL_CONFIG."""
    if spool_arg:
        return spool_arg
    for spec in (store_arg, None) if store_arg else (None,):
        try:
            cfg = load_optional(spec)
        except ConfigError:
            if spec is None:
                raise
            continue
        value = cfg.get(SPOOL_KEY)
        if value:
            if not isinstance(value, str):
                raise ConfigError("%s must be a path string" % SPOOL_KEY)
            return value
    raise ConfigError("no spool directory: pass --spool DIR or set %s in %s"
                      % (SPOOL_KEY, ENV_VAR))


def copier_options(config: dict[str, Any]) -> dict[str, Any]:
    """Copier keyword arguments from the optional `copier` object."""
    section = config.get(COPIER_KEY) or {}
    if not isinstance(section, dict):
        raise ConfigError("%s must be an object" % COPIER_KEY)
    out: dict[str, Any] = {}
    for key, value in section.items():
        kind = COPIER_OPTIONS.get(key)
        if kind is None:
            raise ConfigError("unknown %s option %r (known: %s)"
                              % (COPIER_KEY, key, ", ".join(sorted(COPIER_OPTIONS))))
        try:
            out[key] = kind(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise ConfigError("%s.%s must be a number" % (COPIER_KEY, key)) from None
    return out


def max_db_size(config: dict[str, Any]) -> int:
    """The largest database replicated (`max_db_size`, bytes): 1 to
    `format.MAX_REPLICATED_DB_SIZE`, which is also the default."""
    value = config.get(MAX_DB_SIZE_KEY)
    if value is None:
        return fmt.MAX_REPLICATED_DB_SIZE
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= fmt.MAX_REPLICATED_DB_SIZE:
        raise ConfigError("%s must be a number of bytes from 1 to %d (%s), not %r"
                          % (MAX_DB_SIZE_KEY, fmt.MAX_REPLICATED_DB_SIZE,
                             fmt.format_size(fmt.MAX_REPLICATED_DB_SIZE), value))
    return value
