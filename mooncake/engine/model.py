"""A LLaMA-family decoder (RMSNorm, RoPE, GQA, SwiGLU) that knows nothing about caching.

Attention over past tokens is delegated to an `AttentionBackend` (prefill of one sequence,
batched decode of many): the decoder computes q, k, v for the new tokens, applies RoPE, and
hands them to the backend, which stores k and v wherever it keeps the KV and returns the
attention output. Hooks run around every layer so a caller can stream KV layer by layer.

RoPE uses the Hugging Face "rotate half" layout (dims i and i + d/2 form a pair); loaders for
files written in the interleaved layout (GGUF) undo that permutation on load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mooncake.engine import native
from mooncake.engine.gemm import (
    ONEDNN,
    PACKED_ONLY,
    SMALL_ROWS,
    PackedWeight,
    bf16_gemms_fast,
    linear,
    nbytes,
)
from mooncake.engine.quant import DIRECT_ROWS, QuantWeight
from mooncake.engine.spec import ModelSpec


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, heads, S, D] and the new k, v [B, kv_heads, S, D] (RoPE applied);
        returns the attention output [B, heads, S, D]. In the last layer of a prefill that
        wants only the last position's logits, q holds that position alone (S = 1 while k,
        v hold all S new positions): it attends to every key."""
        ...


class LayerHooks(Protocol):
    def before_layer(self, layer: int) -> None:
        """Runs before layer `layer` reads any KV: wait here for its prefix KV to be loaded
        (and start loading the next layer's)."""
        ...

    def after_layer(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Runs once layer `layer`'s new k, v [B, kv_heads, S, D] are computed and stored:
        start saving them here."""
        ...


class NoHooks:
    def before_layer(self, layer: int) -> None:
        return None

    def after_layer(self, layer: int, k: Tensor, v: Tensor) -> None:
        return None


NO_HOOKS = NoHooks()

# A long prefill runs every row-wise part of a layer (norms, projections, RoPE, the MLP) over
# at most this many positions at a time; only attention sees them all. For SmolLM2 a chunk's
# temporaries are a few MiB, where a 7.5k-token prompt's whole took ~210 MiB at once
# (measured with memray: the fused qkv twice, a dozen hidden-sized temporaries).
ROW_CHUNK = 1024


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        """Normalised x in x's dtype, or in `out_dtype` (a float32 residual stream's norm
        handed to a bfloat16 GEMM: rounded once, here, instead of by the GEMM's copy)."""
        if x.dtype == torch.float32 and x.numel() <= SMALL_ROWS * x.shape[-1]:
            # A decode step: the fused op (same math) saves five kernel calls per norm.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalise in float32 whatever the activation dtype, as the reference models do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if out_dtype is not None and out_dtype != x.dtype:
            return (self.weight * xf).to(out_dtype)  # float32 x: the reference's math
        return self.weight * xf.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, S, D]; cos, sin [B, 1, S, R] with R <= D rotary dims (the rest pass through)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + rotate_half(xr) * sin, xp), dim=-1)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool = True) -> Tensor:
    """Grouped-query attention; mask is boolean [B or 1, 1, S, T], True = may attend, or
    None for plain causal attention of S new tokens over themselves (S == T), which lets the
    fused kernel skip the masked half (or, with causal=False, attention to every key)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def causal_suffix_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The last S of T positions (q [B, heads, S, D]) attending causally to all T keys
    (k, v [B, kv_heads, T, D]): position T-S+i sees keys 0..T-S+i. No mask is made: the
    causal bias aligned to the bottom right (`causal_lower_right`) lets CUDA's fused kernels
    skip the masked part, as plain causal attention does (a cached prefix's prefill)."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q.shape[2], k.shape[2])
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=gqa)


_ROW_DTYPES = (torch.float32, torch.bfloat16)


def _row_kernels(x: Tensor, cos: Tensor, sin: Tensor, att: torch.dtype) -> native.RowKernels | None:
    """The native RoPE of a prefill's rows (native.RowKernels), where it applies: a CPU
    prefill of one sequence, more rows than a decode batch, float32 RoPE tables as
    `Decoder.rope` makes them, float32 or bfloat16 activations. Bit for bit the torch
    path's result (tests/engine/test_prefill_rows.py)."""
    if (x.device.type != "cpu" or x.shape[0] != 1 or x.shape[1] <= DIRECT_ROWS
            or x.dtype not in _ROW_DTYPES or att not in _ROW_DTYPES
            or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or cos.shape != sin.shape or cos.shape[:2] != (1, 1)):  # fmt: skip
        return None
    return native.load_rows()


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def merged_suffix_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
    """`causal_suffix_attention` on the CPU, where the bottom-right causal bias is made into
    a float mask (no skipping): the S new rows attend to the T - S cached keys with no mask
    and to themselves causally, as two fused flash calls whose softmaxes are merged by their
    log-sum-exps (softmax over the union: each part weighted by sigmoid(lse_own - lse_other)).
    ~20 % less time than the masked call on this repo's 2-core EPYC (1,024 rows over 2k-8k
    keys, one thread), and no [S, T] mask. None where this torch has no CPU flash kernel
    that returns the log-sum-exp (the caller then masks)."""
    if _CPU_FLASH is None or q.device.type != "cpu":
        return None
    cached = k.shape[2] - q.shape[2]
    o1, lse1 = _CPU_FLASH(q, k[:, :, :cached], v[:, :, :cached], 0.0, False)[:2]
    o2, lse2 = _CPU_FLASH(q, k[:, :, cached:], v[:, :, cached:], 0.0, True)[:2]
    w1 = torch.sigmoid(lse1 - lse2).unsqueeze(-1)
    out: Tensor = (o2 + (o1 - o2) * w1).to(q.dtype)
    return out


