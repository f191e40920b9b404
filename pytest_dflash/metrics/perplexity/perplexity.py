"""Perplexity, mean NLL and bits per byte from per-token log-probs, as an ``evaluate`` metric.

Loaded by absolute path through ``pytest_dflash.metrics.load_metric("perplexity")`` (the hub
metric of the same name runs a model itself; this one only scores log-probs an engine already
computed). ``evaluate`` copies this file into its module cache before importing it, so it imports
nothing from this package.

Inputs are natural-log probabilities of each scored token (what ``log_softmax`` gives) and the
UTF-8 byte count of each segment's scored text. Corpus figures pool tokens across segments
(``exp(total NLL / total tokens)``); bits per byte (``total NLL / ln 2 / total bytes``) compares
models with different tokenizers. Per-segment perplexities are returned too, because the ppl
gate judges the largest per-segment change.
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Perplexity, mean NLL (nats/token) and bits per byte from per-token log-probs."
_CITATION = ""
_INPUTS = """
Args:
    logprobs (list of list of float): per segment, the natural-log probability of every scored
        token (each <= 0).
    num_bytes (list of int): per segment, the UTF-8 byte count of the scored text (> 0).
Returns:
    "perplexity", "mean_nll", "bits_per_byte" (corpus), "perplexities" (per segment),
    "tokens", "bytes".
Example:
    >>> metric.compute(logprobs=[[math.log(0.5)] * 4], num_bytes=[4])
    {'perplexity': 2.0, 'mean_nll': 0.693..., 'bits_per_byte': 1.0, ...}
"""


class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features(
                {
                    "logprobs": datasets.Sequence(datasets.Value("float64")),
                    "num_bytes": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, logprobs, num_bytes):
        if not logprobs:
            raise ValueError("no segments given: pass one list of token log-probs per segment")
        total_nll, total_tokens, total_bytes, per_segment = 0.0, 0, 0, []
        for i, (segment, nbytes) in enumerate(zip(logprobs, num_bytes, strict=True)):
            if not segment:
                raise ValueError(f"segment {i} has no scored tokens; drop it or score its tokens")
            if nbytes is None or nbytes <= 0:
                raise ValueError(
                    f"segment {i}: num_bytes must be a positive byte count, got {nbytes}"
                )
            for j, lp in enumerate(segment):
                if not math.isfinite(lp) or lp > 0:
                    raise ValueError(
                        f"segment {i} token {j}: log-prob {lp!r} is not a finite natural-log "
                        "probability (<= 0); pass log_softmax outputs, not logits or probabilities"
                    )
            nll = -math.fsum(segment)
            per_segment.append(math.exp(nll / len(segment)))
            total_nll += nll
            total_tokens += len(segment)
            total_bytes += nbytes
        mean_nll = total_nll / total_tokens
        return {
            "perplexity": math.exp(mean_nll),
            "mean_nll": mean_nll,
            "bits_per_byte": total_nll / math.log(2) / total_bytes,
            "perplexities": per_segment,
            "tokens": total_tokens,
            "bytes": total_bytes,
        }
