"""The paged KV pool: pages round-trip the store's block layout, the native decode kernel and
the portable torch path agree with attention over contiguous KV, the pool is bounded and
asks before it gives, and preempted sequences resume to the tokens they get alone."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from mooncake.engine import (
    DecodeBatch,
    Engine,
    EngineError,
    KVPoolExhausted,
    ModelSpec,
    SamplingParams,
    dummy_model,
    generate,
    native,
)
from mooncake.engine.paged import PagedDecode

SPEC = ModelSpec(vocab_size=61, hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, context=128)
BLOCK = 32


# The pool's two element types (EngineSettings.kv): the native kernels are built for each.
KV_TYPES = pytest.mark.parametrize("kv", ["float32", "bfloat16"])


def engine_with(budget_pages: int | None = None, kv: str = "float32") -> Engine:
    model = dummy_model(SPEC, seed=11, std=0.25)
    budget = None
    if budget_pages is not None:
        budget = budget_pages * 16 * SPEC.kv_bytes_per_token(getattr(torch, kv).itemsize)
    return Engine(model, block_tokens=BLOCK, model_id="dummy", kv_budget_bytes=budget,
                  kv=kv)  # type: ignore[arg-type]  # fmt: skip


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def test_blocks_round_trip_through_pages() -> None:
    e = engine_with()
    kv = e.prefill(tokens(2 * BLOCK + 5, 1)).kv
    blocks = e.blocks(kv)
    assert len(blocks) == 2 and blocks[0].shape == (2, 2, 2, BLOCK, 16)
    tail = kv.piece(2 * BLOCK, 5)
    copy = e.prefix_from_blocks([*blocks, tail])
    assert copy.length == kv.length and set(copy.pages).isdisjoint(kv.pages)
    for layer in range(SPEC.layers):
        a, b = kv.read(layer, 0, kv.length), copy.read(layer, 0, copy.length)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@KV_TYPES
@pytest.mark.parametrize("path", ["native", "torch"])
def test_blocks_written_by_layer_or_all_at_once_land_in_their_pages(
    path: str, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_blocks (one layer, several blocks: a store load) and write_layers (every layer)
    put each block's K and V where read_blocks finds them, through the native copy and
    through torch's, into a pool of either type (blocks of another type converted on the
    way in); pages outside the pool are refused, nothing written."""
    e = engine_with(kv=kv)
    if path == "torch":
        monkeypatch.setattr(type(e.pool), "_block_writer", lambda self: None)
    elif e.pool._block_writer() is None:
        pytest.skip("no C compiler: no native block copy")
    g = torch.Generator().manual_seed(5)
    blocks = torch.randn(SPEC.layers, 3, 2, 2, BLOCK, 16, generator=g).to(e.pool.dtype)
    per = BLOCK // e.pool.page_tokens
    pages = torch.randperm(e.pool.pages.total, generator=g)[: 3 * per]
    e.pool.write_layers(pages, blocks)
    for layer in range(SPEC.layers):
        got = e.pool.read_blocks(layer, pages, BLOCK)
        assert torch.equal(got, blocks[layer]), layer
    again = torch.randn(3, 2, 2, BLOCK, 16, generator=g)  # float32, whatever the pool's type
    e.pool.write_blocks(1, pages.flip(0), again[:, :, :, :, :])  # other pages, one layer
    assert torch.equal(e.pool.read_blocks(1, pages.flip(0), BLOCK), again.to(e.pool.dtype))
    assert torch.equal(e.pool.read_blocks(0, pages, BLOCK), blocks[0])  # layer 0 untouched
    before = e.pool.data.clone()
    for bad in (pages + e.pool.pages.total, pages[:-1], -1 - pages):
        with pytest.raises(EngineError, match="pages"):
            e.pool.write_layers(bad, blocks * 2)
    assert torch.equal(e.pool.data, before)


def test_the_budget_is_whole_pages_and_must_hold_a_context() -> None:
    e = engine_with(budget_pages=40)
    assert e.pool.pages.total == 40 and e.pool.capacity_tokens == 40 * 16
    with pytest.raises(EngineError, match="cannot hold one full context"):
        engine_with(budget_pages=8)


