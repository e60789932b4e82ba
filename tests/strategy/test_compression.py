"""Compressors within their formats' error bounds, bytes = payload + scales, error feedback, and compressed
communication in DiLoCo, averaging and SPARTA (bytes against formulas, equivalences, training quality)."""

import math

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.comm.transport import all_gather_bytes
from exogym.comm.compression import (ErrorFeedback, FP4Quantizer, FP8Quantizer, IntQuantizer, TopK, minifloat_grid,
                                round_to_minifloat)
from exogym.strategy import (AveragingCommunicator, CommunicateOptimizeStrategy, DiLoCoCommunicator, DiLoCoStrategy,
                             OptimSpec, SPARTAStrategy)
from exogym.strategy.sparta import SparseCommunicator, TopKSparseCommunicator
from strategy_toys import FIT, NODES, node_params, watched_module

SHAPES = [(16, 8), (16,), (3, 16), (3,)]  # TinyMLP's parameters, in order
SGD = OptimSpec(torch.optim.SGD, lr=0.05)


def rows_of_mixed_scale(rows=6, width=50, seed=0):
    """Rows whose magnitudes span 1e-3..1e3, one all-zero row: scales must be per row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x[2] = 0.0
    return x


def blocks(x, size):
    flat = x.reshape(-1)
    return torch.cat([flat, flat.new_zeros(-flat.numel() % size)]).reshape(-1, size)


def bound_per_entry(x, block_size, top, rule):
    """rule(|x|, s) per entry, s = max |row or block| / top, shaped like x."""
    r = blocks(x, block_size) if block_size else x.reshape(-1, x.shape[-1])
    s = r.abs().amax(1, keepdim=True) / top
    return rule(r.abs(), s.expand_as(r)).reshape(-1)[:x.numel()].reshape(x.shape)


# ---- round trips within each format's bound -----------------------------------------------------
@pytest.mark.parametrize("bits, block_size", [(8, None), (4, None), (8, 16), (4, 7)])
def test_int_quantizer_error_is_at_most_half_a_step(bits, block_size):
    x = rows_of_mixed_scale()
    q = IntQuantizer(bits, block_size=block_size)
    err = (x - q.decode(q.encode(x))).abs()
    bound = bound_per_entry(x, block_size, 2 ** (bits - 1) - 1, lambda a, s: s / 2)
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() > 0.3 * bound.max()  # the bound is attained in order of magnitude: nothing is sent unrounded


def test_fp8_is_torch_float8_e4m3_scaled_per_row():
    x = rows_of_mixed_scale()
    q = FP8Quantizer()
    err = (x - q.decode(q.encode(x))).abs()
    # 3 mantissa bits: half a step is <= 2^-4 of |x| for normal numbers, 2^-10 s among the subnormals
    assert (err <= bound_per_entry(x, None, 448.0, lambda a, s: torch.maximum(a * 2 ** -4, s * 2 ** -10))
            * (1 + 1e-6)).all()
    grid = minifloat_grid(4, 3, nan_code=True)
    assert grid[-1] == 448 and grid.numel() == 127
    # our own rounding to the e4m3 grid gives torch's float8 bits, ties (the midpoints) and saturation included
    mid = (grid[:-1] + grid[1:]) / 2
    y = torch.cat([torch.randn(5000) * 50, mid, -mid, torch.tensor([0.0, -0.0, 1e6, -1e6, 448.0])])
    assert torch.equal(round_to_minifloat(y, grid), y.to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp4_values_lie_on_the_e2m1_grid_and_are_packed_two_per_byte():
    x = rows_of_mixed_scale(width=51)
    q = FP4Quantizer(block_size=17)
    payload = q.encode(x)
    codes, scales = payload.tensors
    assert codes.dtype == torch.uint8 and codes.numel() == math.ceil(x.numel() / 2)
    y = q.decode(payload)
    s = blocks(x, 17).abs().amax(1, keepdim=True) / 6
    on_grid = (blocks(y, 17) / torch.where(s > 0, s, 1)).abs()
    assert torch.isin(on_grid.round(decimals=5), torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])).all()
    # 1 mantissa bit: half a step <= |x| / 4, and s / 4 near zero
    assert ((x - y).abs() <= bound_per_entry(x, 17, 6.0, lambda a, s: torch.maximum(a / 4, s / 4)) * (1 + 1e-6)).all()


def test_topk_sends_the_largest_entries_exactly_and_zero_elsewhere():
    x = torch.randn(10, 20, generator=torch.Generator().manual_seed(1))
    y = TopK(0.1).decode(TopK(0.1).encode(x))
    top = x.abs().reshape(-1).topk(20).indices
    assert torch.equal(y.reshape(-1)[top], x.reshape(-1)[top]) and (y != 0).sum() == 20


@pytest.mark.parametrize("compressor, shape, expected", [
    (IntQuantizer(8), (16, 8), 128 + 4 * 16),           # codes + one float32 scale per row
    (IntQuantizer(4), (3, 5), 8 + 4 * 3),               # 15 codes packed two per byte
    (IntQuantizer(8, block_size=64), (1000,), 1000 + 4 * 16),
    (FP8Quantizer(), (16, 8), 128 + 4 * 16),
    (FP4Quantizer(block_size=32), (7, 9), 32 + 4 * 2),  # 63 codes -> 32 bytes
    (TopK(0.1), (20, 10), 20 * (4 + 4)),                # int32 indices + float32 values
    (TopK(0.1, values=IntQuantizer(4)), (20, 10), 20 * 4 + 10 + 4),
    (ErrorFeedback(FP8Quantizer()), (5,), 5 + 4),
])
def test_payload_bytes_are_codes_plus_scales(compressor, shape, expected):
    payload = compressor.encode(torch.randn(shape), key="k")
    assert payload.nbytes == compressor.nbytes(shape) == expected


# ---- error feedback --------------------------------------------------------------------------------
def test_error_feedback_sends_in_sum_what_was_meant():
    g = torch.Generator().manual_seed(0)
    updates = [torch.linspace(-1, 1, 200) + torch.randn(200, generator=g) for _ in range(300)]  # a drift + noise
    meant = torch.stack(updates).sum(0)
    with_memory, without = ErrorFeedback(TopK(0.05)), TopK(0.05)
    sent_ef = sum(with_memory.decode(with_memory.encode(u, key="w")) for u in updates)
    sent_plain = sum(without.decode(without.encode(u)) for u in updates)
    assert_close(sent_ef + with_memory.residuals["w"], meant, rtol=1e-4, atol=1e-3)  # nothing is lost, only late
    assert (sent_ef - meant).norm() < 0.05 * meant.norm()
    assert (sent_plain - meant).norm() > 0.5 * meant.norm()  # without memory, most of it never arrives


# ---- compressed communication in the modules -------------------------------------------------------
def fit(strategy, nodes=3, steps=20, data=256):
    NODES.clear()
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(data))
    model = trainer.fit(strategy, nodes, batch_size=8, max_steps=steps, **FIT)
    return model, trainer.record


def test_diloco_bytes_per_round_are_k_minus_1_times_the_compressed_model():
    H, steps, k = 5, 20, 3
    _, record = fit(DiLoCoStrategy(SGD, H=H, quantization_bits=8), nodes=k, steps=steps)
    int8 = sum(math.prod(s) + 4 * (math.prod(s) // s[-1]) for s in SHAPES)  # codes + a scale per row
    assert record.bytes_per_node == [steps // H * all_gather_bytes(int8, k)] * k == [steps // H * 2 * int8] * k
    assert record.comm_per_node[0]["calls_by_op"] == {"all_gather": steps // H}
    topk_int4 = TopK(0.25, values=IntQuantizer(4))
    _, record = fit(DiLoCoStrategy(SGD, H=H, compression=ErrorFeedback(topk_int4)), nodes=k, steps=steps)
    ks = [round(0.25 * math.prod(s)) for s in SHAPES]
    per_round = sum(4 * n + (n + 1) // 2 + 4 for n in ks)  # indices, packed values, one scale
    assert record.bytes_per_node == [steps // H * (k - 1) * per_round] * k


def test_sparta_quantized_values_and_topk_bytes():
    steps, k = 4, 2
    _, record = fit(SPARTAStrategy(SGD, p_sparta=0.25, sparsification_mode="sequential", quantization_bits=8),
                    nodes=k, steps=steps)
    values = [max(1, round(0.25 * math.prod(s))) for s in SHAPES]
    assert record.bytes_per_node == [steps * (k - 1) * sum(n + 4 for n in values)] * k
    _, record = fit(SPARTAStrategy(SGD, p_sparta=0.25, compression_method="topk", quantization_bits=8), nodes=k,
                    steps=steps)
    assert record.bytes_per_node == [steps * (k - 1) * sum(4 * n + n + 4 for n in values)] * k


def test_compressed_averaging_is_diloco_with_outer_sgd_at_lr_1_and_keeps_nodes_identical():
    q = IntQuantizer(4, block_size=8)
    averaged, _ = fit(CommunicateOptimizeStrategy([watched_module(AveragingCommunicator)(H=3, compression=q)], SGD),
                      steps=9)
    nodes = [node_params(r) for r in range(3)]
    assert all(torch.equal(nodes[0], n) for n in nodes[1:])  # every node decoded the same payloads in rank order
    outer = OptimSpec(torch.optim.SGD, lr=1.0)
    diloco, _ = fit(CommunicateOptimizeStrategy([DiLoCoCommunicator(H=3, outer_optim_spec=outer, compression=q)],
                                                SGD), steps=9)
    for a, b in zip(averaged.parameters(), diloco.parameters()):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sparta_topk_with_every_entry_is_averaging_every_step():
    topk, _ = fit(SPARTAStrategy(SGD, p_sparta=1.0, compression_method="topk"), steps=6)
    dense, _ = fit(SPARTAStrategy(SGD, p_sparta=1.0), steps=6)
    for a, b in zip(topk.parameters(), dense.parameters()):
        assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_diloco_with_int8_outer_gradients_trains_as_well_as_full_precision():
    data = toy.make_classification(1024)
    x, y = data.tensors

    def final_loss(**kwargs):
        model = Trainer(toy.TinyMLP(), data).fit(DiLoCoStrategy("adamw", lr=3e-3, H=10, **kwargs), 4, batch_size=16,
                                                 max_steps=150, **FIT)
        with torch.no_grad():
            return model((x, y))["loss"].item()

    full, int8 = final_loss(), final_loss(quantization_bits=8)
    assert full < 0.2  # it did learn
    assert abs(int8 - full) < 0.03 * full


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_codecs_and_compressed_diloco_on_the_gpu():
    x = rows_of_mixed_scale()
    for c in (IntQuantizer(8), IntQuantizer(4, block_size=7), FP8Quantizer(), FP4Quantizer(block_size=16),
              TopK(0.1, values=IntQuantizer(8))):
        on_gpu = c.decode(c.encode(x.cuda()))
        assert on_gpu.device.type == "cuda"
        assert_close(on_gpu.cpu(), c.decode(c.encode(x)))
    make = lambda: DiLoCoStrategy(SGD, H=3, compression=ErrorFeedback(TopK(0.3, values=FP4Quantizer())))  # noqa: E731
    records = []
    for device in ("cpu", "cuda"):
        trainer = Trainer(toy.TinyMLP(), toy.make_classification(256))
        trainer.fit(make(), 2, batch_size=8, max_steps=6, **{**FIT, "device": device})
        records.append(trainer.record)
    assert records[0].bytes_per_node == records[1].bytes_per_node


# ---- validation, in pairs ---------------------------------------------------------------------------
@pytest.mark.parametrize("make, error, message, boundary", [
    (lambda: DiLoCoStrategy(quantization_bits=3), ValueError, "quantization_bits must be 8 or 4",
     lambda: DiLoCoStrategy(quantization_bits=4)),
    (lambda: DiLoCoStrategy(quantization_bits=8, compression=IntQuantizer(8)), TypeError, "pass one",
     lambda: DiLoCoStrategy(compression=IntQuantizer(8))),
    (lambda: DiLoCoStrategy(compression="int8"), TypeError, "compression must be an exogym.comm.compression Compressor",
     lambda: DiLoCoStrategy(compression=FP8Quantizer())),
    (lambda: AveragingCommunicator(island_size=2, quantization_bits=8), ValueError, "drop island_size=2",
     lambda: AveragingCommunicator(island_size=None, quantization_bits=8)),
    (lambda: SparseCommunicator(0.1, compression=TopK(0.5)), TypeError, "for top-k use TopKSparseCommunicator",
     lambda: SparseCommunicator(0.1, compression=FP4Quantizer())),
    (lambda: TopKSparseCommunicator(0.1, compression=ErrorFeedback(IntQuantizer())), TypeError,
     "must be IntQuantizer, FP8Quantizer or FP4Quantizer", lambda: TopKSparseCommunicator(0.1, quantization_bits=4)),
    (lambda: SPARTAStrategy(compression_method="random"), ValueError, "compression_method must be None",
     lambda: SPARTAStrategy(compression_method="topk")),
    (lambda: SPARTAStrategy(compression_method="topk", sparsification_mode="sequential"), ValueError,
     "drop sparsification_mode='sequential'", lambda: SPARTAStrategy(compression_method="topk", p_sparta=1.0)),
    (lambda: IntQuantizer(16), ValueError, "bits must be 8 or 4", lambda: IntQuantizer(4)),
    (lambda: IntQuantizer(8, block_size=0), ValueError, "block_size must be >= 1", lambda: IntQuantizer(block_size=1)),
    (lambda: TopK(0.0), ValueError, "fraction must be > 0", lambda: TopK(1.0)),
    (lambda: TopK(1.5), ValueError, "fraction must be <= 1.0", lambda: TopK(1e-9)),
    (lambda: ErrorFeedback(ErrorFeedback(TopK(0.1))), TypeError, "ErrorFeedback wraps a compressor",
     lambda: ErrorFeedback(TopK(0.1))),
])
def test_validation_pairs(make, error, message, boundary):
    with pytest.raises(error) as info:
        make()
    assert message in str(info.value)
    boundary()

