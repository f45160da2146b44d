"""The fused decode step: every decoder layer of a decode step in one native call.

With the weights in quantized blocks a decode step of a small model on the CPU spends as long
in the interpreter (~30 small torch calls per layer) as in its GEMMs. `FusedDecode` runs every
layer through `native/decode_layer.c` (norms, GEMMs over the blocks, RoPE, the KV write into
the pages, paged attention, SwiGLU, residuals), one ctypes call for all the layers of a step,
in one OpenMP parallel region; the embedding, the
RoPE tables and the final norm and head stay the model's own (`Decoder.embed_tokens`,
`Decoder.rope`, `Decoder.logits`).

It applies where every layer's four GEMMs are quantized (`engine.quant`), on the CPU in
float32, with the kernel built; elsewhere (and with `EngineSettings.decode = "eager"`) the
decode step is the model's forward over `PagedDecode`, the same math. What a step takes is
reported by `Engine.decode_path`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mooncake.engine import native
from mooncake.engine.model import GEMMS, Block, Decoder
from mooncake.engine.paged import PagedDecode
from mooncake.engine.pool import KVPool
from mooncake.engine.quant import QuantWeight

ORDER = tuple(GEMMS)  # qkv, o, gate_up, down: the order of mc_layer_args.w
assert ORDER == ("qkv", "o", "gate_up", "down")
KINDS = {"q4": 0, "q8": 1}


class FusedDecode:
    def __init__(self, model: Decoder, pool: KVPool, kernel: native.DecodeLayer) -> None:
        self.model, self.pool, self.kernel = model, pool, kernel
        spec = model.spec
        self.spec = spec
        self.args = (native.MCLayerArgs * len(model.layers))()
        for i, block in enumerate(model.layers):
            assert isinstance(block, Block)
            a = self.args[i]
            a.attn_norm = block.attn_norm.weight.data_ptr()
            a.ffn_norm = block.ffn_norm.weight.data_ptr()
            for j, name in enumerate(ORDER):
                w = block.quant[name]
                a.w[j] = native.MCQWeight(KINDS[w.kind], w.out_features, w.in_features,
                                          w.qs.data_ptr(), w.scales.data_ptr())  # fmt: skip
            a.kpool, a.vpool = pool.k(i).data_ptr(), pool.v(i).data_ptr()
            a.hidden, a.heads, a.kv_heads = spec.hidden, spec.heads, spec.kv_heads
            a.ffn, a.rot = spec.ffn, spec.rotary_dim
            a.eps, a.scale = block.attn_norm.eps, spec.head_dim**-0.5
        # The norms' weights and the blocks are the model's own tensors, held by it; the
        # addresses above stay valid while the model lives (weights are not replaced in
        # serving: the model is packed for good).

    @staticmethod
    def of(model: Decoder, pool: KVPool) -> FusedDecode | None:
        """The fused step for this model and pool, or None where it does not apply."""
        if model.device.type != "cpu" or model.dtype != torch.float32:
            return None
        if not pool.native_kv:
            return None
        for block in model.layers:
            assert isinstance(block, Block)
            quant: dict[str, QuantWeight] = block.quant
            if any(name not in quant or quant[name].kind not in KINDS for name in ORDER):
                return None
            norms = (block.attn_norm.weight, block.ffn_norm.weight)
            if any(not n.is_contiguous() or n.dtype != torch.float32 for n in norms):
                return None
        kernel = native.load_decode_layer(model.spec.head_dim, pool.page_tokens, pool.kv_bf16)
        return None if kernel is None else FusedDecode(model, pool, kernel)

    @torch.inference_mode()
    def __call__(self, tokens: Tensor, backend: PagedDecode) -> Tensor:
        """tokens [B, 1] (one new token per sequence, at backend.positions) -> logits [B, V]."""
        model, spec = self.model, self.spec
        b = tokens.shape[0]
        x = model.embed_tokens(tokens[:, 0]).float().contiguous()
        cos, sin = model.rope(backend.positions[:, None])
        cos = cos.reshape(b, spec.rotary_dim).float().contiguous()
        sin = sin.reshape(b, spec.rotary_dim).float().contiguous()
        page, offset = backend.page.contiguous(), backend.offset.contiguous()
        table, lens = backend.table.contiguous(), backend.lens.contiguous()
        scratch = torch.empty(
            int(self.kernel.scratch_floats(b, spec.hidden, spec.heads, spec.kv_heads, spec.ffn))
        )
        threads = torch.get_num_threads()
        for a in self.args:
            a.x, a.cos, a.sin = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
            a.page, a.offset = page.data_ptr(), offset.data_ptr()
            a.table, a.lens, a.scratch = table.data_ptr(), lens.data_ptr(), scratch.data_ptr()
            a.M, a.max_pages, a.threads = b, table.shape[1], threads
        failed = self.kernel.layers(self.args, len(self.args))
        if failed:
            raise RuntimeError(f"fused decode step refused its arguments (code {failed})")
        return model.logits(x)