def test_the_pool_asks_before_it_gives() -> None:
    e = engine_with(budget_pages=16)  # 256 tokens
    first = e.prefill(tokens(120, 2))
    assert e.pool.fits(128) and not e.pool.fits(129 + 16)
    with pytest.raises(KVPoolExhausted):
        e.prefill(tokens(127, 3)), e.prefill(tokens(127, 4))
    first.kv.release()
    assert e.pool.pages.used == 0


def reference(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
) -> torch.Tensor:
    out = [
        F.scaled_dot_product_attention(q[b : b + 1], k[None], v[None], enable_gqa=True)
        for b, (k, v) in enumerate(zip(keys, values, strict=True))
    ]
    return torch.cat(out)


@KV_TYPES
@pytest.mark.parametrize("path", ["native", "torch"])
def test_paged_decode_attention_equals_attention_over_contiguous_kv(path: str, kv: str) -> None:
    e = engine_with(kv=kv)
    if path == "native" and native.load(16, e.pool.page_tokens, e.pool.kv_bf16) is None:
        pytest.skip("no C compiler here: the native kernel cannot be built")
    kvs = [e.prefill(tokens(n, n)).kv for n in (1, 15, 16, 17, 70)]
    for kv in kvs:
        assert kv.reserve(kv.length + 1)
    backend = PagedDecode(e.pool, kvs)
    if path == "torch":
        backend.kernel = None
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(kvs), 4, 1, 16, generator=g)
    k = torch.randn(len(kvs), 2, 1, 16, generator=g)
    v = torch.randn(len(kvs), 2, 1, 16, generator=g)
    # Stale values in the unwritten rest of a page must not leak in (not even a NaN).
    page = e.pool.page_tokens
    for kv in kvs:
        last, used = kv.pages[-1], (kv.length + 1) % page
        if used:
            e.pool.k(1)[last, :, :, used:] = float("nan")
            e.pool.v(1)[last, :, used:, :] = float("nan")
    with torch.inference_mode():
        got = backend(1, q, k, v)
    keys, values = [], []
    for i, seq in enumerate(kvs):
        pk, pv = seq.read(1, 0, seq.length + 1)
        new_k, new_v = k[i, :, 0].to(e.pool.dtype), v[i, :, 0].to(e.pool.dtype)
        assert torch.equal(pk[:, -1], new_k) and torch.equal(pv[:, -1], new_v)
        keys.append(pk.float())
        values.append(pv.float())
    assert torch.allclose(got, reference(q, keys, values), atol=1e-5)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch (and the kernels, which take its count) on n threads, then back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@KV_TYPES
