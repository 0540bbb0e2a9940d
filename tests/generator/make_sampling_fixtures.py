"""Reference truncations for troupe's top-k, top-p and min-p (generator/sampling.hpp), made by
transformers' own logits warpers on a few fixed logit rows at ordinary parameter values.

Each case warps one row alone (TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper) or chains
them in troupe's order (min-p, then top-k, then top-p; transformers' generate() orders them
otherwise), after dividing by the temperature as TemperatureLogitsWarper does. The surviving
tokens are those whose warped logit is finite, and their probabilities are the softmax of the
warped row. Every number is float64; the logits are float32 values so both sides read the same.
The script refuses rows where some token lies within a margin of a cut, so that float32
rounding on troupe's side cannot move a token across it.

Usage: make_sampling_fixtures.py OUT_DIR   (writes OUT_DIR/sampling.json)
"""

import json
import pathlib
import sys

import torch
import transformers
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

V = 64
MARGIN = 1e-4  # relative distance every token keeps from each cut


def rows():
    g = torch.Generator().manual_seed(15)
    ranks = torch.arange(V, dtype=torch.float64)
    out = {
        "normal": torch.randn(V, generator=g, dtype=torch.float64),
        "peaked": 1.8 * torch.randn(V, generator=g, dtype=torch.float64),
        "flat": 0.5 * torch.randn(V, generator=g, dtype=torch.float64),
        # Zipf-like: log p ~ -1.1 log rank, shuffled so the order is not the index order
        "zipf": (-1.1 * torch.log1p(ranks) + 0.01 * torch.randn(V, generator=g, dtype=torch.float64))[
            torch.randperm(V, generator=g)
        ],
    }
    return {name: r.to(torch.float32).to(torch.float64) for name, r in out.items()}


def check_margins(scores, top_k, top_p, min_p):
    """Replays the cuts on the probabilities and asserts no token sits near one."""
    p = scores.softmax(-1)
    if min_p > 0:
        cut = min_p * p.max()
        assert ((p - cut).abs() > MARGIN * cut).all(), f"min_p {min_p}: a token is at the cut"
        p = torch.where(p < cut, 0.0, p)
    if top_k > 0:
        s = p.sort(descending=True).values
        if s[top_k] > 0:
            assert s[top_k - 1] - s[top_k] > MARGIN * s[top_k - 1], f"top_k {top_k}: a tie at the cut"
        p = torch.where(p < s[top_k - 1], 0.0, p)
    if top_p < 1:
        s = p.sort(descending=True).values
        above = (s.cumsum(0) - s) / s.sum()
        live = s > 0
        assert ((above[live] - top_p).abs() > MARGIN).all(), f"top_p {top_p}: a token is at the cut"


def warp(scores, temperature, top_k, top_p, min_p):
    x = (scores / temperature).unsqueeze(0)  # (1, V): the warpers take a batch
    ids = torch.zeros(1, 0, dtype=torch.long)
    if min_p > 0:
        x = MinPLogitsWarper(min_p=min_p)(ids, x)
    if top_k > 0:
        x = TopKLogitsWarper(top_k=top_k)(ids, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p=top_p)(ids, x)
    return x.squeeze(0)


def main(out_dir):
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = [
        # each alone, at ordinary values
        dict(top_k=5), dict(top_k=20),
        dict(top_p=0.5), dict(top_p=0.9),
        dict(min_p=0.05), dict(min_p=0.2),
        # combinations, applied in troupe's order
        dict(min_p=0.05, top_k=20, top_p=0.9),
        dict(min_p=0.05, top_k=5, top_p=0.9),
        dict(top_k=20, top_p=0.5),
        dict(min_p=0.2, top_p=0.9),
        dict(min_p=0.05, top_k=20),
    ]
    logits = rows()
    cases = []
    for temperature in (1.0, 0.7):
        for name, row in logits.items():
            for s in settings:
                top_k, top_p, min_p = s.get("top_k", -1), s.get("top_p", 1.0), s.get("min_p", 0.0)
                check_margins(row / temperature, top_k, top_p, min_p)
                warped = warp(row, temperature, top_k, top_p, min_p)
                kept = torch.isfinite(warped).nonzero().squeeze(1)
                probs = warped.softmax(-1)
                assert len(kept) >= 1
                cases.append(dict(row=name, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  kept=kept.tolist(), probs=probs.tolist()))
    doc = dict(transformers=transformers.__version__, torch=torch.__version__,
               rows={k: v.tolist() for k, v in logits.items()}, cases=cases)
    (out_dir / "sampling.json").write_text(json.dumps(doc))
    sizes = [len(c["kept"]) for c in cases]
    print(f"{len(cases)} cases, kept sizes {min(sizes)}..{max(sizes)}")


if __name__ == "__main__":
    main(sys.argv[1])
