"""The 4-bit and 8-bit matmul kernel against the same sums in float64 (torch), on every
instruction path this CPU runs: AVX-512 VNNI, AVX2 with and without VNNI, plain C.

The reference quantizes each 32-wide block of an input row as the kernel does (float32,
round half to even), multiplies the integers exactly and scales each block in float64;
the kernel's float32 sums may differ from it by their rounding only."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from kvserve.model.cpu_kernels import quant_matmul
from kvserve.model.cpu_kernels.build import build
from kvserve.model.cpu_kernels.quant_layout import BLOCK, pack, packed_columns, unpack
from kvserve.model.cpu_kernels.quant_matmul import QuantMatmul

X86 = platform.machine() in ("x86_64", "AMD64")
VARIANTS = {
    "native": (),
    "avx2-vnni": ("-mno-avx512f",),
    "avx2": ("-mno-avx512f", "-mno-avxvnni"),
    "portable": ("-mno-avx2", "-mno-avx512f", "-mno-avxvnni", "-mno-fma", "-mno-f16c"),
}
"""Flags that turn the wider paths off (x86); each builds what this CPU can run."""


@pytest.fixture(scope="module", params=list(VARIANTS))
def kernel(request, kernel_cache, monkeypatch_module) -> QuantMatmul:
    if request.param != "native" and not X86:
        pytest.skip("the variants' flags are x86's")
    monkeypatch_module.setenv("KVSERVE_KERNEL_CACHE", str(kernel_cache))
    built = build(quant_matmul.SOURCE, VARIANTS[request.param])
    dequantize = build(quant_matmul.DEQUANTIZE_SOURCE, VARIANTS[request.param])
    if built.path is None or dequantize.path is None:
        pytest.skip(f"no kernel here: {built.reason or dequantize.reason}")
    return QuantMatmul(ctypes.CDLL(str(built.path)), ctypes.CDLL(str(dequantize.path)))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def quantized_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K/32, 32] as float64, dx [M, K/32] float32): x as the kernel rounds it."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(blocks * inverse[..., None]).clamp(-127, 127).double(), d


def reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    bits: int,
) -> torch.Tensor:
    """sum_b dx_b * (scale_b * codes . xq + offset_b * sum(xq)), codes [N, K] in column order."""
    xq, dx = quantized_input(x)
    blocks = dx.shape[1]
    q = codes.double().reshape(codes.shape[0], blocks, BLOCK)
    dx = dx.double()[:, None]
    if bits == 8:
        dots = torch.einsum("mbk,nbk->mnb", xq, q - 128)
        return (dots * dx).sum(-1) * scales.double()
    s = scales.double()
    o = -8 * s if offsets is None else offsets.double()
    dots = torch.einsum("mbk,nbk->mnb", xq, q)
    return (dots * s * dx).sum(-1) + (o * dx * xq.sum(-1)[:, None]).sum(-1)


def assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within float32's rounding of sums of a few hundred terms (relative to the row's scale:
    the 4-bit offsets and the 8-bit codes' +128 cancel large partial sums)."""
    scale = expected.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    error = ((out.double() - expected).abs() / scale).max().item()
    assert error < 2e-5, error


SHAPES = [(1, 64, 576), (5, 48, 1536), (9, 33, 640), (4, 16, 64), (2, 20, 512)]
"""(rows, outputs, inputs): short windows (576 = one window and 2 blocks; 640, 64), whole
windows only (512, 1536), tiles of 1 and 2 rows, 4-bit codes packed (up to 4 rows) and
unpacked (5 rows and more), outputs not a multiple of 16."""