@pytest.mark.parametrize("group", [1, 3, 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_attention_over_scattered_pages(group: int, threads: int, kv: str) -> None:
    """The kernel alone, against attention over each sequence's KV gathered in order: query
    heads scored in tiles (group 5 = a tile of 4 and one of 1), pages anywhere in the pool,
    a batch of one long sequence (its pages split between jobs and merged) and a mixed
    batch, with NaN in every unwritten slot of every page; over a pool of float32 and one
    of bfloat16 (widened exactly: the same tolerance)."""
    page, dim, kv_heads = 16, 32, 2
    kernel = native.load(dim, page, kv == "bfloat16")
    if kernel is None:
        pytest.skip("no C compiler here: the native kernel cannot be built")
    g = torch.Generator().manual_seed(group * 10 + threads)
    pages = 200
    kpool = torch.randn(pages, kv_heads, dim, page, generator=g).to(kernel.kv_dtype)
    vpool = torch.randn(pages, kv_heads, page, dim, generator=g).to(kernel.kv_dtype)
    order = torch.randperm(pages, generator=g).to(torch.int32)
    with torch_threads(threads):
        for lens in ([1000], [1, 16, 17, 300, 40]):
            need = [(n + page - 1) // page for n in lens]
            width = max(need)
            table = torch.zeros(len(lens), width, dtype=torch.int32)
            at = 0
            for b, count in enumerate(need):
                table[b, :count] = order[at : at + count]
                at += count
                used = lens[b] % page
                if used:  # the rest of the last page: never written
                    last = int(table[b, count - 1])
                    kpool[last, :, :, used:] = float("nan")
                    vpool[last, :, used:, :] = float("nan")
            q = torch.randn(len(lens), kv_heads, group, dim, generator=g) * 3
            out = torch.empty_like(q)
            kernel(q, kpool, vpool, table, torch.tensor(lens, dtype=torch.int32), out, dim**-0.5)
            for b, n in enumerate(lens):
                idx = table[b, : need[b]].long()
                k = kpool[idx].permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)[:, :n].float()
                v = vpool[idx].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n].float()
                # [kv_heads, 1, n, dim] against the group's queries [kv_heads, group, 1, dim]
                want = F.scaled_dot_product_attention(q[b][:, :, None], k[:, None], v[:, None])
                want = want[:, :, 0]
                assert torch.allclose(out[b], want, atol=1e-5), (lens, b)


@KV_TYPES
@pytest.mark.parametrize("group", [1, 3, 5])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("avx2", "bf16"), [(False, False), (True, False), (False, True)], ids=["native", "avx2", "bf16"]
)
def test_native_prefill_attention_over_scattered_pages(
    group: int, threads: int, avx2: bool, bf16: bool, kv: str
) -> None:
    """The prefill kernel alone, against SDPA with a causal mask over the sequence's KV
    gathered in order: S new tokens at positions start.., each seeing every key up to its
    own; pages anywhere in the pool, NaN in every slot not written (past the sequence's
    end, and pages no sequence holds); q a strided view, as the model hands it over; tiles
    of 12 rows that do not divide S x group; one token alone (a last-position-only layer).
    Built for this machine, without AVX-512 (the vectors and register tiles of an AVX2
    machine: the same on one), and multiplying in bfloat16 where the CPU can: against SDPA
    over the scaled queries, keys and values rounded to bfloat16 as the kernel rounds them,
    within what rounding its softmax weights to bfloat16 moves an output by (a weight's
    relative error 2^-9, the weights summing to 1: 2^-9 x the largest |value|). Over a pool
    of float32 and one of bfloat16 (its keys and values widened exactly)."""
    if avx2 and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU cannot run an AVX2 build")
    page, dim, kv_heads = 16, 32, 2
    kernel = native.load_prefill(dim, page, avx2=avx2, bf16=bf16, kv_bf16=kv == "bfloat16")
    if kernel is None:
        pytest.skip("no C compiler here: the native kernel cannot be built")
    if kernel.bf16 != bf16:
        assert bf16 and not kernel.bf16  # a bfloat16 build asked for on a CPU without it
        pytest.skip("this CPU has no AVX512_BF16 dot products")
    g = torch.Generator().manual_seed(group * 10 + threads)
    pages = 160

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.bfloat16().float() if bf16 else x

    with torch_threads(threads):
        for start, new in ((0, 1), (0, 37), (5, 3), (100, 200), (1000, 29), (1100, 1)):
            n = start + new
            need = (n + page - 1) // page
            kpool = torch.full((pages, kv_heads, dim, page), float("nan"), dtype=kernel.kv_dtype)
            vpool = torch.full((pages, kv_heads, page, dim), float("nan"), dtype=kernel.kv_dtype)
            table = torch.randperm(pages, generator=g)[:need].to(torch.int32)
            # The values the pool holds (rounded to its type), in float32.
            keys = torch.randn(kv_heads, n, dim, generator=g).to(kernel.kv_dtype).float()
            values = torch.randn(kv_heads, n, dim, generator=g).to(kernel.kv_dtype).float()
            idx = table.long()
            split_k = kpool[idx].permute(1, 0, 3, 2).reshape(kv_heads, -1, dim)
            split_k[:, :n] = keys
            kpool[idx] = split_k.view(kv_heads, need, page, dim).permute(1, 0, 3, 2)
            split_v = vpool[idx].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
            split_v[:, :n] = values
            vpool[idx] = split_v.view(kv_heads, need, page, dim).permute(1, 0, 2, 3)
            q = torch.randn(kv_heads * group, new, dim, generator=g) * 3
            got = kernel(q.transpose(0, 1), kpool, vpool, table, start, dim**-0.5)
            assert got.shape == (new, kv_heads * group, dim)
            mask = torch.ones(new, n, dtype=torch.bool).tril(start)
            want = F.scaled_dot_product_attention(
                rounded(q * dim**-0.5)[None],
                rounded(keys)[None],
                rounded(values)[None],
                attn_mask=mask,
                enable_gqa=True,
                scale=1.0,
            )[0]
            atol = 2**-9 * values.abs().max().item() + 1e-5 if bf16 else 1e-5
            assert torch.allclose(got.transpose(0, 1), want, atol=atol), (start, new)


