"""Simulated int8 output-gradient quantizers, to measure by accuracy what a kernel would have to implement.

All-int8 SwitchBack (`grad_precision="int8"`) quantizes the output gradient G (tokens x outputs) row-wise:
one scale per token, absmax / 127, so every entry below absmax / 254 of its row rounds to zero. Gradient rows
whose largest entry is hundreds of times the typical one lose most of their small entries, always towards zero.
The remedies here are "fake quantization" (quantize, then dequantize in float32) of G before the grad-input
GEMM, in plain torch on any device: accuracy can be measured without a kernel, speed cannot.

    row           the paper's row-wise int8 (one scale per token): the baseline the others must beat
    block<N>      one scale per 1 x N block along the row (per token and per N consecutive outputs)
    row-sr        row-wise int8 with stochastic rounding (unbiased: small entries survive on average)
    row-outlier<K> the K output columns with the largest |G| kept in 16 bits, the rest row-wise int8

`sim_switchback.SimSwitchBackLinear` trains a model with one of them.
"""

from __future__ import annotations

import re

import torch

QMAX = 127.0
GRAD_QUANTIZERS = ("row", "block<N>", "row-sr", "row-outlier<K>")
_PATTERN = re.compile(r"^(row|row-sr|block(\d+)|row-outlier(\d+))$")


def parse_grad_quantizer(name: str) -> tuple[str, int]:
    """(kind, parameter) of a quantizer name: ("row", 0), ("block", N), ("row-sr", 0), ("row-outlier", K)."""
    match = _PATTERN.match(name)
    if match is None:
        raise ValueError(
            f"unknown gradient quantizer {name!r}; expected one of {GRAD_QUANTIZERS} (e.g. block128)"
        )
    if match.group(2):
        if int(match.group(2)) < 1:
            raise ValueError(f"{name!r}: the block size must be >= 1")
        return "block", int(match.group(2))
    if match.group(3):
        return "row-outlier", int(match.group(3))
    return match.group(1), 0


def _fake_int8(x: torch.Tensor, scale: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Round x / scale to int8 (nearest, or stochastically with a generator) and scale back; scale broadcasts."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    scaled = x / safe
    if generator is not None:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=scaled.dtype)
        q = torch.floor(scaled + noise)
    else:
        q = torch.round(scaled)
    return q.clamp(-QMAX, QMAX) * safe


def fake_quant_rows(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Row-wise absmax int8, dequantized: (M, K) -> (M, K) float32."""
    xf = x.float()
    return _fake_int8(xf, xf.abs().amax(dim=1, keepdim=True) / QMAX, generator)


def fake_quant_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """One absmax int8 scale per 1 x `block` run of each row (the last block may be shorter)."""
    xf = x.float()
    m, k = xf.shape
    pad = (-k) % block
    padded = torch.nn.functional.pad(xf, (0, pad)).view(m, (k + pad) // block, block)
    scale = padded.abs().amax(dim=2, keepdim=True) / QMAX
    return _fake_int8(padded, scale, None).view(m, k + pad)[:, :k]


def outlier_columns(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k columns with the largest absolute entry (the columns that set most row scales)."""
    return x.float().abs().amax(dim=0).topk(min(k, x.shape[1])).indices


def fake_quant_outlier(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k outlier columns kept exactly (16 bits), the rest quantized row-wise with their own scales."""
    xf = x.float()
    cols = outlier_columns(xf, k)
    rest = xf.clone()
    rest[:, cols] = 0.0
    out = fake_quant_rows(rest)
    out[:, cols] = xf[:, cols]
    return out


def fake_quant_grad(g: torch.Tensor, name: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """The output gradient g (M, N) as the named quantizer delivers it to the grad-input GEMM (float32)."""
    kind, param = parse_grad_quantizer(name)
    if kind == "row":
        return fake_quant_rows(g)
    if kind == "row-sr":
        if generator is None:
            generator = torch.Generator(device=g.device)
            generator.manual_seed(0)
        return fake_quant_rows(g, generator)
    if kind == "block":
        return fake_quant_blocks(g, param)
    return fake_quant_outlier(g, param)


def fake_quant_tensor(w: torch.Tensor) -> torch.Tensor:
    """Tensor-wise absmax int8 (one scale for the whole weight), dequantized."""
    wf = w.float()
    return _fake_int8(wf, wf.abs().amax() / QMAX, None)


def gradient_stats(g: torch.Tensor, w: torch.Tensor, names: tuple[str, ...]) -> dict[str, float]:
    """How each quantizer treats one output gradient g (M, N) and weight w (N, K), against 16 bits:
    the share of non-zero entries rounded to zero ("flushed"), the share of |g|'s squared norm they held, and
    the relative error and cosine of the grad input g @ w. Also the shape of the problem: median over rows of
    absmax / RMS, and how often a row's absmax sits in the 1% of columns with the largest |g| overall."""
    gf, wf = g.float(), w.float()
    exact = gf @ wf
    nonzero = gf != 0
    stats: dict[str, float] = {}
    live = gf[
        gf.abs().amax(dim=1) > 0
    ]  # all-zero rows (e.g. padded text positions) have no scale to speak of
    rms = live.pow(2).mean(dim=1).sqrt()
    stats["row_absmax_over_rms_median"] = (live.abs().amax(dim=1) / rms).median().item() if len(live) else 0.0
    top = outlier_columns(gf, max(1, gf.shape[1] // 100))
    in_top = torch.isin(live.abs().argmax(dim=1), top)
    stats["row_max_in_top1pct_cols"] = in_top.float().mean().item() if len(live) else 0.0
    total_sq = gf.pow(2).sum().clamp_min(1e-30)
    wq = fake_quant_tensor(wf)
    for name in names:
        gq = fake_quant_grad(gf, name)
        flushed = nonzero & (gq == 0)
        stats[f"{name}/flushed"] = (flushed.sum() / nonzero.sum().clamp_min(1)).item()
        stats[f"{name}/flushed_norm_share"] = (gf[flushed].pow(2).sum() / total_sq).item()
        approx = gq @ wq
        stats[f"{name}/grad_input_rel_err"] = ((approx - exact).norm() / exact.norm().clamp_min(1e-30)).item()
        stats[f"{name}/grad_input_cosine"] = torch.nn.functional.cosine_similarity(
            approx.flatten(), exact.flatten(), dim=0
        ).item()
    return stats
