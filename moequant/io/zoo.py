"""The bundled models (`zoo:NAME`): where their folders are, read by the checkpoint opener and `moequant.zoo`.

Their folders, and the trainer that made them, are `moequant/zoo/`; this lookup sits with the readers so
that opening `zoo:NAME` does not depend on the trainer (which imports calibration's corpora).
"""

from __future__ import annotations

from pathlib import Path

from moequant.errors import UserError

ZOO_DIR = Path(__file__).resolve().parents[1] / "zoo"
DEFAULT_MODEL = "tiny-qwen2moe"


def names() -> list[str]:
    """The bundled models: every sub-folder that holds a config.json."""
    return sorted(p.name for p in ZOO_DIR.iterdir() if (p / "config.json").is_file())


def path(name: str) -> Path:
    """The folder of bundled model `name` (with or without the `zoo:` prefix)."""
    bare = name[4:] if name.startswith("zoo:") else name
    available = names()
    if bare not in available:
        raise UserError(
            f"zoo model {bare!r} does not exist; available: {', '.join('zoo:' + n for n in available) or 'none'}."
        )
    return ZOO_DIR / bare