def test_preempted_sequences_resume_to_the_tokens_they_get_alone() -> None:
    """A pool too small for every sequence at once: the youngest are preempted, recomputed
    and rejoin; each ends with exactly the tokens it gets with the pool to itself."""
    roomy, tight = engine_with(), engine_with(budget_pages=12)  # 192 tokens
    prompts = [tokens(n, 100 + n) for n in (40, 35, 50, 30)]
    params = [SamplingParams(max_tokens=40, stop_on_eos=False) for _ in prompts]
    alone = [generate(roomy, [p], [s])[0].tokens for p, s in zip(prompts, params, strict=True)]
    batch = DecodeBatch(tight)
    preempted = 0
    done = {}
    for i, p in enumerate(prompts):
        if tight.pool.fits(len(p) + 1):
            batch.add(str(i), tight.prefill(p), params[i])
    waiting = [str(i) for i in range(len(prompts)) if str(i) not in batch.running]
    pending: dict[str, list[int]] = {}
    while len(batch) or waiting or pending:
        done.update((c.id, c.tokens) for c in batch.step())
        for p in batch.take_preempted():
            preempted += 1
            pending[p.id] = p.output
        for sid in list(pending):
            out = pending[sid]
            need = len(prompts[int(sid)]) + len(out) + 16
            if tight.pool.fits(need) or not len(batch):
                kv = tight.prefill(prompts[int(sid)] + out[:-1]).kv
                batch.rejoin(sid, kv, len(prompts[int(sid)]), out, params[int(sid)])
                del pending[sid]
        for sid in list(waiting):
            if tight.pool.fits(len(prompts[int(sid)]) + 16):
                batch.add(sid, tight.prefill(prompts[int(sid)]), params[int(sid)])
                waiting.remove(sid)
    assert preempted > 0
    assert [done[str(i)] for i in range(len(prompts))] == alone
    assert tight.pool.pages.used == 0


def test_loading_the_native_kernel_leaves_the_process_float_state_alone() -> None:
    """A shared object built with -ffast-math sets flush-to-zero for the whole process when
    it is loaded: every torch op of a worker would then flush subnormals to 0."""
    if native.load(16, 16) is None:
        pytest.skip("no C compiler here: the native kernel cannot be built")
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a subnormal float32
    assert float(tiny * 1.0) != 0.0
    assert float(torch.tensor([1e-38]) / 100) > 0.0


def test_a_bfloat16_pools_rounding_is_torchs() -> None:
    """kv_put (paged_attention.c: how a fused decode step writes its k and v into a bfloat16
    pool) rounds every float32 as torch's .to(torch.bfloat16) does, bit for bit: ties to
    even both ways, subnormals, the largest finite values (which round to infinity),
    infinities, and a NaN of any payload to a NaN."""
    path = native.build(native.SOURCE, native._shape(16, 16, True), "kv rounding")
    if path is None:
        pytest.skip("no C compiler here: the native kernel cannot be built")
    fn = ctypes.CDLL(str(path)).mc_kv_put
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long], None
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x00008000, 0x7F7FFFFF,
                         0x7F7F8000, 0x00000001, 0x80000001, 0x7F800000, 0xFF800000, 0x7F800001,
                         0xFFC00000, 0x7FFFFFFF, 0, 0x80000000])  # fmt: skip
    src = torch.cat([bits, ties]).to(torch.int32).view(torch.float32).contiguous()
    got = torch.empty(src.numel(), dtype=torch.bfloat16)
    fn(src.data_ptr(), got.data_ptr(), src.numel())
    want = src.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
