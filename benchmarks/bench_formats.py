"""Quantize + pack throughput per format, in GB/s of bf16 input.

    python benchmarks/bench_formats.py                       # CPU, [8, 1024, 2048] bf16 expert stack
    python benchmarks/bench_formats.py --device cuda --experts 64
    python benchmarks/bench_formats.py --keys all --threads 2

Each figure is the best of --repeat runs of quantize(weight, key) followed by the
compressed-tensors packer (plus, for int4, the GPTQ and AWQ packers on their own line).
The weight is Student-t distributed (heavy tails, like real expert weights).
"""

import argparse
import time

import torch

from moequant import formats
from moequant.layouts.awq import pack_awq
from moequant.layouts.gptq import pack_gptq

DEFAULT_KEYS = [
    "bf16",
    "fp8-channel",
    "fp8-block128",
    "fp8-tensor",
    "int8-channel",
    "int4-g128-sym",
    "int4-g128-asym",
    "int4-g32-sym",
    "int3-g128-sym",
    "int2-g128-asym",
    "mxfp4",
    "nvfp4",
]


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def best_time(fn, repeat, device):
    fn()  # warm-up (allocator, lazy init)
    sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def mxfp4_rule_errors(rows=512, cols=4096):
    """Relative MSE of MXFP4 round-to-nearest under three e8m0 exponent rules (the evidence for
    the rule moequant uses; see moequant.formats.elements.e8m0_from_amax)."""
    from moequant.formats.elements import decode_e2m1, encode_e2m1

    def qdq(w, rule):
        g = w.unflatten(-1, (-1, 32))
        amax = g.abs().amax(-1, keepdim=True)
        mant, exp = torch.frexp(amax)
        if rule == "OCP floor(log2 amax)-2":
            e = exp - 1 - 2
        elif rule == "nearest pow2 (moequant, CT)":
            e = exp - 1 + (mant >= 0.875).to(exp.dtype) - 2
        else:
            e = torch.ceil(torch.log2(amax / 6)).to(exp.dtype)
        s = torch.exp2(e.float())
        return (decode_e2m1(encode_e2m1(g / s)) * s).flatten(-2)

    torch.manual_seed(1)
    dists = {"normal": torch.randn(rows, cols), "student-t(3)": torch.distributions.StudentT(3.0).sample((rows, cols))}
    print("\nMXFP4 relative MSE by e8m0 exponent rule (%dx%d)" % (rows, cols))
    for rule in ("OCP floor(log2 amax)-2", "nearest pow2 (moequant, CT)", "ceil(log2(amax/6))"):
        errs = ["%s %.5f" % (k, ((qdq(w, rule) - w) ** 2).mean() / (w**2).mean()) for k, w in dists.items()]
        print("  %-28s %s" % (rule, "   ".join(errs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--out", type=int, default=1024)
    ap.add_argument("--in", dest="inp", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--keys", default=",".join(DEFAULT_KEYS), help="comma-separated format keys, or 'all'")
    ap.add_argument("--no-mx-rules", action="store_true", help="skip the MXFP4 exponent-rule error table")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keys = formats.all_keys() if args.keys == "all" else args.keys.split(",")
    shape = (args.experts, args.out, args.inp)
    torch.manual_seed(0)
    w = (torch.distributions.StudentT(3.0).sample(shape) * 0.01).to(torch.bfloat16).to(args.device)
    gb = w.numel() * 2 / 1e9
    print(
        "weight %s bf16 = %.1f MB on %s, torch %s, %d threads"
        % (list(shape), gb * 1e3, args.device, torch.__version__, torch.get_num_threads())
    )
    print("%-16s %10s %10s %12s" % ("format", "GB/s", "ms", "bits/weight"))
    for key in keys:

        def run():
            formats.pack_compressed_tensors(formats.quantize(w, key))

        t = best_time(run, args.repeat, args.device)
        print("%-16s %10.2f %10.1f %12.4f" % (key, gb / t, t * 1e3, formats.parse_key(key).bits_per_weight(shape)))
        if key.startswith("int4-g128"):
            q = formats.quantize(w, key)
            for layout, pack in (("gptq", pack_gptq), ("awq", pack_awq)):
                if layout == "gptq" and not q.spec.symmetric:
                    pack = lambda q: pack_gptq(q, version=2)  # noqa: E731
                tp = best_time(lambda: pack(formats.quantize(w, key)), args.repeat, args.device)
                print("%-16s %10.2f %10.1f %12s" % ("  +" + layout, gb / tp, tp * 1e3, ""))
    if not args.no_mx_rules:
        mxfp4_rule_errors()


if __name__ == "__main__":
    main()
