"""llama.cpp's i-quants as formats: IQ4_XS (4.25 bits), IQ3_S (3.44), IQ3_XXS (3.06), IQ2_S (2.56),
IQ2_XS (2.31), IQ2_XXS (2.06) — the types of llama.cpp's low-bit mixtures — quantized by ggml's own
quantizer with our imatrix, read back with gguf-py's dequantizer.

A QuantizedTensor of these holds the packed blocks, as the other ggml types do: codes uint8
[..., out, in / 256 * block bytes]; only GGUF holds them (target llama.cpp).

Why ggml's quantizer, not an encoder of our own: IQ2 / IQ3 codes are indices into ggml's lattice
codebooks (the iq2xxs / iq2xs / iq2s / iq3xxs / iq3s grids, 256 to 1024 entries each, plus sign
and scale layouts); an encoder of our own would have to carry those tables and search them as ggml
does, and would still be checked against ggml bit for bit. What moequant adds is the choice of type
per (layer, projection) from measured sensitivity and usage, and the importance it quantizes with
(per expert: each expert's own input second moments, which llama-imatrix sees only for routed
tokens); the codes inside a type are ggml's own (ggml_quantize_chunk with that imatrix, run in the
llama.cpp venv by moequant.llamacpp.runner — llama.cpp is built once when missing). GPTQ on
these grids is not offered: the lattice has no per-column rounding to feed back the error.
"""

from __future__ import annotations

import numpy as np
import torch

from moequant.errors import UserError
from moequant.formats.specs import Format, FormatSpec, register, take_params

# name: (ggml type name, bytes per 256 weights, nominal bits of a code), from ggml's block layouts
IQ_TYPES = {
    "iq4_xs": ("IQ4_XS", 136, 4),
    "iq3_s": ("IQ3_S", 110, 3),
    "iq3_xxs": ("IQ3_XXS", 98, 3),
    "iq2_s": ("IQ2_S", 82, 2),
    "iq2_xs": ("IQ2_XS", 74, 2),
    "iq2_xxs": ("IQ2_XXS", 66, 2),
}
BLOCK = 256


def _qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[IQ_TYPES[name][0]]


class GgmlIQuants(Format):
    """IQ types: ggml's quantizer and codebooks, our imatrix and choice; only GGUF holds them."""

    names = tuple(IQ_TYPES)
    ggml = True

    def spec(self, name, params):
        take_params(name, params, {})
        return FormatSpec(name, IQ_TYPES[name][2], "group", BLOCK, True)

    def map_char(self, spec):
        return None

    def default_algorithm(self, name):
        return "imatrix"

    def nbytes(self, spec, rows, cols, symmetric_zeros):
        return rows * (cols // BLOCK) * IQ_TYPES[spec.name][1]

    def quantize(self, x: torch.Tensor, spec, importance=None, hessian=None) -> torch.Tensor:
        """float32 [..., out, in] -> packed blocks, by ggml_quantize_chunk with `importance` ([in] or [..., in],
        the inputs' second moments) as its imatrix (ones when None: IQ2_XXS / IQ2_XS need one)."""
        from moequant.llamacpp.runner import ggml_quantize

        if hessian is not None:
            raise UserError(
                f"GPTQ is not offered for {spec.name} (ggml's lattice codebook has no per-column rounding); "
                f"use algorithm imatrix for it."
            )
        rows, cols = x.shape[-2], x.shape[-1]
        flat = x.reshape(-1, rows, cols).float()
        imp = torch.ones(cols) if importance is None else importance.float()
        imp = (
            imp.reshape(-1, cols).expand(flat.shape[0], cols)
            if imp.dim() == 1 or imp.shape[0] == 1
            else imp.reshape(flat.shape[0], cols)
        )
        out = ggml_quantize(
            [(spec.name, flat[i].numpy(), imp[i].clamp_min(1e-12).numpy()) for i in range(flat.shape[0])]
        )
        return torch.from_numpy(np.stack(out)).reshape(*x.shape[:-1], -1)

    def dequantize(self, codes: torch.Tensor, spec, shape) -> torch.Tensor:
        import gguf

        values = gguf.quants.dequantize(codes.cpu().numpy(), _qtype(spec.name))
        return torch.from_numpy(np.asarray(values, dtype=np.float32)).reshape(tuple(shape))


register(GgmlIQuants())