# The block's GEMMs and the projections each is made of (q, k, v and gate, up share inputs).
GEMMS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        hd, h = spec.head_dim, spec.hidden
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, hd
        self.attn_norm = RMSNorm(h, spec.rms_eps)
        self.q = nn.Linear(h, spec.heads * hd, bias=False)
        self.k = nn.Linear(h, spec.kv_heads * hd, bias=False)
        self.v = nn.Linear(h, spec.kv_heads * hd, bias=False)
        self.o = nn.Linear(spec.heads * hd, h, bias=False)
        self.ffn_norm = RMSNorm(h, spec.rms_eps)
        self.gate = nn.Linear(h, spec.ffn, bias=False)
        self.up = nn.Linear(h, spec.ffn, bias=False)
        self.down = nn.Linear(spec.ffn, h, bias=False)
        self._packed = {
            "qkv": PackedWeight(self.q, self.k, self.v),
            "o": PackedWeight(self.o),
            "gate_up": PackedWeight(self.gate, self.up),
            "down": PackedWeight(self.down),
        }
        # GEMMs whose weight is kept in the model file's quantized blocks (engine.quant).
        self.quant: dict[str, QuantWeight] = {}
        # Those GEMMs of many rows multiplied in bfloat16 (Decoder.use_bf16_gemms).
        self.gemm_bf16 = False

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)

    def _fused(self, attr: str, parts: tuple[nn.Linear, ...]) -> Tensor:
        """The weights of `parts` as one [sum of outputs, in] matrix, so one GEMM replaces
        several (q, k, v; gate, up). The parameters are made views into it, so nothing is
        stored twice and in-place weight updates (load_state_dict) reach it; it is rebuilt
        whenever a parameter was replaced (e.g. `.to(device)`)."""
        fused: Tensor | None = getattr(self, attr, None)
        if fused is not None and fused.device == parts[0].weight.device:
            ptr, row = fused.data_ptr(), fused.stride(0) * fused.element_size()
            for p in parts:
                if p.weight.data_ptr() != ptr or p.weight.dtype != fused.dtype:
                    break
                ptr += p.weight.shape[0] * row
            else:
                return fused
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([p.weight.detach() for p in parts])
            offset = 0
            for p in parts:
                n = p.weight.shape[0]
                p.weight.data = fused[offset : offset + n]
                offset += n
        setattr(self, attr, fused)
        return fused

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        layer: int,
        backend: AttentionBackend,
        last_only: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns the new hidden state and this layer's new k, v. With `last_only` (the
        last layer, when only the last position's logits are wanted) k and v are computed
        for every position but the rest of the layer only for the last one: the backend
        then gets q of one position, the last, which attends to every key. More than
        ROW_CHUNK positions go through `_chunked` (same math, bounded temporaries)."""
        if x.shape[1] > ROW_CHUNK:
            return self._chunked(x, cos, sin, layer, backend, last_only)
        act, att = self._prefill_dtypes(x, backend)
        bf = act != x.dtype
        h = self.attn_norm(x, act)
        qkv = self._gemm("qkv", h, bf)
        if (rows := _row_kernels(x, cos, sin, att)) is not None:  # one pass for RoPE and the layout
            q, k, v = self._rope_native(rows, qkv, cos, sin, att, last_only)
        else:
            q, k, v = self._rope_torch(qkv, cos, sin, att, last_only)
        if last_only:
            x = x[:, -1:]
        out = backend(layer, q, k, v)
        b, _, s, _ = out.shape
        x = x + self._gemm("o", out.transpose(1, 2).reshape(b, s, -1), bf)
        return x + self._mlp(self.ffn_norm(x, act), bf), k, v

    def _rope_torch(
        self, qkv: Tensor, cos: Tensor, sin: Tensor, att: torch.dtype, last_only: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q (of the last position only, with `last_only`), k and v out of the fused GEMM's
        result [B, S, ...], q and k RoPE'd, [B, heads, S, D], in `att`."""
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = qkv[..., :nq], qkv[..., nq : nq + nkv], qkv[..., nq + nkv :]
        if last_only and qkv.shape[1] > 1:
            q = apply_rope(self._split(q[:, -1:], self.heads), cos[:, :, -1:], sin[:, :, -1:])
            k = apply_rope(self._split(k, self.kv_heads), cos, sin)
        else:  # q and k rotated together: half the small ops of a decode step's RoPE
            qk = apply_rope(self._split(qkv[..., : nq + nkv], self.heads + self.kv_heads), cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
        v = self._split(v, self.kv_heads)
        return q.to(att), k.to(att), v.to(att)  # RoPE ran in float32 (cos, sin are)

    def _rope_native(
        self,
        rows: native.RowKernels,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        att: torch.dtype,
        last_only: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`_rope_torch`'s result, contiguous, by the native kernel (one sequence)."""
        s = qkv.shape[1]
        s_q = 1 if last_only else s
        q = qkv.new_empty(1, self.heads, s_q, self.head_dim, dtype=att)
        k = qkv.new_empty(1, self.kv_heads, s, self.head_dim, dtype=att)
        v = torch.empty_like(k)
        rows.rope_qkv(qkv[0], cos[0, 0], sin[0, 0], q[0], k[0], v[0], 0, s - s_q, 0)
        return q, k, v

    def _prefill_dtypes(
        self, x: Tensor, backend: AttentionBackend
    ) -> tuple[torch.dtype, torch.dtype]:
        """The dtypes of a prefill's GEMM activations and of the q, k, v it hands `backend`.
        Where the block's GEMMs multiply in bfloat16 (all over quantized weights, on the
        CPU, more rows than a decode batch), their inputs and outputs stay bfloat16 between
        them: the values are those the GEMMs round to anyway, without a float32 copy of each
        (~a sixth of a 3,000-token SmolLM2 prefill on a 2-vCPU Xeon with AMX went to those
        copies). The residual stream, the norms and RoPE stay float32. The backend gets
        bfloat16 q, k, v where it multiplies in bfloat16 itself (`bf16_inputs`), so the
        rotated k is stored rounded to bfloat16 (its pool keeps float32). Otherwise: x's
        dtype for both, as before."""
        rows = x.numel() // x.shape[-1]
        if not (self.gemm_bf16 and len(self.quant) == len(GEMMS) and x.dtype == torch.float32
                and rows > DIRECT_ROWS and x.device.type == "cpu"):  # fmt: skip
            return x.dtype, x.dtype
        return torch.bfloat16, torch.bfloat16 if getattr(backend, "bf16_inputs", False) else x.dtype

    def _chunked(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        layer: int,
        backend: AttentionBackend,
        last_only: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """`forward` for a long prefill: the row-wise parts run ROW_CHUNK positions at a time
        into preallocated q, k, v and output, so what a layer holds at once is those and the
        attention output, not a dozen hidden-sized temporaries of the whole prompt."""
        b, s, _ = x.shape
        hd, nq, nkv = self.head_dim, self.heads * self.head_dim, self.kv_heads * self.head_dim
        act, att = self._prefill_dtypes(x, backend)
        bf = act != x.dtype
        s_q = 1 if last_only else s
        q = x.new_empty(b, self.heads, s_q, hd, dtype=att)
        k = x.new_empty(b, self.kv_heads, s, hd, dtype=att)
        v = x.new_empty(b, self.kv_heads, s, hd, dtype=att)
        rows = _row_kernels(x, cos, sin, att)
        for a in range(0, s, ROW_CHUNK):
            z = min(a + ROW_CHUNK, s)
            qkv = self._gemm("qkv", self.attn_norm(x[:, a:z], act), bf)
            c, sn = cos[:, :, a:z], sin[:, :, a:z]
            if rows is not None:  # one pass for RoPE and the layout (q: all, or the last)
                # last_only: q is position s-1's alone (this chunk's row s-1-a, if it has it)
                q_from, q_row0 = (s - 1 - a, 0) if last_only else (0, a)
                rows.rope_qkv(qkv[0], c[0, 0], sn[0, 0], q[0], k[0], v[0], a, q_from, q_row0)
                continue
            k[:, :, a:z] = apply_rope(self._split(qkv[..., nq : nq + nkv], self.kv_heads), c, sn)
            v[:, :, a:z] = self._split(qkv[..., nq + nkv :], self.kv_heads)
            if not last_only:
                q[:, :, a:z] = apply_rope(self._split(qkv[..., :nq], self.heads), c, sn)
            elif z == s:
                q[:] = apply_rope(self._split(qkv[:, -1:, :nq], self.heads), c[:, :, -1:],
                                  sn[:, :, -1:])  # fmt: skip
        attended = backend(layer, q, k, v).transpose(1, 2)  # [b, s_q, heads, hd]
        del q
        rest = x[:, -1:] if last_only else x
        out = torch.empty_like(rest)
        for a in range(0, s_q, ROW_CHUNK):
            z = min(a + ROW_CHUNK, s_q)
            o = attended[:, a:z].reshape(b, z - a, nq)
            h = rest[:, a:z] + self._gemm("o", o, bf)
            out[:, a:z] = h + self._mlp_rows(self.ffn_norm(h, act), bf)
        return out, k, v

    def _mlp(self, h: Tensor, bf16_out: bool = False) -> Tensor:
        """SwiGLU; a long prefill's rows in chunks of ROW_CHUNK (rows are independent), so its
        [rows, 2 x ffn] activations do not grow with the prompt."""
        rows = h.numel() // h.shape[-1]
        if rows <= ROW_CHUNK:
            return self._mlp_rows(h, bf16_out)
        flat = h.reshape(rows, h.shape[-1])
        out = torch.empty_like(flat)
        for start in range(0, rows, ROW_CHUNK):
            out[start : start + ROW_CHUNK] = self._mlp_rows(flat[start : start + ROW_CHUNK],
                                                            bf16_out)  # fmt: skip
        return out.view_as(h)

    def _mlp_rows(self, h: Tensor, bf16_out: bool = False) -> Tensor:
        gate, up = self._gemm("gate_up", h, bf16_out).chunk(2, dim=-1)
        return self._gemm("down", F.silu(gate) * up, bf16_out)

    def _gemm(self, name: str, x: Tensor, bf16_out: bool = False) -> Tensor:
        """x @ W.T for one of the block's GEMMs: over its quantized blocks where it has them
        (`bf16_out`: a bfloat16 GEMM's result left in bfloat16, `_prefill_dtypes`)."""
        quant = self.quant.get(name)
        if quant is not None:
            return quant(x, self.gemm_bf16, bf16_out)
        return linear(x, self._weight(name), self._packed[name])

    def use_quantized(self, parts: dict[str, QuantWeight]) -> None:
        """Serve GEMMs from quantized weights: `parts` by projection name (q, k, v, o, gate,
        up, down). A fused GEMM (q+k+v, gate+up) is quantized only when all of its parts
        are, in one format; the rest keep (or get back) their float weights. The float
        weight of a quantized GEMM is freed."""
        with torch.inference_mode(False), torch.no_grad():
            for name, members in GEMMS.items():
                have = [parts[m] for m in members if m in parts]
                if len(have) == len(members) and len({q.kind for q in have}) == 1:
                    self.quant[name] = QuantWeight.cat(have) if len(have) > 1 else have[0]
                    self._free_float(name)
                    continue
                for m in members:  # partly quantized: float weights for the whole group
                    if m in parts:
                        getattr(self, m).weight = nn.Parameter(
                            parts[m].dequantize(), requires_grad=False
                        )

    def _weight(self, name: str) -> Tensor:
        """The plain weight of one of the block's GEMMs (fused where several share an
        input); once packed for good, a placeholder: the packed copy is the weight."""
        if self._packed[name].frozen:
            return PACKED_ONLY
        if name == "qkv":
            return self._fused("_qkv", (self.q, self.k, self.v))
        if name == "gate_up":
            return self._fused("_gate_up", (self.gate, self.up))
        return self.o.weight if name == "o" else self.down.weight

    def pack_weights(self) -> None:
        """Keep only the oneDNN-packed copy of every float GEMM weight (see Decoder)."""
        for name in self._packed:
            if name in self.quant:
                continue
            self._packed[name].freeze(self._weight(name))
            self._free_float(name)

    def _free_float(self, name: str) -> None:
        """Drop the float weights of GEMM `name` (served from another copy from now on)."""
        for m in GEMMS[name]:
            getattr(self, m).weight = nn.Parameter(PACKED_ONLY, requires_grad=False)
        if len(GEMMS[name]) > 1:
            setattr(self, f"_{name}", None)  # the fused matrix made of them


class Decoder(nn.Module):
    inv_freq: Tensor
    rope_freq_factors: Tensor

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = RMSNorm(spec.hidden, spec.rms_eps)
        self.lm_head = (
            None if spec.tied_embeddings else nn.Linear(spec.hidden, spec.vocab_size, bias=False)
        )
        self._packed_head = PackedWeight(self.embed if self.lm_head is None else self.lm_head)
        # The embedding and output head where they are kept quantized (`use_quantized`).
        self.quant_embed: QuantWeight | None = None
        self.quant_head: QuantWeight | None = None
        rot = spec.rotary_dim
        inv_freq = 1.0 / (spec.rope_base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # Per-frequency divisors (LLaMA 3 style scaling; GGUF `rope_freqs.weight`), 1 = none.
        self.register_buffer("rope_freq_factors", torch.ones(rot // 2), persistent=True)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def pack_weights(self) -> bool:
        """Serving on the CPU in float32: keep only the oneDNN-packed copy of every GEMM
        weight and free the plain one (measured here: the packed GEMM is no slower at 1-2
        rows than MKL's, and 1.5-4x faster from 4 rows). The embedding stays plain (token
        lookups read it); the output head tied to it gets its packed copy. Inference only:
        the packed copies no longer follow weight updates. False (nothing changed) where the
        packed path does not apply (another device or dtype, no oneDNN)."""
        if not ONEDNN or self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        with torch.inference_mode(False), torch.no_grad():
            for block in self.layers:
                assert isinstance(block, Block)
                block.pack_weights()
            if self.quant_head is not None:
                pass
            elif self.lm_head is None:
                self._packed_head.freeze(self.embed.weight)
            else:
                self._packed_head.freeze(self.lm_head.weight)
                self.lm_head.weight = nn.Parameter(PACKED_ONLY, requires_grad=False)
        return True

    def use_quantized(
        self,
        layers: Sequence[dict[str, QuantWeight]],
        embed: QuantWeight | None = None,
        head: QuantWeight | None = None,
    ) -> None:
        """Keep these weights in their quantized blocks (engine.quant) and free their float
        copies: per layer the projections by name (see Block.use_quantized), the embedding
        (also the output head when they are tied) and an untied output head."""
        for block, parts in zip(self.layers, layers, strict=True):
            assert isinstance(block, Block)
            block.use_quantized(parts)
        with torch.inference_mode(False), torch.no_grad():
            if embed is not None:
                self.quant_embed = embed
                self.embed.weight = nn.Parameter(PACKED_ONLY, requires_grad=False)
                if self.lm_head is None:
                    self.quant_head = embed
            if head is not None and self.lm_head is not None:
                self.quant_head = head
                self.lm_head.weight = nn.Parameter(PACKED_ONLY, requires_grad=False)

    def use_bf16_gemms(self, on: bool) -> bool:
        """Multiply the decoder layers' GEMMs of more than DIRECT_ROWS rows (prefills) over
        quantized weights in bfloat16 (`on`) or float32: the weight slices dequantized to
        bfloat16 and the activations rounded to it, the products summed in float32 and
        rounded to bfloat16 (oneDNN), as a bfloat16 model runs; the rest of the model stays
        float32, and so do decode steps (the fused native step, engine.fused; eager ones
        of up to DIRECT_ROWS rows) and the output head. Applied only where the CPU
        multiplies bfloat16 in hardware and faster than float32, measured
        (gemm.bf16_gemms_fast), and some weights are quantized; returns whether it now is."""
        on = (
            on
            and self.device.type == "cpu"
            and self.dtype == torch.float32
            and bool(self.quantized())
            and bf16_gemms_fast()
        )
        for block in self.layers:
            assert isinstance(block, Block)
            block.gemm_bf16 = on
        return on

    @property
    def bf16_gemms(self) -> bool:
        """Whether the layers' GEMMs of many rows multiply in bfloat16 (use_bf16_gemms)."""
        return any(isinstance(b, Block) and b.gemm_bf16 for b in self.layers)

    def quantized(self) -> list[QuantWeight]:
        """Every weight kept in quantized blocks (each once)."""
        found: list[QuantWeight] = []
        for block in self.layers:
            assert isinstance(block, Block)
            found += block.quant.values()
        for q in (self.quant_embed, self.quant_head):
            if q is not None and all(q is not f for f in found):
                found.append(q)
        return found

    def weight_bytes(self) -> int:
        """Bytes the weights occupy: parameters and buffers, the packed copies built and the
        quantized blocks."""
        plain = sum(t.numel() * t.element_size() for t in self.state_dict().values())
        packs = [self._packed_head]
        for block in self.layers:
            assert isinstance(block, Block)
            packs += block._packed.values()
        packed = sum(nbytes(pw.packed) for pw in packs if pw.packed is not None)
        return int(plain) + packed + sum(q.nbytes for q in self.quantized())

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, S] -> cos, sin [B, 1, S, rotary_dim] in the activation dtype."""
        pos = positions.to(torch.float32) / self.spec.rope_scaling.factor
        inv = self.inv_freq / self.rope_freq_factors
        freqs = pos[..., None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        backend: AttentionBackend,
        hooks: LayerHooks = NO_HOOKS,
        last_only: bool = True,
    ) -> Tensor:
        """tokens, positions [B, S] -> logits [B, V] (last position) or [B, S, V]."""
        x = self.embed_tokens(tokens)
        x = self.run_layers(x, positions, backend, range(len(self.layers)), hooks, last_only)
        return self.logits(x[:, -1] if last_only else x)

    def run_layers(
        self,
        x: Tensor,
        positions: Tensor,
        backend: AttentionBackend,
        layers: range,
        hooks: LayerHooks = NO_HOOKS,
        last_only: bool = False,
    ) -> Tensor:
        """Hidden states [B, S, hidden] at `positions` through the blocks in `layers`: the
        whole model in `forward`, a stage's share in a chunked pipeline (engine.stage).
        `last_only` cuts the model's last layer to the last position."""
        cos, sin = self.rope(positions)
        last = len(self.layers) - 1
        for i in layers:
            hooks.before_layer(i)
            x, k, v = self.layers[i](x, cos, sin, i, backend, last_only and i == last)
            hooks.after_layer(i, k, v)
            del k, v  # not held while the next layer computes its own
        return x

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [...] -> their embeddings [..., hidden]."""
        return self.embed(tokens) if self.quant_embed is None else self.quant_embed.rows(tokens)

    def logits(self, x: Tensor) -> Tensor:
        """The last layer's output [..., hidden] -> logits [..., V] (final norm, head)."""
        x = self.norm(x)
        if self.quant_head is not None:
            return self.quant_head(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear(x, head, self._packed_head).float()
