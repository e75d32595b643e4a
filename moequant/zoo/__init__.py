"""Small MoE language models trained by `moequant/zoo/train.py` and shipped with the package.

`zoo:NAME` anywhere a model is accepted means the folder `moequant/zoo/NAME/` (a plain
Hugging Face checkpoint: config.json, model.safetensors, tokenizer files, README.md, card.json).
This lookup imports nothing of the trainer (which imports calibration's corpora), so the checkpoint
opener reads `zoo:NAME` through it.
"""

from __future__ import annotations

from pathlib import Path

from moequant.errors import UserError

ZOO_DIR = Path(__file__).resolve().parent
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