@pytest.mark.parametrize(("rows", "outputs", "inputs"), SHAPES)
@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("with_offsets", [True, False])
def test_4_bit_weights(kernel, rows, outputs, inputs, scales_dtype, with_offsets):
    gen = torch.Generator().manual_seed(rows * inputs)
    codes = torch.randint(0, 16, (outputs, inputs), generator=gen)
    scales = (torch.rand(outputs, inputs // 32, generator=gen) / 50).to(scales_dtype)
    offsets = (torch.randn(outputs, inputs // 32, generator=gen) / 20).to(scales_dtype)
    offsets = offsets if with_offsets else None
    x = torch.randn(rows, inputs, generator=gen)
    x[:, 5] *= 40  # an outlier column, as activations have
    out = kernel(x, pack(codes, 4), scales, offsets)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    assert_close(out, reference(x, codes, scales, offsets, 4))


@pytest.mark.parametrize(("rows", "outputs", "inputs"), SHAPES)
def test_8_bit_weights(kernel, rows, outputs, inputs):
    gen = torch.Generator().manual_seed(rows + inputs)
    codes = torch.randint(1, 256, (outputs, inputs), generator=gen)  # w + 128, w in -127..127
    scales = torch.rand(outputs, generator=gen) / 100
    x = torch.randn(rows, inputs, generator=gen)
    out = kernel(x, pack(codes, 8), scales, None)
    assert_close(out, reference(x, codes, scales, None, 8))


def test_bfloat16_rows_in_and_out(kernel):
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (40, 1024), generator=gen)
    scales = (torch.rand(40, 32, generator=gen) / 50).half()
    x = torch.randn(6, 1024, generator=gen).bfloat16()
    out = kernel(x, pack(codes, 4), scales, None)
    assert out.dtype == torch.bfloat16
    expected = reference(x.float(), codes, scales, None, 4)
    assert ((out.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_round_to_int8_half_to_even_exactly(kernel, dtype):
    """Inputs whose blocks scale by 1 and 2, with halves to round, against integer weights:
    every sum is exact, so the output is the reference's to the bit, and a block rounded
    half away from zero (or clamped, or summed wrong) would show."""
    halves = [62.5, 63.5, -62.5, -0.5, 0.5, 1.5, 2.5, -2.5, 125.0, 126.5, -3.5, 7.5]
    block0 = torch.tensor([127.0] + halves + [0.0] * (BLOCK - 1 - len(halves)))
    block1 = 2 * block0  # scaled by 2: the same halves after the scaling
    x = torch.stack([torch.cat([block0, block1]), torch.cat([-block1, block0.flip(0)])])
    x = torch.cat([x, x], dim=1).to(dtype)  # 128 columns: 4 blocks, one short window
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (24, 128), generator=gen)
    scales = torch.ones(24, 4, dtype=torch.float16)
    offsets = torch.full((24, 4), -7.0, dtype=torch.float16)
    out = kernel(x, pack(codes, 4), scales, offsets)
    expected = reference(x.float(), codes, scales, offsets, 4)
    assert torch.equal(out.float(), expected.to(dtype).float())


def test_an_input_blocks_scale_is_its_largest_magnitude_divided_by_127(kernel):
    """amax / 127 rounded once, as torch's division (0.985 / 127 is an ulp away from
    0.985 times a rounded 1/127): with one block of the row non-zero and unit weights'
    scales the output is that block's integer dot product times its scale, to the bit."""
    gen = torch.Generator().manual_seed(8)
    rows = []
    for amax in (0.985, 0.937, 0.966, 0.5, 3.3):
        block = torch.rand(BLOCK, generator=gen) * 2 * amax - amax
        block[3] = -amax
        rows.append(torch.cat([torch.zeros(BLOCK), block]))  # 64 columns: 2 blocks
    x = torch.stack(rows)
    codes = torch.randint(0, 16, (16, 64), generator=gen)
    scales = torch.ones(16, 2, dtype=torch.float16)
    out = kernel(x, pack(codes, 4), scales, torch.zeros(16, 2, dtype=torch.float16))
    xq, dx = quantized_input(x)
    dots = xq[:, 1] @ codes[:, BLOCK:].double().T  # exact integers
    assert torch.equal(out, (dots * dx[:, 1:].double()).float())


def batch_case(rows: int) -> tuple[torch.Tensor, list[tuple]]:
    """`rows` input rows, and (codes, scales, offsets) of 4-bit and 8-bit weights."""
    gen = torch.Generator().manual_seed(4)
    inputs = 1600  # three whole windows and a short one
    packed4 = pack(torch.randint(0, 16, (70, inputs), generator=gen), 4)
    scales = (torch.rand(70, inputs // 32, generator=gen) / 50).half()
    packed8 = pack(torch.randint(1, 256, (70, inputs), generator=gen), 8)
    row_scales = torch.rand(70, generator=gen) / 100
    x = torch.randn(rows, inputs, generator=gen)
    return x, [(packed4, scales, scales), (packed8, row_scales, None)]


def test_a_rows_result_does_not_depend_on_its_batch(kernel):
    """9 rows unpack each 4-bit weight row to a byte a code first; 1 to 4 rows read the
    packed codes: the same bits either way (all below the AMX tiles' rows)."""
    x, weights = batch_case(9)
    assert kernel.tile_rows == 0 or kernel.tile_rows > 9
    for args in weights:
        whole = kernel(x, *args)
        for first, last in ((0, 1), (3, 4), (2, 9), (5, 9)):
            assert torch.equal(kernel(x[first:last].contiguous(), *args), whole[first:last])


def test_zero_rows_and_refused_shapes(kernel):
    packed = pack(torch.zeros(8, 64, dtype=torch.int32), 4)
    scales = torch.ones(8, 2, dtype=torch.float16)
    assert torch.equal(kernel(torch.zeros(3, 64), packed, scales, None), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="cannot run"):
        kernel(torch.zeros(1, 96), torch.zeros(8, 96, dtype=torch.uint8), torch.ones(8), None)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_weights_in_the_packed_column_order(kernel, bits, dtype):
    """What a matmul of many rows multiplies by: each weight code * scale + offset (float32:
    the weights bit for bit; bfloat16: rounded once), its columns in packed_columns' order."""
    gen = torch.Generator().manual_seed(bits)
    inputs = 1600
    codes = torch.randint(0, 2**bits, (24, inputs), generator=gen)
    if bits == 4:
        scales = (torch.rand(24, inputs // 32, generator=gen) / 50).half()
        offsets = (torch.randn(24, inputs // 32, generator=gen) / 20).half()
        weights = codes.view(24, -1, 32) * scales.float()[..., None] + offsets.float()[..., None]
    else:
        scales, offsets = torch.rand(24, generator=gen) / 100, None
        weights = (codes.view(24, -1, 32) - 128) * scales[:, None, None]
    out = torch.empty(24, inputs, dtype=dtype)
    kernel.dequantize(pack(codes, bits), scales, offsets, out)
    columns = packed_columns(inputs)
    assert sorted(columns.tolist()) == list(range(inputs))
    expected = weights.reshape(24, inputs)[:, columns]
    if dtype == torch.float32 and bits == 4:
        assert torch.equal(out, expected)
    else:  # 8 bits: code * s - 128 s against (code - 128) * s, two roundings against one
        assert torch.allclose(out.float(), expected, rtol=2**-8, atol=0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("inputs", [64, 576, 1024, 1600])
def test_the_layout_round_trips(bits, inputs):
    codes = torch.randint(0, 2**bits, (7, inputs), generator=torch.Generator().manual_seed(bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (7, inputs * bits // 8)
    assert torch.equal(unpack(packed, inputs, bits), codes.int())
    with pytest.raises(ValueError, match="multiple of 64"):
        pack(codes[:, :32], bits)


@pytest.fixture
def tiles() -> QuantMatmul:
    """The process's kernel (the native build) where this CPU has AMX, tiles on again after
    the test (only that build has them)."""
    quant_matmul.enable()
    kernel = quant_matmul.kernel()
    if kernel is None or kernel.use_tiles(True) == 0:
        pytest.skip("no AMX tiles on this CPU (or no kernel)")
    yield kernel
    kernel.use_tiles(True)


def tile_reference(x, codes, scales, offsets, bits) -> torch.Tensor:
    """What the tiles multiply: each weight as float32 (code * scale + offset, one rounding)
    then bfloat16, the input as bfloat16; the sums in float64."""
    if bits == 4:
        s = scales.double().repeat_interleave(BLOCK, 1)
        o = -8 * s if offsets is None else offsets.double().repeat_interleave(BLOCK, 1)
        weights = codes.double() * s + o
    else:
        weights = codes.double() * scales.double()[:, None] - 128 * scales.double()[:, None]
    rounded = weights.float().bfloat16().double()
    return x.bfloat16().double() @ rounded.T


@pytest.mark.parametrize("rows", [10, 17, 40, 70, 150])
@pytest.mark.parametrize(("outputs", "inputs"), [(33, 576), (40, 1600), (16, 2048)])
@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows_on_amx_tiles(tiles, rows, outputs, inputs, bits):
    """10 rows and more: the weights dequantized to bfloat16, the input rounded to it, sums
    in float32 (70 rows: two passes of four 16-row groups; 150: two chunks of 128 rows, the
    weights dequantized again); short windows and 16 outputs."""
    gen = torch.Generator().manual_seed(rows * inputs + bits)
    codes = torch.randint(0, 16 if bits == 4 else 256, (outputs, inputs), generator=gen)
    if bits == 4:
        scales = (torch.rand(outputs, inputs // 32, generator=gen) / 50).half()
        offsets = (
            (torch.randn(outputs, inputs // 32, generator=gen) / 20).half() if rows % 2 else None
        )
    else:
        scales, offsets = torch.rand(outputs, generator=gen) / 100, None
    x = torch.randn(rows, inputs, generator=gen)
    out = tiles(x, pack(codes, bits), scales, offsets)
    expected = tile_reference(x, codes, scales, offsets, bits)
    error = ((out.double() - expected).abs() / expected.abs().amax(1, keepdim=True)).max().item()
    assert error < 1e-5, error
    integer = reference(x, codes, scales, offsets, bits)  # the VNNI path's sums: near, not equal
    assert ((out.double() - integer).abs() / integer.abs().amax(1, keepdim=True)).max() < 5e-2


def test_a_rows_result_on_tiles_does_not_depend_on_its_batch(tiles):
    x, weights = batch_case(40)
    for args in weights:
        whole = tiles(x, *args)
        for first, last in ((0, 10), (13, 40), (20, 37)):
            assert torch.equal(tiles(x[first:last].contiguous(), *args), whole[first:last])
        tiles.use_tiles(False)  # every call on VNNI: the integer path's bits again
        rows = torch.cat([tiles(x[i : i + 1].contiguous(), *args) for i in range(40)])
        assert torch.equal(tiles(x, *args), rows) and not torch.equal(whole, rows)
        assert tiles.use_tiles(True) == tiles.tile_rows > 0


def test_bfloat16_rows_on_amx_tiles(tiles):
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (40, 1024), generator=gen)
    scales = (torch.rand(40, 32, generator=gen) / 50).half()
    x = torch.randn(24, 1024, generator=gen).bfloat16()
    out = tiles(x, pack(codes, 4), scales, None)
    assert out.dtype == torch.bfloat16
    expected = tile_reference(x.float(), codes, scales, None, 4)
    assert ((out.double() - expected).abs() <= expected.abs() * 2**-8 + 1e-6).all()
