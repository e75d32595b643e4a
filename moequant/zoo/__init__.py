"""Small MoE language models trained by `moequant/zoo/train.py` and shipped with the package.

`zoo:NAME` anywhere a model is accepted means the folder `moequant/zoo/NAME/` (a plain
Hugging Face checkpoint: config.json, model.safetensors, tokenizer files, README.md, card.json).
"""

from moequant.io.zoo import DEFAULT_MODEL, ZOO_DIR, names, path

__all__ = ["DEFAULT_MODEL", "ZOO_DIR", "names", "path"]
