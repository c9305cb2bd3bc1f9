"""Where the server's API key comes from: --api-key-file PATH, the GPT2KIT_API_KEY environment
variable, or --api-key KEY (visible to every local user in the process list, /proc/PID/cmdline).
"""

from __future__ import annotations

import os
import stat

ENV = "GPT2KIT_API_KEY"


def resolve_api_key(flag: str | None, path: str | None, environ=os.environ) -> tuple[str | None, list[str]]:
    """(the key or None, warnings to print). At most one source may be given; a key is one line of
    visible characters; a key file that other users can read is used with a warning."""
    env = environ.get(ENV)
    given = [name for name, v in (("--api-key", flag), ("--api-key-file", path), (ENV, env)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give the API key one way, not {' and '.join(given)}")
    warnings = []
    if path is not None:
        try:
            mode = os.stat(path).st_mode
            with open(path, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the API key file {path}: {e}") from None
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            warnings.append(f"the API key file {path} is readable by other users (mode {stat.S_IMODE(mode):04o}); "
                            f"chmod 600 {path}")
        where = f"the API key file {path}"
    elif env is not None:
        key, where = env.strip(), f"${ENV}"
    elif flag is not None:
        key, where = flag, "--api-key"
        warnings.append(f"--api-key is visible to every local user in the process list; use --api-key-file "
                        f"PATH or ${ENV} instead")
    else:
        return None, []
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{where} must hold one key of visible characters (no spaces or line breaks), "
                         f"got {len(key)} characters")
    return key, warnings
