"""Quality of a quantized MoE model against its original, on the same tokens.

    quality = evaluate(reference_model, quantized_model, samples, batch_size=4)     # two loaded models
    quality = evaluate_streaming("out/checkpoint", "path/to/original", samples)    # the same, layer by layer
    quality = evaluate_checkpoints("out/checkpoint", "path/to/original")   # `moequant eval` (streamed)

Both models see the same token windows (an evaluation split disjoint from calibration, see
data.py). What is measured, and on which positions:

- perplexity: exp(mean next-token NLL) over the positions that have a next token (T-1 per
  window), log-softmax in float64;
- KL(original || quantized) per position over every position of every window (T per window):
  sum_v p(v) (log p(v) - log q(v)) in float64 from the two models' logits; mean, p90, p99
  (linear interpolation between order statistics, numpy's default), max;
- top-1 agreement: share of those positions where both models' argmax is the same token;
- routing agreement per MoE layer: share of tokens whose top-k expert *set* is unchanged,
  each model routing its own hidden states (forward hooks on the router module, whose output
  is (logits, weights, indices)); `routing_agreement` is the mean over MoE layers;
- MoE-block output relative error per layer, sqrt(sum ||y_q - y_ref||^2 / sum ||y_ref||^2)
  over all tokens, in two variants:
  `moe_output_error`: both blocks see the *reference* model's input of that layer (the quantized
  block is run a second time on it, through the quantized model's own pre-MoE norm, which an
  AWQ scale may have changed), so it isolates that block's own quantization error;
  `moe_output_error_accumulated`: each block sees its own model's input, so it includes the
  drift of every earlier layer;
- per routed expert (reference input, reference routing, only the tokens the reference router
  sends to it): relative error of the expert's output and its squared error per routed token
  (the unit of calibration's predicted sensitivity); `error` is None for an expert that got no
  token;
- the reference model's routing share per expert on these tokens (sums to 1 per layer);
- per domain (when samples carry one): perplexities, KL mean / p99, top-1 and routing agreement.

Batches bound memory: logits are turned into float64 statistics a few thousand positions at a
time, and only per-position KL values (one float64 each) are kept across batches.

Streaming (`evaluate_streaming`, what `moequant eval` and `apply`'s report run): neither model
is loaded; both checkpoints run through moequant.io.layers.LayerRunner one decoder layer at a time
(one layer of each in memory, quantized weights dequantized as they are read), each batch's
hidden states carried layer to layer, and the same hooks and per-batch arithmetic (`Tally`)
as `evaluate`, which stays the reference implementation (tests/test_evaluate.py compares them).
Host memory: two decoder layers + embeddings / heads + both models' hidden states of the
evaluation tokens.

The package: compare.py runs both models (loaded or streamed) and feeds tally.py's `Tally`; capture.py holds
the hooks and the per-expert error arithmetic; checkpoints.py is `moequant eval` on two checkpoints.
"""

from __future__ import annotations

from moequant.evaluate.capture import expert_output_errors
from moequant.evaluate.checkpoints import evaluate_checkpoints, format_quality, load_quantized, run_lm_eval
from moequant.evaluate.compare import evaluate, evaluate_streaming

__all__ = [
    "evaluate",
    "evaluate_checkpoints",
    "evaluate_streaming",
    "expert_output_errors",
    "format_quality",
    "load_quantized",
    "run_lm_eval",
]
